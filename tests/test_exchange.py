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
    from streamload.dist.comm import connect
    from streamload.dist.exchange import exchange_tokens
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
