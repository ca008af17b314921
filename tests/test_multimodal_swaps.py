"""Swaps between ranks after an image step is planned (`plan/swaps.py`): the same items, every
row within C and the caps, the slowest rank never slower, and lower where the balancer's own
refinement (four least loaded ranks) leaves the top rank's partner out."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamload.plan import planner as planner_module
from streamload.plan.caps import RowCaps, row_visual
from streamload.plan.cost import CostModel
from streamload.plan.planner import Planner
from streamload.plan.swaps import applies, refine_swaps
from streamload.plan.types import Candidates, Geometry
from test_multimodal_caps import image_candidates
from test_plan_properties import _with_overdue, check_plan

COST = CostModel(a=1e-4, b=1.0)


def rank_costs(c, take, rank, length, geometry, cost=COST):
    w = cost.doc_cost(np.asarray(length)) + c.extra_cost[take]
    return np.bincount(np.asarray(rank, np.int64), w, minlength=geometry.ranks)


def plan(c, geometry, method, swaps, monkeypatch, caps=RowCaps(), targets=None, **options):
    monkeypatch.setattr(planner_module, "SWAPS", swaps)
    targets = np.array([float(geometry.step_tokens)]) if targets is None else targets
    return Planner(geometry, COST, method=method, lookahead=2, caps=caps,
                   **options).assign(c, targets, 0)


@pytest.mark.core
def test_a_swap_with_a_rank_past_the_four_least_loaded_evens_the_step():
    # Six ranks, one full row each (C = 1000: two items of 500). Rank 0 holds two image items
    # (encoder cost 300 each), rank 5 two text items; ranks 1-4 one of each. Only a swap of
    # rank 0's image item for rank 5's text item evens the step; ranks 1-4 are less loaded
    # than rank 5 only by their order, so a search over the four least loaded misses it.
    extra = {0: [300, 300], 1: [300, 0], 2: [300, 0], 3: [300, 0], 4: [300, 0], 5: [0, 0]}
    c = Candidates.from_windows([[np.array([500, 500])] for _ in range(6)],
                                extra_costs=[[np.array(extra[r], float)] for r in range(6)],
                                images=[[np.array([1 if e else 0 for e in extra[r]])]
                                        for r in range(6)],
                                patches=[[np.array([100 if e else 0 for e in extra[r]])]
                                         for r in range(6)])
    geometry = Geometry(ranks=6, micro_batches=1, capacity=1000)
    take = np.arange(12)
    rank = np.repeat(np.arange(6), 2).astype(np.int32)
    row = np.zeros(12, np.int32)
    before = rank_costs(c, take, rank, c.length, geometry)
    new_rank, new_row = refine_swaps(c, take, rank, row, c.length, geometry, COST)
    after = rank_costs(c, take, new_rank, c.length, geometry)
    assert before.max() - before.min() == 600
    assert after.max() == after.min()                          # every rank: one of each
    tokens = np.bincount(new_rank * 1 + new_row, c.length, minlength=6)
    assert (tokens <= 1000).all()
    # Deterministic: the same answer again.
    again = refine_swaps(c, take, rank, row, c.length, geometry, COST)
    assert (again[0] == new_rank).all() and (again[1] == new_row).all()


@pytest.mark.core
def test_a_swap_never_takes_a_row_over_a_cap():
    # Two ranks, one full row each (two items of 500). Rank 0: two image items of encoder cost
    # 400 and 100 patches each; rank 1: an image item of 200 patches (cost 0 here) and a text
    # item. Uncapped, a swap of an image item of rank 0 for the text item evens the step. With
    # 250 patches per row every swap that moves cost takes a row over (300 patches), so the
    # plan stays as it is; at 300 the swap is back.
    c = Candidates.from_windows([[np.array([500, 500])], [np.array([500, 500])]],
                                extra_costs=[[np.array([400.0, 400.0])], [np.array([0.0, 0.0])]],
                                images=[[np.array([1, 1])], [np.array([1, 0])]],
                                patches=[[np.array([100, 100])], [np.array([200, 0])]])
    geometry = Geometry(ranks=2, micro_batches=1, capacity=1000)
    take, rank, row = np.arange(4), np.array([0, 0, 1, 1], np.int32), np.zeros(4, np.int32)
    before = rank_costs(c, take, rank, c.length, geometry)
    for cap, evens in ((None, True), (250, False), (300, True)):
        new_rank, new_row = refine_swaps(c, take, rank, row, c.length, geometry, COST,
                                         RowCaps(patches=cap))
        after = rank_costs(c, take, new_rank, c.length, geometry)
        assert (after.max() == after.min()) == evens, cap
        assert after.max() <= before.max()
        if cap is not None:
            assert (row_visual(c, take, new_rank, new_row, geometry)[..., 1] <= cap).all()
        if not evens:
            assert (new_rank == rank).all()


@pytest.mark.core
def test_the_pass_runs_where_ranks_are_the_bins_only():
    # image and text steps alike (`refine_swaps`: the round loop on images, `_shed` on text)
    flat = Geometry(ranks=2, micro_batches=2, capacity=4096)
    assert applies(flat, COST)
    assert not applies(Geometry(1, 2, 4096), COST)                     # one rank
    assert not applies(Geometry(2, 2, 4096, pipeline_stages=4), COST)  # 1F1B rows
    assert not applies(flat, CostModel(a=1e-4, b=1.0, document_masking=False))


@pytest.mark.core
@pytest.mark.parametrize("method", ["balanced", "lookahead"])
@pytest.mark.parametrize("ranks,micro_batches", [(4, 1), (8, 2)])
def test_with_swaps_the_same_items_and_never_a_slower_step(method, ranks, micro_batches,
                                                            monkeypatch):
    geometry = Geometry(ranks=ranks, micro_batches=micro_batches, capacity=4096)
    caps = RowCaps(images=12, patches=4096)
    lowered = 0
    for seed in range(8):
        c = image_candidates(seed, ranks, 24)
        off = plan(c, geometry, method, False, monkeypatch, caps)
        on = plan(c, geometry, method, True, monkeypatch, caps)
        check_plan(c, geometry, COST, on)
        assert sorted(on.take.tolist()) == sorted(off.take.tolist())      # the same items
        assert dict(zip(on.take.tolist(), on.length.tolist())) == \
            dict(zip(off.take.tolist(), off.length.tolist()))
        assert on.rank_cost.max() <= off.rank_cost.max() * (1 + 1e-12)
        lowered += on.rank_cost.max() < off.rank_cost.max() * (1 - 1e-6)
        load = row_visual(c, on.take, on.rank, on.row, geometry)
        assert (load[..., 0] <= 12).all() and (load[..., 1] <= 4096).all()
        again = plan(c, geometry, method, True, monkeypatch, caps)
        assert (again.take == on.take).all() and (again.rank == on.rank).all() and \
            (again.row == on.row).all()
    assert lowered > 0   # the pass changes plans on this data


@st.composite
def overdue_problems(draw):
    R = draw(st.integers(2, 6))
    M = draw(st.integers(1, 3))
    c = image_candidates(draw(st.integers(0, 2 ** 16)), R, draw(st.integers(2, 20)))
    geometry = Geometry(R, M, 4096)
    return geometry, c, np.array([geometry.step_tokens * draw(st.sampled_from([0.5, 1.0, 1.6]))])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=overdue_problems(), method=st.sampled_from(["balanced", "lookahead"]),
       seed=st.integers(0, 2 ** 16))
@pytest.mark.core
def test_overdue_items_are_taken_with_the_swaps(problem, method, seed):
    """The swaps move items, never drop one: the deferral bound is the planner's."""
    geometry, c, targets = problem
    p = Planner(geometry, COST, method=method, max_age=2, lookahead=2,
                caps=RowCaps(images=12, patches=4096))
    assert planner_module.SWAPS
    c = _with_overdue(c, geometry, targets, p.force_age, np.random.default_rng(seed),
                      max_items=geometry.ranks * geometry.micro_batches)
    a = p.assign(c, targets, step=0)
    check_plan(c, geometry, COST, a)
    overdue = np.flatnonzero(c.age >= p.force_age)
    assert np.isin(overdue, a.take).all()


