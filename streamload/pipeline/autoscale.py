"""Memory budget and adaptive per-source concurrency.

Memory: `plan.memory.MemoryPlan` splits the loader's `memory_budget` (bytes per rank) between
the buffers and each source's bytes in flight (fetched ranges not yet decoded, decoded items
not yet buffered); a `MemoryGate` enforces the bytes in flight.

Concurrency: each source has two knobs, the shards it reads (and decodes) at once and the byte
ranges in flight per shard. Every few steps, a source that made a step wait gets more of both
(up to what its memory allows), and a source whose buffer sat full gets less, so a slow or heavy
source does not starve the step and a light one does not hog memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .changes import Changes



class MemoryGate:
    """Bytes in flight for one source, by owner (a shard).

    A fetch reserves, before it starts, what its range will hold once decoded (its size times
    the largest decoded/raw ratio seen so far, `expansion`), and `acquire` waits while that
    would exceed the limit. Decoded items are then accounted at their true size (`settle`,
    which never waits: the bytes already exist) until they reach the buffer. One exception
    keeps the ordered pipeline from deadlocking: the shard being drained (`head`) may always
    start a fetch while it holds nothing. So the bound is the limit plus one range of the head
    shard, plus whatever a range decodes to beyond the expansion seen so far."""

    def __init__(self, limit: int, expansion: float = 4.0):
        self.limit = limit
        self.expansion = expansion
        self.observed = False   # until a range has been decoded, fetch one at a time
        self.used = 0
        self.peak = 0
        self.excess_peak = 0    # the most `used` went past the limit in force at the time
        self.head = None
        self._by_owner: dict = {}
        self._changes = Changes()

    def set_limit(self, limit: int) -> None:
        """A new limit (the memory plan moved bytes between sources); waiters check again."""
        self.limit = limit
        self._changes.notify()

    def reservation(self, raw_bytes: int) -> int:
        return int(raw_bytes * self.expansion)

    def settle(self, reserved: int, raw_bytes: int, decoded: int, owner) -> None:
        """Swap a fetch's reservation for the decoded bytes it produced."""
        if raw_bytes:
            self.expansion = max(self.expansion, decoded / raw_bytes)
            self.observed = True
        self._add(decoded - reserved, owner)
        self._changes.notify()

    def _add(self, n: int, owner) -> None:
        self.used += n
        left = self._by_owner.get(owner, 0) + n
        if left:
            self._by_owner[owner] = left
        else:
            self._by_owner.pop(owner, None)
        self.peak = max(self.peak, self.used)
        self.excess_peak = max(self.excess_peak, self.used - self.limit)

    def _may_take(self, n: int, owner) -> bool:
        if self.used == 0 or (self.observed and self.used + n <= self.limit):
            return True
        return owner == self.head and self._by_owner.get(owner, 0) == 0

    async def acquire(self, n: int, owner) -> None:
        while not self._may_take(n, owner):
            await self._changes.wait()
        self._add(n, owner)

    def release(self, n: int, owner) -> None:
        self._add(-n, owner)
        self._changes.notify()

    def set_head(self, owner) -> None:
        self.head = owner
        self._changes.notify()


@dataclass
class Knobs:
    """A source's concurrency, read by its fetcher each time it starts a shard or a range."""
    shards: int
    readahead: int
    max_shards: int
    max_readahead: int
    history: list = field(default_factory=list)   # (step, shards, readahead) changes

    def grow(self, step: int) -> bool:
        if self.shards >= self.max_shards and self.readahead >= self.max_readahead:
            return False
        self.shards = min(self.max_shards, self.shards * 2)
        self.readahead = min(self.max_readahead, self.readahead * 2)
        self.history.append((step, self.shards, self.readahead))
        return True

    def shrink(self, step: int) -> bool:
        if self.shards <= 1 and self.readahead <= 1:
            return False
        if self.readahead >= self.shards:
            self.readahead = max(1, self.readahead - 1)
        else:
            self.shards = max(1, self.shards - 1)
        self.history.append((step, self.shards, self.readahead))
        return True


class Autoscaler:
    """Every `every` steps: grow the knobs of sources that made steps wait, shrink the knobs
    of sources whose buffers sat full (their producer was blocked) and never made one wait."""

    def __init__(self, knobs: list[Knobs], every: int = 8, wait_threshold_s: float = 1e-3,
                 full_threshold: float = 0.5):
        self.knobs = knobs
        self.every, self.wait_threshold_s, self.full_threshold = every, wait_threshold_s, full_threshold
        self._waits = np.zeros(len(knobs))
        self._steps = 0

    def observe(self, step: int, waits_s: np.ndarray, blocked_fraction: np.ndarray) -> None:
        self._waits += waits_s
        self._steps += 1
        if self._steps < self.every:
            return
        for s, knobs in enumerate(self.knobs):
            if self._waits[s] > self.wait_threshold_s * self._steps:
                knobs.grow(step)
            elif blocked_fraction[s] > self.full_threshold:
                knobs.shrink(step)
        self._waits[:] = 0
        self._steps = 0
