"""Issue 20: the epoch's last steps (`plan/epoch_end.py`): once the windows hold the rest of the
epoch, the heaviest items go first and the lightest wait for the last step. Deterministic
constructed cases (no timing)."""
from __future__ import annotations

import numpy as np
import pytest

from streamload.plan import epoch_end
from streamload.plan import planner as planner_module
from streamload.plan.cost import CostModel
from streamload.plan.epoch_end import select_last_steps
from streamload.plan.planner import Planner
from streamload.plan.types import Candidates, Geometry

COST = CostModel(a=1 / 49152, b=1.0)
K = 1024
GEOMETRY = Geometry(4, 4, 128 * K, 4)     # R = 4, M = 4, P = 4: issue 20's 128k PP=4 at R = 4


def tail_lengths() -> np.ndarray:
    """Like what the Loader's 128k PP=4 epoch had left two steps before its end (2.0 steps of
    tokens): one source, 22 documents of 100-127k, 32 of 13-85k (whole documents: none may
    be cut)."""
    heavy = np.array([127, 127, 126, 126, 125, 124, 123, 121, 120, 119, 117, 116, 113, 112,
                      110, 107, 106, 106, 105, 104, 100, 100]) * K
    light = np.array([85, 82, 78, 72, 69, 66, 65, 64, 61, 57, 55, 54, 52, 49, 48, 47, 45,
                      43, 42, 40, 38, 35, 35, 34, 34, 30, 29, 28, 26, 17, 14, 13]) * K
    return np.concatenate([heavy, light])


def candidates(lengths, ages, ranks: int = 4) -> Candidates:
    """One source; item i sits in rank i % ranks's window, in order."""
    lengths, ages = np.asarray(lengths), np.asarray(ages)
    return Candidates.from_windows(
        [[lengths[r::ranks]] for r in range(ranks)], [[ages[r::ranks]] for r in range(ranks)])


def run_epoch_end(lengths, last_steps: bool, monkeypatch) -> list[dict]:
    """The Planner over the rest of an epoch (every window exhausted) until nothing is left:
    per step, the lengths taken and the step's 1F1B time and bound."""
    monkeypatch.setattr(planner_module, "EPOCH_END", last_steps)
    planner = Planner(GEOMETRY, COST, method="lookahead", max_age=16)
    left = [(int(n), 0) for n in lengths]                  # (length, age), in arrival order
    steps = []
    for step in range(20):
        if not left:
            break
        c = candidates([n for n, _ in left], [a for _, a in left])
        # The windows list items by rank: map candidate k back to its place in `left`.
        order = np.concatenate([np.arange(len(left))[r::4] for r in range(4)])
        plan = planner.assign(c, np.array([float(GEOMETRY.step_tokens)]), step,
                              rest_of_epoch=True)
        assert (plan.length == c.length[plan.take]).all()   # whole documents, never cut
        taken = set(order[plan.take].tolist())
        work = float(plan.row_cost.sum())
        steps.append({"taken": sorted(left[i][0] for i in taken),
                      "time": float(plan.step_time.max()),
                      "bound": work / GEOMETRY.ranks * GEOMETRY.work_time,
                      "tokens": int(plan.length.sum())})
        left = [(n, a + 1) for i, (n, a) in enumerate(left) if i not in taken]
    assert not left
    return steps


def test_the_heavy_documents_meet_early_and_the_last_step_holds_light_ones(monkeypatch):
    lengths = tail_lengths()
    before = run_epoch_end(lengths, False, monkeypatch)
    after = run_epoch_end(lengths, True, monkeypatch)
    for steps in (before, after):   # every document exactly once, over the same steps
        assert sorted(n for s in steps for n in s["taken"]) == sorted(lengths.tolist())
    assert len(after) <= len(before)
    # The heavy documents meet: none of them is left for the last step, which holds the
    # lightest (before: the lookahead held them for a layer, and the last step took them).
    assert max(after[-1]["taken"]) < GEOMETRY.capacity // 2
    assert max(before[-1]["taken"]) > 100 * K
    # And the epoch's end takes less time for the same work.
    total = [sum(s["time"] for s in steps) for steps in (before, after)]
    assert total[1] < 0.9 * total[0]
    assert sum(s["bound"] for s in after) == pytest.approx(sum(s["bound"] for s in before))


