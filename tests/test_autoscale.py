"""MemoryGate (bytes in flight per source) and Autoscaler (per-source concurrency) on their own,
without a Loader: tables of states and what each admits or changes."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from streamload.pipeline.autoscale import Autoscaler, Knobs, MemoryGate

pytestmark = pytest.mark.core


async def admitted(gate: MemoryGate, n: int, owner) -> bool:
    """Whether acquire(n, owner) goes through now; a waiting acquire is cancelled."""
    task = asyncio.ensure_future(gate.acquire(n, owner))
    for _ in range(3):   # let it run up to its wait
        await asyncio.sleep(0)
    if task.done():
        return True
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return False


# (held by owner before, observed a decoded range, head, request (n, owner), admitted)
GATE_CASES = {
    "an idle gate admits even more than its limit": ({}, False, None, (500, "a"), True),
    "one range at a time until one was decoded": ({"a": 10}, False, None, (10, "b"), False),
    "within the limit once observed": ({"a": 10}, True, None, (50, "b"), True),
    "the limit exactly": ({"a": 10}, True, None, (90, "b"), True),
    "over the limit": ({"a": 10}, True, None, (91, "b"), False),
    "the head shard holding nothing may always start": ({"a": 90}, True, "b", (50, "b"), True),
    "even before any range was decoded": ({"a": 90}, False, "b", (50, "b"), True),
    "but not while it holds bytes": ({"a": 60, "b": 30}, True, "b", (50, "b"), False),
}


@pytest.mark.parametrize("case", GATE_CASES)
async def test_memory_gate_admits(case):
    held, observed, head, (n, owner), expected = GATE_CASES[case]
    gate = MemoryGate(limit=100)
    for who, amount in held.items():
        gate._add(amount, who)
    gate.observed = observed
    gate.set_head(head)
    assert await admitted(gate, n, owner) is expected
    # A cancelled wait took nothing.
    assert gate.used == sum(held.values()) + (n if expected else 0)


async def test_memory_gate_wakes_waiters_on_release_and_on_a_new_limit():
    gate = MemoryGate(limit=100)
    gate.observed = True
    await gate.acquire(80, "a")
    waiter = asyncio.ensure_future(gate.acquire(40, "b"))
    await asyncio.sleep(0)
    assert not waiter.done()
    gate.release(30, "a")                       # 50 + 40 fits
    await asyncio.wait_for(waiter, 5)
    assert gate.used == 90
    other = asyncio.ensure_future(gate.acquire(40, "c"))
    await asyncio.sleep(0)
    assert not other.done()
    gate.set_limit(200)                         # the memory plan gave this source more
    await asyncio.wait_for(other, 5)
    assert (gate.used, gate.peak, gate.excess_peak) == (130, 130, 0)


@pytest.mark.parametrize("raw, decoded, expansion", [
    (100, 300, 4.0),      # decoded smaller than reserved: the expansion seen so far stays
    (100, 700, 7.0),      # larger: later reservations use the new ratio
    (0, 50, 4.0),         # nothing raw (an item settled on its own): no ratio to learn
])
def test_memory_gate_settle_swaps_the_reservation_for_the_decoded_bytes(raw, decoded, expansion):
    gate = MemoryGate(limit=500)
    reserved = gate.reservation(raw)
    assert reserved == int(raw * 4.0)
    gate._add(reserved, "a")
    gate.settle(reserved, raw, decoded, "a")
    assert gate.used == decoded and gate.expansion == expansion
    assert gate.observed is (raw > 0)
    assert gate.peak == max(reserved, decoded)
    assert gate.excess_peak == max(reserved, decoded, 500) - 500   # past the limit, if ever
    gate.release(decoded, "a")
    assert gate.used == 0 and gate._by_owner == {}


# knobs (shards, readahead) before; waits per step (s) over the window; blocked fraction at the
# decision; knobs after
AUTOSCALE_CASES = {
    "a source that made steps wait grows": ((2, 2), 0.01, 0.0, (4, 4)),
    "growth stops at the ceilings": ((8, 8), 0.01, 0.0, (8, 8)),
    "a ceiling reached on one knob": ((4, 8), 0.01, 0.0, (8, 8)),
    "waits at the threshold are no waits": ((2, 2), 1e-3, 0.0, (2, 2)),
    "waiting beats a full buffer": ((2, 2), 0.01, 0.9, (4, 4)),
    "a full buffer shrinks readahead first": ((2, 2), 0.0, 0.9, (2, 1)),
    "then shards": ((3, 1), 0.0, 0.9, (2, 1)),
    "never below one": ((1, 1), 0.0, 0.9, (1, 1)),
    "a buffer half full is left alone": ((2, 2), 0.0, 0.5, (2, 2)),
}


@pytest.mark.parametrize("case", AUTOSCALE_CASES)
def test_autoscaler_decides_every_few_steps(case):
    (shards, readahead), wait, blocked, after = AUTOSCALE_CASES[case]
    knobs = Knobs(shards, readahead, max_shards=8, max_readahead=8)
    steady = Knobs(2, 2, max_shards=8, max_readahead=8)   # a second source, never waiting
    scaler = Autoscaler([knobs, steady], every=3, wait_threshold_s=1e-3, full_threshold=0.5)
    for step in range(2):   # nothing is decided before `every` steps
        scaler.observe(step, np.array([wait, 0.0]), np.array([blocked, 0.0]))
        assert (knobs.shards, knobs.readahead) == (shards, readahead)
    scaler.observe(2, np.array([wait, 0.0]), np.array([blocked, 0.0]))
    assert (knobs.shards, knobs.readahead) == after
    assert knobs.history == ([] if after == (shards, readahead) else [(2, *after)])
    assert (steady.shards, steady.readahead, steady.history) == (2, 2, [])
    # The window starts over: one more quiet window changes nothing.
    for step in range(3, 6):
        scaler.observe(step, np.zeros(2), np.zeros(2))
    assert (knobs.shards, knobs.readahead) == after
