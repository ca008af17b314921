"""exchange_tokens on real gloo ranks, with items of different token dtypes."""
from __future__ import annotations

import numpy as np
import pytest

from distributed import run_ranks

pytestmark = pytest.mark.timeout(120)


def plan(world):
    rng = np.random.default_rng(0)
    n = 12
    holder, dest = rng.integers(0, world, n), rng.integers(0, world, n)
    # byte tokens (uint8) and tokenizer ids (int32) side by side, as a mixed loader holds them
    tokens = [rng.integers(0, 256, size=int(rng.integers(1, 9))).astype(np.uint8) if e % 2 else
              rng.integers(0, 100_000, size=int(rng.integers(1, 9))).astype(np.int32)
              for e in range(n)]
    return holder, dest, tokens


def exchange_job(rank, world):
    from streamload.collective.comm import connect
    from streamload.collective.exchange import exchange_tokens
    holder, dest, tokens = plan(world)
    lengths = np.array([t.shape[0] for t in tokens])
    mine = {e: tokens[e] for e in np.flatnonzero(holder == rank).tolist()}
    entries, received = exchange_tokens(connect(30.0), holder, dest, lengths, mine)
    return entries.tolist(), [r.tolist() for r in received]


def test_exchange_delivers_every_planned_item_whatever_its_dtype():
    world = 2
    holder, dest, tokens = plan(world)
    for rank, (entries, received) in enumerate(run_ranks(exchange_job, world)):
        assert entries == np.flatnonzero(dest == rank).tolist()
        assert received == [tokens[e].tolist() for e in entries]


GATHER_SIZES = [3, 0, 5000, 700, 20000, 1, 1, 2500]   # per call; rank r sends size + r values


def gather_job(rank, world):
    from streamload.collective.comm import connect
    comm = connect(30.0)
    results, capacities = [], []
    for call, size in enumerate(GATHER_SIZES):
        # Ranks send different lengths, and some calls outgrow the capacity the last one set.
        array = np.arange(size + rank, dtype=np.int64) * (call + 1) + rank
        results.append([a.tolist() for a in comm.all_gather(array)])
        capacities.append(comm.gather_capacity)
    return results, capacities


def test_all_gather_returns_every_rank_array_across_capacity_changes():
    world = 3
    outcomes = run_ranks(gather_job, world)
    for results, capacities in outcomes:
        for call, (size, gathered) in enumerate(zip(GATHER_SIZES, results)):
            assert gathered == [(np.arange(size + r) * (call + 1) + r).tolist()
                                for r in range(world)]
        # The capacity follows the longest array, identically on every rank.
        assert capacities == [max(1024, 2 * (size + world - 1)) for size in GATHER_SIZES]
    assert all(c == outcomes[0][1] for _, c in outcomes)