@pytest.mark.core
def test_of_equal_swaps_the_one_that_sends_an_item_home_is_taken():
    # Three ranks, one full row each (two items of 500). The plan put rank 2's image item G on
    # rank 0, beside rank 0's image item A (encoder cost 400 each); ranks 1 and 2 hold text
    # (rank 2's E with an extra cost of 1). Trading A or G for a text item of rank 1 lowers
    # rank 0 the most (to 1,451); trading G for E, to 1,452 (within HOME_SLACK of it), sends G
    # home and moves no more tokens than the plan did (the others add 500 or 1,000): taken.
    c = Candidates.from_windows([[np.array([500])], [np.array([500, 500])],
                                 [np.array([500, 500, 500])]],
                                extra_costs=[[np.array([400.0])], [np.zeros(2)],
                                             [np.array([400.0, 1.0, 0.0])]],
                                images=[[np.array([1])], [np.zeros(2, np.int64)],
                                        [np.array([1, 0, 0])]],
                                patches=[[np.array([100])], [np.zeros(2, np.int64)],
                                         [np.array([100, 0, 0])]])
    A, C, D, G, E, F = range(6)
    geometry = Geometry(ranks=3, micro_batches=1, capacity=1000)
    take = np.array([A, G, C, D, E, F])
    rank = np.array([0, 0, 1, 1, 2, 2], np.int32)
    new_rank, _ = refine_swaps(c, take, rank, np.zeros(6, np.int32), c.length[take], geometry,
                               COST)
    where = dict(zip(take.tolist(), new_rank.tolist()))
    assert where[G] == 2 and where[A] == 0     # G went home, A stayed home
    costs = rank_costs(c, take, new_rank, c.length[take], geometry)
    assert costs.max() < rank_costs(c, take, rank, c.length[take], geometry).max()


