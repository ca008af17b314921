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
