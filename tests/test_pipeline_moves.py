"""Issue 20: the moves after the plan under 1F1B (`plan/pipeline_moves.py`). Deterministic
constructed and seeded cases (no timing)."""
from __future__ import annotations

import numpy as np
import pytest

from streamload.plan import planner as planner_module
from streamload.plan.caps import RowCaps
from streamload.plan.cost import CostModel, pipeline_time
from streamload.plan.pipeline_moves import MAX_ROWS, applies, pipeline_moves
from streamload.plan.planner import Planner
from streamload.plan.types import Candidates, Geometry

COST = CostModel(a=1 / 49152, b=1.0)
K = 1024


def step_time(length, rank, row, geometry: Geometry, cost: CostModel = COST) -> float:
    R, M = geometry.ranks, geometry.micro_batches
    rows = cost.row_costs(np.asarray(length), np.asarray(rank, np.int64) * M + row, R * M)
    return float(pipeline_time(rows.reshape(R, M), geometry.pipeline_stages).max())


@pytest.mark.parametrize("moves", [True, False])
def test_the_epochs_last_step_gives_its_heaviest_document_a_rank_of_its_own(monkeypatch,
                                                                             moves):
    """The Loader's last step at 128k, P = 4, R = 4 (issue 20's benchmark): six long documents
    of one source are left. The lookahead holds the heaviest for a layer and the top-up puts
    it in a free row of the rank that holds the second heaviest, so that rank pays both, the
    heavier four times (565k). Moved, the heaviest sits alone and the step costs what it costs
    on its own (469k): no plan of these items can be faster."""
    monkeypatch.setattr(planner_module, "PIPELINE_MOVES", moves)
    geometry = Geometry(4, 4, 128 * K, 4)
    held = [[129217, 115289], [112382], [108309], [70155, 69392]]
    empty = np.zeros(0, np.int64)
    c = Candidates.from_windows([[empty] * 3 + [np.array(h)] + [empty] for h in held],
                                [[empty] * 3 + [np.full(len(h), 5)] + [empty] for h in held])
    targets = np.array([0.0, 0.0, 0.0, 1e9, 0.0])
    plan = Planner(geometry, COST, method="lookahead", max_age=16).assign(c, targets, 0)
    assert sorted(plan.take.tolist()) == list(range(len(c)))          # every document, once
    heaviest = float(COST.doc_cost(np.array([129217]))[0])
    time = float(plan.step_time.max())
    if moves:
        assert time == pytest.approx(heaviest)
    else:   # what the test guards against
        assert time > 1.15 * heaviest