@pytest.mark.core
def test_text_steps_move_items_to_a_rank_with_room_past_the_least_loaded():
    # Text (no images): moves only. C = 1000, M = 1, 20 ranks, a = 1e-3. Rank 0: a 900-token
    # document and a 100-token one (1,710 + 110). Ranks 1-16, the least loaded: a full row of
    # fifty 20-token items (1,020 each); with 811 items the pass's partners are 16 ranks, these.
    # Ranks 17-19: 700 + 100 + 100 tokens (1,410), 100 tokens of room. The one move that lowers
    # rank 0 sends its 100-token item to one of ranks 17-19: past the least loaded ranks.
    windows = [[np.array([900, 100])]] + [[np.full(50, 20)] for _ in range(16)] + \
        [[np.array([700, 100, 100])] for _ in range(3)]
    c = Candidates.from_windows(windows)
    geometry = Geometry(ranks=20, micro_batches=1, capacity=1000)
    cost = CostModel(a=1e-3, b=1.0)
    take = np.arange(len(c))
    rank = c.rank[take].astype(np.int32)
    row = np.zeros(take.size, np.int32)
    before = rank_costs(c, take, rank, c.length[take], geometry, cost)
    new_rank, new_row = refine_swaps(c, take, rank, row, c.length[take], geometry, cost)
    after = rank_costs(c, take, new_rank, c.length[take], geometry, cost)
    assert int(np.argmax(before)) == 0 and before.max() == pytest.approx(1820.0)
    assert after.max() == pytest.approx(1710.0)      # rank 0 keeps only its long document
    assert new_rank[1] in (17, 18, 19) and (new_rank[2:] == rank[2:]).all()
    assert np.bincount(new_rank, c.length[take], minlength=20).max() <= 1000


