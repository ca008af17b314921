"""Property tests of the planner's invariants over random candidate sets and geometries.

Every method (naive, balanced, lookahead) must return a plan where every row holds at most C
tokens, every candidate is taken at most once, ranks and rows are in range, the predicted costs
match the cost model, and the same inputs give the same plan. Balanced and lookahead must also
take every overdue item when the overdue items fit, and a multi-step run of the coordinator
loop must deliver every item of a finite corpus exactly once with bounded deferral.
"""
from __future__ import annotations

import copy
import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamload.plan.cost import CostModel
from streamload.plan.planner import METHODS, NAIVE_CHECK_ITEMS, Planner
from streamload.plan.types import Candidates, Geometry

pytestmark = pytest.mark.core

# PLAN_EXAMPLES=1000 for a longer hunt; the default keeps the suite fast.
EXAMPLES = int(os.environ.get("PLAN_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def problems(draw, max_ranks=6, max_rows=4):
    """A geometry, a cost model, candidate windows and per-source targets."""
    R = draw(st.integers(1, max_ranks))
    M = draw(st.integers(1, max_rows))
    C = draw(st.sampled_from([8, 33, 128, 512]))
    S = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    skew = draw(st.sampled_from(["uniform", "long_tail", "few_long"]))
    windows, ages, extras = [], [], []
    for _ in range(R):
        wr, ar, er = [], [], []
        for _ in range(S):
            n = int(rng.integers(0, 9))
            if skew == "uniform":
                lengths = rng.integers(1, C + 1, n)
            elif skew == "long_tail":
                lengths = np.clip(np.rint(rng.lognormal(np.log(C / 8), 1.2, n)), 1, C)
            else:
                lengths = np.where(rng.random(n) < 0.2, C, rng.integers(1, max(2, C // 16), n))
            wr.append(lengths.astype(np.int64))
            ar.append(rng.integers(0, 6, n))
            er.append(np.where(rng.random(n) < 0.2, rng.uniform(0, C, n), 0.0))
        windows.append(wr), ages.append(ar), extras.append(er)
    c = Candidates.from_windows(windows, ages, extras)
    geometry = Geometry(R, M, C)
    fill = draw(st.sampled_from([0.3, 1.0, 1.6]))
    targets = rng.dirichlet(np.ones(S)) * geometry.step_tokens * fill
    cost = CostModel(a=draw(st.sampled_from([0.0, 1.0 / 64, 1.0 / 4096])),
                     b=1.0, document_masking=draw(st.booleans()))
    return geometry, cost, c, targets


def check_plan(c: Candidates, geometry: Geometry, cost: CostModel, a) -> None:
    R, M, C = geometry.ranks, geometry.micro_batches, geometry.capacity
    take = a.take
    assert take.shape == a.rank.shape == a.row.shape
    assert np.unique(take).size == take.size, "a candidate was taken twice"
    if take.size:
        assert take.min() >= 0 and take.max() < len(c)
        assert a.rank.min() >= 0 and a.rank.max() < R
        assert a.row.min() >= 0 and a.row.max() < M
    tokens = np.bincount(a.rank.astype(np.int64) * M + a.row, weights=c.length[take],
                         minlength=R * M)
    assert tokens.max(initial=0) <= C, "a row holds more than C tokens"
    assert a.rank_cost.shape == (R,)
    expected = cost.row_costs(c.length[take], a.rank.astype(np.int64) * M + a.row, R * M,
                              extra_cost=c.extra_cost[take]).reshape(R, M).sum(axis=1)
    np.testing.assert_allclose(a.rank_cost, expected, rtol=1e-9, atol=1e-9)


@SETTINGS
@given(problem=problems(), method=st.sampled_from(METHODS), max_age=st.sampled_from([None, 2]))
def test_plan_invariants_and_determinism(problem, method, max_age):
    geometry, cost, c, targets = problem
    planner = Planner(geometry, cost, method=method, max_age=max_age, lookahead=3)
    a = planner.assign(c, targets, step=7)
    check_plan(c, geometry, cost, a)
    # Same inputs (fresh copies), same step: the identical plan.
    b = Planner(geometry, cost, method=method, max_age=max_age, lookahead=3).assign(
        copy.deepcopy(c), targets.copy(), step=7)
    for x, y in ((a.take, b.take), (a.rank, b.rank), (a.row, b.row), (a.rank_cost, b.rank_cost)):
        assert np.array_equal(x, y)


def _with_overdue(c: Candidates, geometry: Geometry, targets: np.ndarray, force_age: int,
                  rng: np.random.Generator, max_items: int | None = None) -> Candidates:
    """Make some items overdue (at most `max_items`), at most half the step's capacity and
    within every source's target (so that taking all of them is feasible for any method that
    honours the bound). Every other field (images, patches) is kept."""
    age = np.zeros(len(c), dtype=np.int32)
    budget_total = geometry.step_tokens / 2
    budget = np.minimum(targets, budget_total) * 0.9
    spent = np.zeros(c.num_sources)
    for i in rng.permutation(len(c)):
        s = c.source[i]
        if rng.random() < 0.5 and spent[s] + c.length[i] <= budget[s] \
                and spent.sum() + c.length[i] <= budget_total \
                and (max_items is None or int((age >= force_age).sum()) < max_items):
            age[i] = force_age + int(rng.integers(0, 2))
            spent[s] += c.length[i]
        else:
            age[i] = int(rng.integers(0, force_age))
    return dataclasses.replace(c, age=age)


@SETTINGS
@given(problem=problems(), method=st.sampled_from(["balanced", "lookahead"]),
       seed=st.integers(0, 2 ** 16))
def test_overdue_items_are_always_taken(problem, method, seed):
    geometry, cost, c, targets = problem
    planner = Planner(geometry, cost, method=method, max_age=2, lookahead=3)
    c = _with_overdue(c, geometry, targets, planner.force_age, np.random.default_rng(seed))
    a = planner.assign(c, targets, step=0)
    check_plan(c, geometry, cost, a)
    overdue = np.flatnonzero(c.age >= planner.force_age)
    assert np.isin(overdue, a.take).all(), "an overdue item was left out"


@st.composite
def skewed(draw):
    """Arrival order puts the long documents first, where token-balanced filling gives them
    all to the first ranks. Few enough tokens that every method takes everything."""
    R = draw(st.integers(2, 6))
    M = draw(st.integers(2, 4))
    C = 256
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    n_long = draw(st.integers(1, 2 * R))
    n_short = draw(st.integers(2 * R, 6 * R))
    lengths = np.concatenate([rng.integers(C // 2, C + 1, n_long), rng.integers(4, 24, n_short)])
    # One source; arrival order is position-major, so deal the sequence round-robin.
    windows = [[lengths[r::R]] for r in range(R)]
    c = Candidates.from_windows(windows)
    geometry = Geometry(R, M, C)
    return geometry, c, np.array([float(lengths.sum())])


@SETTINGS
@given(problem=skewed())
def test_balanced_beats_naive_on_skewed_input(problem):
    geometry, c, targets = problem
    cost = CostModel(a=1.0 / 64, b=1.0)
    naive = Planner(geometry, cost, method="naive").assign(c, targets, 0)
    balanced = Planner(geometry, cost, method="balanced").assign(c, targets, 0)
    check_plan(c, geometry, cost, balanced)
    if len(naive) == len(balanced) == len(c):
        # LPT with refinement is a heuristic, not an optimum: on rare inputs it ended above the
        # naive order (hypothesis found 1533 vs 1529, then 2014 vs 1949). Up to
        # NAIVE_CHECK_ITEMS items the planner also tries the naive fill, so it is never worse.
        assert len(c) <= NAIVE_CHECK_ITEMS
        assert balanced.rank_cost.max() <= naive.rank_cost.max()


def _run_epoch(method: str, R: int, M: int, S: int, depth: int, seed: int,
               max_age: int | None, window: int = 3, max_steps: int = 400):
    """The coordinator loop over a finite corpus: offer each rank's first `depth` items per
    source, pop what the plan takes, age the rest. Returns (taken ids, ages at take, total).

    Items are short against the rows (everything offered fits in half the capacity), so every
    overdue item can be taken. Targets ask for what is offered (for lookahead: one W-th of it,
    so that the quota binds and the window matters).
    """
    C = 64
    rng = np.random.default_rng(seed)
    corpus = [[list(rng.integers(1, 11, int(rng.integers(0, 12)))) for _ in range(S)]
              for _ in range(R)]
    ids = [[list(range((r * S + s) * 1000, (r * S + s) * 1000 + len(corpus[r][s])))
            for s in range(S)] for r in range(R)]
    ages = [[[] for _ in range(S)] for _ in range(R)]
    total = sum(len(x) for row in corpus for x in row)
    geometry = Geometry(R, M, C)
    cost = CostModel(a=1.0 / 16)
    planner = Planner(geometry, cost, method=method, max_age=max_age, lookahead=window)
    taken, taken_ages = [], []
    for step in range(max_steps):
        if not any(corpus[r][s] for r in range(R) for s in range(S)):
            break
        for r in range(R):
            for s in range(S):
                ages[r][s] += [0] * (min(depth, len(corpus[r][s])) - len(ages[r][s]))
        windows = [[np.array(corpus[r][s][:depth], dtype=np.int64) for s in range(S)]
                   for r in range(R)]
        win_ids = [[ids[r][s][:depth] for s in range(S)] for r in range(R)]
        c = Candidates.from_windows(windows, [[np.array(ages[r][s]) for s in range(S)]
                                              for r in range(R)])
        flat_ids = np.concatenate([np.asarray(win_ids[r][s], dtype=np.int64)
                                   for s in range(S) for r in range(R)])
        targets = np.bincount(c.source, weights=c.length, minlength=S)
        if method == "lookahead":
            targets = targets / window
        a = planner.assign(c, targets, step)
        check_plan(c, geometry, cost, a)
        taken += flat_ids[a.take].tolist()
        taken_ages += c.age[a.take].tolist()
        gone = set(flat_ids[a.take].tolist())
        for r in range(R):
            for s in range(S):
                keep = [i for i, x in enumerate(ids[r][s]) if x not in gone]
                in_window = min(depth, len(corpus[r][s]))
                corpus[r][s] = [corpus[r][s][i] for i in keep]
                ids[r][s] = [ids[r][s][i] for i in keep]
                ages[r][s] = [ages[r][s][i] + 1 for i in keep if i < in_window]
    return taken, taken_ages, total


@settings(max_examples=max(EXAMPLES * 2 // 3, 10), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(METHODS), R=st.integers(1, 4), M=st.integers(2, 3),
       S=st.integers(1, 2), depth=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_every_item_once_per_epoch_with_bounded_deferral(method, R, M, S, depth, seed):
    max_age = 2 if method == "balanced" else None
    taken, ages, total = _run_epoch(method, R, M, S, depth, seed, max_age)
    assert len(taken) == total, "some items were never taken"
    assert len(set(taken)) == total, "an item was taken twice"
    if method == "balanced":
        assert max(ages, default=0) <= max_age
    if method == "lookahead":
        assert max(ages, default=0) <= 6          # two windows of W


@pytest.mark.parametrize("method", METHODS)
def test_empty_candidates(method):
    geometry = Geometry(3, 2, 64)
    c = Candidates.from_windows([[np.zeros(0, np.int64)] for _ in range(3)])
    a = Planner(geometry, CostModel(a=1 / 4096), method=method).assign(c, np.array([384.0]), 0)
    assert len(a) == 0 and a.rank_cost.shape == (3,)


@pytest.mark.parametrize("seed", range(20))
def test_arrival_order_is_by_source_position_rank_whatever_the_layout(seed):
    """The radix-sorted arrival order equals a lexsort by (source, position, rank), also when
    the candidates are not laid out by (source, rank, position) as windows make them, and for
    positions past 16 bits (a plain stable sort then)."""
    from streamload.plan.select import arrival_order
    rng = np.random.default_rng(seed)
    S, R = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    windows = [[rng.integers(1, 200, int(rng.integers(0, 40))) for _ in range(S)]
               for _ in range(R)]
    c = Candidates.from_windows(windows)
    perm = rng.permutation(len(c)) if seed % 2 else np.arange(len(c))
    position = c.position[perm] + (70_000 if seed % 5 == 0 else 0)
    c = Candidates(c.length[perm], c.source[perm], c.rank[perm], position, c.age[perm],
                   c.extra_cost[perm], S, R)
    np.testing.assert_array_equal(arrival_order(c), np.lexsort((c.rank, c.position, c.source)))


def test_balanced_is_not_worse_than_naive_on_the_case_hypothesis_found():
    """22 items on 4 ranks x 2 rows of 256 where the heuristics alone planned 2014 against the
    naive fill's 1949."""
    length = np.array([237, 224, 21, 6, 15, 9, 150, 210, 5, 10, 19, 23, 144, 250, 16, 22, 7,
                       218, 151, 9, 19, 15])
    rank = np.array([0] * 6 + [1] * 6 + [2] * 5 + [3] * 5, dtype=np.int32)
    position = np.array(list(range(6)) * 2 + list(range(5)) * 2, dtype=np.int32)
    n = length.size
    c = Candidates(length, np.zeros(n, np.int32), rank, position, np.zeros(n, np.int32),
                   np.zeros(n), 1, 4)
    geometry, cost, targets = Geometry(4, 2, 256), CostModel(a=1.0 / 64, b=1.0), np.array([1780.0])
    naive = Planner(geometry, cost, method="naive").assign(c, targets, 0)
    balanced = Planner(geometry, cost, method="balanced").assign(c, targets, 0)
    assert len(naive) == len(balanced) == n
    assert balanced.rank_cost.max() <= naive.rank_cost.max()