def _random_plan(rng, geometry: Geometry):
    """A feasible random plan: items dealt to random rows with room."""
    R, M, C = geometry.ranks, geometry.micro_batches, geometry.capacity
    n = int(rng.integers(4, 40))
    heavy = rng.random(n) < 0.2
    length = np.where(heavy, rng.integers(C // 2, C + 1, n), rng.integers(1, C // 8, n))
    fill = np.zeros(R * M, np.int64)
    cells = np.full(n, -1)
    for i in rng.permutation(n):
        ok = np.flatnonzero(fill + length[i] <= C)
        if ok.size:
            cells[i] = rng.choice(ok)
            fill[cells[i]] += length[i]
    keep = cells >= 0
    return length[keep], cells[keep]


@pytest.mark.parametrize("seed", range(40))
def test_moves_keep_the_items_and_the_rows_and_never_slow_the_step(seed):
    rng = np.random.default_rng(seed)
    R, M, P = int(rng.integers(2, 5)), int(rng.integers(2, 5)), int(rng.integers(2, 5))
    geometry = Geometry(R, M, 4 * K, P)
    length, cells = _random_plan(rng, geometry)
    c = Candidates.from_windows([[length]] + [[np.zeros(0, np.int64)]] * (R - 1))
    take = np.arange(len(c))
    rank, row = cells // M, cells % M
    before = step_time(length, rank, row, geometry)
    new_rank, new_row = pipeline_moves(c, take, rank, row, length, geometry, COST)
    assert new_rank.shape == new_row.shape == take.shape
    assert ((0 <= new_rank) & (new_rank < R) & (0 <= new_row) & (new_row < M)).all()
    fill = np.bincount(new_rank.astype(np.int64) * M + new_row, weights=length, minlength=R * M)
    assert fill.max() <= geometry.capacity
    assert step_time(length, new_rank, new_row, geometry) <= before


def test_moves_lower_most_random_plans():
    """Random plans are far from balanced: the pass must find moves in most of them (were it a
    no-op, the test above would still pass)."""
    lowered = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        R, M, P = int(rng.integers(2, 5)), int(rng.integers(2, 5)), int(rng.integers(2, 5))
        geometry = Geometry(R, M, 4 * K, P)
        length, cells = _random_plan(rng, geometry)
        c = Candidates.from_windows([[length]] + [[np.zeros(0, np.int64)]] * (R - 1))
        rank, row = cells // M, cells % M
        new = pipeline_moves(c, np.arange(len(c)), rank, row, length, geometry, COST)
        lowered += step_time(length, *new, geometry) < step_time(length, rank, row, geometry)
    assert lowered >= 30, lowered


def test_a_heavy_rows_short_documents_leave_its_rank():
    """One rank of two holds a document of 100k with short ones in its row, and its other row
    full of short ones; the other rank has room. Under 1F1B the heavy row is paid P times:
    its short documents go to the other rank, and the step gets faster by about P times
    their cost over P."""
    geometry = Geometry(2, 2, 128 * K, 4)
    length = np.array([100 * K] + [4 * K] * 7 + [4 * K] * 32 + [4 * K] * 8)
    cells = np.array([0] * 8 + [1] * 32 + [2] * 8)     # rank 1's row 3 is empty
    c = Candidates.from_windows([[length], [np.zeros(0, np.int64)]])
    rank, row = cells // 2, cells % 2
    before = step_time(length, rank, row, geometry)
    new_rank, new_row = pipeline_moves(c, np.arange(len(c)), rank, row, length, geometry, COST)
    after = step_time(length, new_rank, new_row, geometry)
    heavy_row_items = (new_rank == new_rank[0]) & (new_row == new_row[0])
    assert heavy_row_items.sum() < 8                     # short documents left the heavy row
    assert after < before - float(COST.doc_cost(np.array([4 * K]))[0])


def test_where_the_pass_runs():
    text = Candidates.from_windows([[np.array([10, 20])], [np.array([5])]])
    assert applies(text, Geometry(2, 4, 1024, 4), COST)
    assert not applies(text, Geometry(2, 4, 1024, 1), COST)            # no pipeline
    assert not applies(text, Geometry(2, 1, 1024, 4), COST)            # one row a rank
    assert not applies(text, Geometry(1, 4, 1024, 4), COST)            # one rank
    assert not applies(text, Geometry(2, 4, 1024, 4), CostModel(a=1e-3, document_masking=False))
    assert not applies(text, Geometry(MAX_ROWS // 4 + 1, 4, 1024, 4), COST)
    images = Candidates.from_windows([[np.array([10, 20])], [np.array([5])]],
                                     images=[[np.array([1, 0])], [np.array([2])]],
                                     patches=[[np.array([64, 0])], [np.array([128])]])
    assert applies(images, Geometry(2, 4, 1024, 4), COST)
    assert not applies(images, Geometry(2, 4, 1024, 4), COST, RowCaps(images=2))


def test_whole_rows_swap_where_no_item_can_move():
    """Four full rows, two of one 128k document each and two of 128 short ones, with the two
    long ones on rank 0: no row has room for any item, so only whole rows can trade; after
    the swaps each rank holds one long row (its time (472k + 131k + 3 * 472k) / 4)."""
    from streamload.plan.pipeline_moves import _row_swaps
    geometry = Geometry(2, 2, 128 * K, 4)
    length = np.array([128 * K, 128 * K] + [K] * 256)
    cell = np.array([0, 1] + [2] * 128 + [3] * 128)
    weight = COST.doc_cost(length)
    new = _row_swaps(weight, cell, geometry, 8)
    rows = np.bincount(new, weights=weight, minlength=4).reshape(2, 2)
    assert np.bincount(new // 2, weights=(length == 128 * K), minlength=2).tolist() == [1, 1]
    assert all((new[cell == c] == new[cell == c][0]).all() for c in range(4))   # rows whole
    long_row, short_row = float(weight[0]), float(weight[2:130].sum())
    assert float(pipeline_time(rows, 4).max()) == pytest.approx(
        (long_row + short_row + 3 * long_row) / 4)
    before = np.bincount(cell, weights=weight, minlength=4).reshape(2, 2)
    assert float(pipeline_time(before, 4).max()) > 1.15 * float(pipeline_time(rows, 4).max())
