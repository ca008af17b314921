"""The top-up's pool worked out only as far as it is read (`fill.Leftovers`,
`select.interleaved_head`) gives the same as the pool worked out in full.

The head of the interleaved order must be a true prefix of the full order (restricted to the
short items), and hold the tokens asked for; the top-up must place the same items in the same
rows whichever way its pool comes.
"""
from __future__ import annotations

import numpy as np
import pytest

from streamload.plan.cost import CostModel
from streamload.plan.fill import Leftovers, top_up
from streamload.plan.select import interleaved, interleaved_head
from streamload.plan.types import Candidates, Geometry

pytestmark = pytest.mark.core


def _windows(rng, ranks: int, sources: int, longest: int, depth: int = 40):
    """Random windows: per source a different length scale and depth, some windows empty."""
    windows = []
    for _ in range(ranks):
        row = []
        for s in range(sources):
            n = int(rng.integers(0, depth)) if rng.random() > 0.1 else 0
            scale = [30, 300, 3000][s % 3]
            row.append(np.minimum(rng.geometric(1 / scale, n), longest).astype(np.int64))
        windows.append(row)
    return Candidates.from_windows(windows)


@pytest.mark.parametrize("seed", range(40))
def test_interleaved_head_is_a_prefix_of_the_full_order(seed):
    rng = np.random.default_rng(seed)
    c = _windows(rng, int(rng.integers(1, 9)), int(rng.integers(1, 5)), 4096)
    member = rng.random(len(c)) < 0.8
    if seed % 4 == 0:
        member[c.source == 0] = False                    # a source without members
    longest = int(rng.choice([50, 500, 4096]))
    full = interleaved(c, np.flatnonzero(member))
    short = full[c.length[full] <= longest]
    for tokens in (1.0, 0.05 * c.length[short].sum(), 0.3 * c.length[short].sum(),
                   float(c.length[short].sum()) + 1):
        head = interleaved_head(c, member, longest, tokens)
        if head is None:
            continue
        np.testing.assert_array_equal(head, short[:head.size])
        assert c.length[head].sum() >= tokens


@pytest.mark.parametrize("seed", range(30))
def test_the_top_up_places_the_same_with_a_lazy_pool(seed):
    rng = np.random.default_rng(seed)
    R, M = int(rng.choice([16, 40])), int(rng.choice([2, 4]))     # R·M > 64: the waves run
    C = 2048
    c = _windows(rng, R, 3, C, depth=400)
    geometry = Geometry(R, M, C, pipeline_stages=int(rng.choice([1, 4])))
    cost = CostModel(a=1 / 8192)
    # A plan that leaves the step short (random rows, 60% to 98% of the step): the top-up
    # reads a head of the pool when the step is nearly full, all of it otherwise.
    order = rng.permutation(len(c))
    fill = np.zeros(R * M, dtype=np.int64)
    take, cells = [], []
    budget = geometry.step_tokens * rng.choice([0.6, 0.95, 0.97, 0.98])
    for i in order.tolist():
        if fill.sum() >= budget:
            break
        fits = np.flatnonzero(fill + c.length[i] <= C)
        if fits.size:
            cell = int(rng.choice(fits))
            fill[cell] += c.length[i]
            take.append(i)
            cells.append(cell)
    take = np.asarray(take, dtype=np.int64)
    cells = np.asarray(cells, dtype=np.int64)
    rank, row = (cells // M).astype(np.int32), (cells % M).astype(np.int32)
    rest = np.setdiff1d(np.arange(len(c)), take)
    selected = np.concatenate([take, rest[rng.random(rest.size) < 0.1]])
    eligible = None if seed % 3 else rng.random(c.num_sources) < 0.7
    lazy = Leftovers(c, selected, take, eligible)
    full = Leftovers.of(c, lazy.all())
    for cost_aware in (True, False):
        a = top_up(c, take, rank, row, Leftovers(c, selected, take, eligible), geometry, cost,
                   overhead=0.0, cost_aware=cost_aware)
        b = top_up(c, take, rank, row, full, geometry, cost, overhead=0.0,
                   cost_aware=cost_aware)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("seed", range(30))
def test_rows_by_load_choose_the_row_the_full_pass_chooses(seed):
    """`fill._ByLoad` (the rows in a heap by load) finds the row `_Rows.best`'s pass over every
    row finds, ties included: whole-number costs make many rows tie on load, and rows at
    different loads tie once the item's cost is added in floating point."""
    from streamload.plan.fill import _ByLoad, _Rows
    rng = np.random.default_rng(seed)
    R, M, C = int(rng.integers(2, 12)), int(rng.choice([1, 2, 4])), 256
    geometry = Geometry(R, M, C, pipeline_stages=int(rng.choice([1, 4])))
    big = seed % 3 == 0       # costs of 2**53 and more: adding one to a small load rounds
    cost = CostModel(a=0.0, b=1.0 if not big else 2.0 ** 52)
    c = _windows(rng, R, 2, C // 2, depth=60)
    n = len(c)
    take = np.flatnonzero(rng.random(n) < 0.3)
    rank = rng.integers(0, R, take.size).astype(np.int32)
    row = rng.integers(0, M, take.size).astype(np.int32)
    # Keep rows within capacity: drop what overflows.
    cells = rank.astype(np.int64) * M + row
    csum = np.zeros(R * M, dtype=np.int64)
    keep = np.zeros(take.size, dtype=bool)
    for k, (cell, length) in enumerate(zip(cells.tolist(), c.length[take].tolist())):
        if csum[cell] + length <= C:
            csum[cell] += length
            keep[k] = True
    take, rank, row = take[keep], rank[keep], row[keep]
    rows = _Rows(c, take, rank, row, geometry, cost)
    if big:   # small loads against costs of 2**53 and more: load + cost rounds, loads 0-3 tie
        rows.load[:] = rng.integers(0, 4, rows.load.size).astype(np.float64)
    index = _ByLoad(rows)
    rest = np.setdiff1d(np.arange(n), take)
    checked = 0
    for item in rng.permutation(rest).tolist():
        if int(c.length[item]) > int(rows.room.max()):
            continue
        expect = rows.best(item)
        got = index.best(rows, item, int(c.length[item]))
        if got is not None:
            assert got == expect
            checked += 1
        rows.place(item, expect[0], expect[1])
        index.placed(rows, expect[0])
    assert checked > 0