@pytest.mark.core
def test_text_steps_swap_a_long_item_for_a_shorter_one_and_refill_where_no_move_fits():
    # Text, C = 1000, M = 2, a = 1e-3, every row of ranks 1 and 2 full (no move fits). Rank 0:
    # a 900-token document in one row; a 500-token one and twenty 25-token items in the other
    # (2,972.5). Ranks 1 and 2: a 300-token document and 28 short items; a 600-token document
    # and 16 short items (2,477.5). Swapping rank 0's 500 for rank 1's 300 and sending 8 short
    # items back to fill the row the 300 left evens the step to 2,817.5 / 2,632.5 / 2,477.5:
    # the cost of the 500 beyond its tokens moves to rank 1, the tokens stay where they were.
    short = np.full
    windows = [[np.concatenate([[900, 500], short(20, 25)])]] + \
        [[np.concatenate([[300, 600], short(44, 25)])] for _ in range(2)]
    c = Candidates.from_windows(windows)
    geometry = Geometry(ranks=3, micro_batches=2, capacity=1000)
    cost = CostModel(a=1e-3, b=1.0)
    take = np.arange(len(c))
    rank = c.rank[take].astype(np.int32)
    first = np.flatnonzero(c.position[take] == 0)       # each rank's first document: row 0
    row = np.ones(take.size, np.int32)
    row[first] = 0
    row[(c.rank[take] > 0) & (c.position[take] >= 2) & (c.position[take] < 2 + 28)] = 0
    fill = np.bincount(rank.astype(np.int64) * 2 + row, c.length[take], minlength=6)
    assert fill.tolist() == [900, 1000, 1000, 1000, 1000, 1000]
    before = rank_costs(c, take, rank, c.length[take], geometry, cost)
    assert before.tolist() == pytest.approx([2972.5, 2477.5, 2477.5])
    new_rank, new_row = refine_swaps(c, take, rank, row, c.length[take], geometry, cost)
    after = rank_costs(c, take, new_rank, c.length[take], geometry, cost)
    assert after.max() == pytest.approx(2817.5)
    assert sorted(after.tolist()) == pytest.approx([2477.5, 2632.5, 2817.5])
    five_hundred = int(np.flatnonzero(c.length[take] == 500)[0])
    assert new_rank[five_hundred] != 0                  # the 500 went, the 900 stayed
    assert new_rank[np.flatnonzero(c.length[take] == 900)[0]] == 0
    fill = np.bincount(new_rank.astype(np.int64) * 2 + new_row, c.length[take], minlength=6)
    assert fill.max() <= 1000 and fill.sum() == 5900


@pytest.mark.core
@pytest.mark.parametrize("ranks,micro_batches", [(4, 1), (8, 2), (40, 2)])
def test_on_text_steps_the_same_items_rows_within_c_and_never_a_slower_step(
        ranks, micro_batches, monkeypatch):
    # Long-tail text windows (most items short, some near C), planned with and without the pass.
    geometry = Geometry(ranks=ranks, micro_batches=micro_batches, capacity=4096)
    lowered = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        windows = [[np.minimum(4096, np.where(rng.random(60) < 0.1,
                                              rng.integers(1000, 4097, 60),
                                              rng.integers(8, 200, 60)))]
                   for _ in range(ranks)]
        c = Candidates.from_windows(windows)
        off = plan(c, geometry, "balanced", False, monkeypatch)
        on = plan(c, geometry, "balanced", True, monkeypatch)
        check_plan(c, geometry, COST, on)
        assert sorted(on.take.tolist()) == sorted(off.take.tolist())
        assert dict(zip(on.take.tolist(), on.length.tolist())) == \
            dict(zip(off.take.tolist(), off.length.tolist()))
        assert on.rank_cost.max() <= off.rank_cost.max() * (1 + 1e-12)
        lowered += on.rank_cost.max() < off.rank_cost.max() * (1 - 1e-6)
        again = plan(c, geometry, "balanced", True, monkeypatch)
        assert (again.take == on.take).all() and (again.rank == on.rank).all() and \
            (again.row == on.row).all()
    assert lowered > 0