def test_the_lightest_items_wait_for_the_last_step_the_heaviest_go_now():
    lengths = tail_lengths()                     # 2.0 steps: three steps left
    c = candidates(lengths, np.zeros(lengths.size, np.int64))
    selected, forced, cell = select_last_steps(c, GEOMETRY, COST, 16)
    assert not forced.any()
    taken = np.sort(c.length[selected])
    left = np.sort(np.setdiff1d(np.arange(len(c)), selected))
    # Sixteen of the heavy documents go in this step (one per row), none of the lightest.
    assert (taken >= 100 * K).sum() == GEOMETRY.rows
    assert c.length[left].min() == 13 * K and 13 * K not in taken
    # The packing places every selected item within a row's capacity.
    fill = np.bincount(cell, weights=c.length[selected], minlength=GEOMETRY.rows)
    assert fill.max() <= GEOMETRY.capacity
    assert c.length[selected].sum() <= GEOMETRY.step_tokens


def test_an_overdue_item_is_taken_even_when_it_would_be_kept_last():
    lengths = tail_lengths()
    ages = np.zeros(lengths.size, np.int64)
    lightest = int(np.argmin(lengths))
    ages[lightest] = 16                           # overdue: the deferral bound
    c = candidates(lengths, ages)
    selected, forced, _ = select_last_steps(c, GEOMETRY, COST, 16)
    at = np.flatnonzero(c.length == lengths[lightest])
    assert np.isin(at, selected).all() and forced[np.isin(selected, at)].all()


def test_only_the_last_steps_are_sorted():
    # The rest needs more than LAST_STEPS steps: the lookahead plans as ever.
    step = GEOMETRY.step_tokens
    lengths = np.full((epoch_end.LAST_STEPS * step) // (60 * K) + 8, 60 * K)
    c = candidates(lengths, np.zeros(lengths.size, np.int64))
    assert select_last_steps(c, GEOMETRY, COST, 16) is None
    # A rest that fits this step is all taken (nothing kept).
    lengths = np.full(30, 60 * K)
    c = candidates(lengths, np.zeros(lengths.size, np.int64))
    selected, _, _ = select_last_steps(c, GEOMETRY, COST, 16)
    assert selected.size == 30


def test_beyond_max_rows_the_last_steps_are_planned_as_ever():
    # The same rest over more rows than MAX_ROWS (M = 4): the lookahead plans it.
    ranks = epoch_end.MAX_ROWS // GEOMETRY.micro_batches + 1
    wide = Geometry(ranks, 4, 128 * K, 4)
    lengths = np.tile(tail_lengths(), ranks // 4 + 1)[:ranks * 10]
    c = candidates(lengths, np.zeros(lengths.size, np.int64), ranks=ranks)
    assert 1 <= epoch_end.steps_left(c, wide, np.ones(len(c), bool)) <= epoch_end.LAST_STEPS
    assert select_last_steps(c, wide, COST, 16) is None
    assert select_last_steps(c, Geometry(ranks - 1, 4, 128 * K, 4), COST, 16) is not None


@pytest.mark.parametrize("exhausted", [True, False])
def test_the_stepper_tells_the_planner_when_the_windows_hold_the_rest(monkeypatch, exhausted):
    from streamload.config import Source, make_config
    from streamload.plan.stepper import Stepper
    stepper = Stepper.build(make_config(micro_batch_tokens=64, micro_batches=2, seed=0,
                                        epochs=1, planner="lookahead"),
                            [Source("a/"), Source("b/")], None, 2)
    seen = []
    assign = Planner.assign

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("rest_of_epoch"))
        return assign(self, *args, **kwargs)
    monkeypatch.setattr(Planner, "assign", spy)
    windows = [[np.array([40, 30]), np.array([20])], [np.array([50]), np.array([10, 60])]]
    step = stepper.begin(Candidates.from_windows(windows),
                         np.array([[True, True], [True, exhausted]]))
    plan = stepper.assign(step)
    assert seen == [exhausted] and len(plan) > 0


@pytest.mark.parametrize("rest_of_epoch", [False, True])
def test_an_overdue_item_of_a_source_without_a_share_is_taken_at_the_end_too(rest_of_epoch):
    """The deferral bound holds in the epoch's last steps as in the lookahead: an overdue item
    is taken even where the schedule gives its source no share this step."""
    ranks, capacity = 4, 1000
    geometry = Geometry(ranks, 1, capacity)
    windows = [[np.array([100]), np.full(12, 100)] for _ in range(ranks)]
    ages = [[np.array([16 if r == 0 else 0]), np.zeros(12, np.int64)] for r in range(ranks)]
    c = Candidates.from_windows(windows, ages)
    planner = Planner(geometry, CostModel(a=1 / 1024, b=1.0), method="lookahead", max_age=16)
    plan = planner.assign(c, np.array([0.0, float(geometry.step_tokens)]), 0,
                          eligible=np.array([False, True]), rest_of_epoch=rest_of_epoch)
    overdue = np.flatnonzero((c.source == 0) & (c.age >= 16))
    assert overdue.size == 1 and np.isin(overdue, plan.take).all()
