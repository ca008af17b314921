"""The step machine (plan/stepper.py) and the memory plan (plan/memory.py) on their own: tables
of windows and what the job does, without buffers, fetchers or ranks."""
from __future__ import annotations

import numpy as np
import pytest

from streamload.config import Source, make_config
from streamload.errors import ConfigError
from streamload.plan.memory import TOKEN_BYTES, MemoryPlan
from streamload.plan.stepper import Stepper
from streamload.plan.types import Candidates

pytestmark = pytest.mark.core

C, M = 64, 2


def build(ranks=2, policies=("renormalize", "renormalize"), **options) -> Stepper:
    options = {"micro_batch_tokens": C, "micro_batches": M, "seed": 0, "epochs": 1,
               "planner": "naive", **options}
    sources = [Source(f"{name}/", on_exhausted=policy) for name, policy in zip("ab", policies)]
    return Stepper.build(make_config(**options), sources, None, ranks)


def candidates(windows) -> Candidates:
    return Candidates.from_windows([[np.array(w, np.int64) for w in per_rank]
                                    for per_rank in windows])


# policies; windows [rank][source] lengths; exhausted [rank][source]; outcome
OUTCOME_CASES = {
    "data everywhere": (("renormalize", "renormalize"), [[[5], [6]], [[7], [8]]],
                        [[False, False], [False, False]], "continue"),
    "one source out, the other goes on": (("renormalize", "renormalize"), [[[], [6]], [[], [8]]],
                                          [[True, False], [True, False]], "continue"),
    "out on one rank only": (("renormalize", "renormalize"), [[[], []], [[], []]],
                             [[True, True], [False, True]], "continue"),
    "every source out": (("renormalize", "renormalize"), [[[], []], [[], []]],
                         [[True, True], [True, True]], "end_epoch"),
    "exhausted but items left": (("renormalize", "renormalize"), [[[3], []], [[], []]],
                                 [[True, True], [True, True]], "continue"),
    "a stop source ran out": (("stop", "renormalize"), [[[], [6]], [[], [8]]],
                              [[True, False], [True, False]], "stop"),
    "the finite one ran out beside a restart source": (
        ("restart", "renormalize"), [[[5], []], [[5], []]], [[False, True], [True, True]],
        "end_epoch"),
    "restart sources alone go on": (("restart", "restart"), [[[5], [4]], [[5], [4]]],
                                    [[False, False], [False, False]], "continue"),
}


@pytest.mark.parametrize("case", OUTCOME_CASES)
def test_begin_decides_the_outcome(case):
    policies, windows, exhausted, outcome = OUTCOME_CASES[case]
    stepper = build(policies=policies)
    step = stepper.begin(candidates(windows), np.array(exhausted))
    assert step.outcome == outcome and step.index == 0
    assert (step.quota is not None) == (outcome == "continue")


# Windows: rank 0 a=[5, 5] b=[3], rank 1 a=[] b=[4]; candidates in order (source, rank,
# position): 0 a/r0/0, 1 a/r0/1, 2 b/r0/0, 3 b/r1/0.
HOLDING_CASES = [
    ([], [[False, False], [False, False]], [[True, True], [True, True]]),
    ([0, 1, 2, 3], [[True, True], [True, True]], [[False, False], [False, False]]),
    ([0, 1], [[True, True], [True, True]], [[False, True], [False, True]]),
    ([0], [[True, True], [True, True]], [[True, True], [False, True]]),
    ([0, 1, 2, 3], [[False, True], [True, True]], [[True, False], [False, False]]),
]


@pytest.mark.parametrize("take, done, holding", HOLDING_CASES)
def test_holding_after_a_step(take, done, holding):
    c = candidates([[[5, 5], [3]], [[], [4]]])
    got = Stepper.holding_after(c, np.array(take, np.int64), np.array(done))
    assert got.tolist() == holding


@pytest.mark.parametrize("ranks, planner", [(1, "naive"), (2, "naive"), (2, "balanced"),
                                            (3, "balanced")])
def test_an_epoch_takes_every_item_once_within_capacity(ranks, planner):
    """Drive the stepper as the runtime does, each window the rest of the epoch: every item is
    taken once, no row holds more than C, the steps and the ranks holding data are tracked,
    and the run ends after its one epoch."""
    stepper = build(ranks=ranks, planner=planner)
    rng = np.random.default_rng(ranks)
    left = [[list(rng.integers(1, C + 1, int(rng.integers(3, 30)))) for _ in range(2)]
            for _ in range(ranks)]
    total = sum(map(len, sum(left, [])))
    stepper.start_epoch(np.ones((ranks, 2), bool))
    exhausted = np.ones((ranks, 2), bool)   # every window holds the rest of the epoch
    taken, steps = 0, 0
    while True:
        c = candidates(left)
        step = stepper.begin(c, exhausted)
        if step.outcome != "continue":
            break
        assignment = stepper.assign(step)
        assert len(assignment) > 0, "a step with data took nothing"
        rows = np.zeros((ranks, M), np.int64)
        np.add.at(rows, (assignment.rank, assignment.row), assignment.length)
        assert rows.max() <= C
        assert (assignment.length == c.length[assignment.take]).all()   # nothing divisible: whole
        stepper.commit(step, assignment.take, assignment.length)
        gone = set(assignment.take.tolist())
        assert len(gone) == len(assignment)
        flat = [(s, r, p) for s in range(2) for r in range(ranks) for p in range(len(left[r][s]))]
        for s, r, p in sorted((flat[i] for i in gone), reverse=True):
            del left[r][s][p]
        taken += len(gone)
        steps += 1
        assert stepper.step == steps
        assert stepper.holding.tolist() == [[bool(w) for w in per_rank] for per_rank in left]
    assert step.outcome == "end_epoch" and taken == total
    stepper.end_epoch()
    assert stepper.finished and stepper.epoch == 1


def memory(ranks=4, **options) -> MemoryPlan:
    config = make_config(**{"micro_batch_tokens": 1024, "micro_batches": 2, "chunk_bytes": 4096,
                            "memory_budget": 1 << 30, "planner": "balanced", **options})
    return MemoryPlan(config, np.array([0.5, 0.5]), ["a", "b"], ranks)


# options; shares, holders, held; windows (tokens). R=4, M=2, C=1024, planner balanced,
# window_factor 2: a source held by a rank gets ceil(2 · share · R·M·C / holders) + C.
WINDOW_CASES = {
    "every rank holds both": ({}, [0.5, 0.5], [4, 4], [True, True], [3072, 3072]),
    "one holder reads four ranks' share": ({}, [0.5, 0.5], [1, 4], [True, True], [9216, 3072]),
    "not held: one row": ({}, [0.5, 0.5], [3, 4], [False, True], [1024, 3072]),
    "a source ran out: its share moves": ({}, [1.0, 0.0], [4, 0], [True, False], [5120, 1024]),
    "lookahead: exactly W steps": ({"planner": "lookahead", "lookahead": 4}, [0.5, 0.5], [4, 4],
                                   [True, True], [4096, 4096]),
    "lookahead: at least a row": ({"planner": "lookahead", "lookahead": 1}, [0.1, 0.9], [4, 4],
                                  [True, True], [1024, 1844]),
    "window_factor": ({"window_factor": 0.5}, [0.5, 0.5], [4, 4], [True, True], [1536, 1536]),
}


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_memory_plan_windows(case):
    options, shares, holders, held, windows = WINDOW_CASES[case]
    plan = memory(**options)
    budgets = plan.budgets(np.array(shares), np.array(holders), np.array(held))
    assert [b.window_tokens for b in budgets] == windows
    C = 1024
    assert [b.capacity_tokens for b in budgets] == [2 * w + C for w in windows]
    # What the buffers leave goes in flight, only to the sources this rank holds.
    assert [b.inflight_bytes > 0 for b in budgets] == held
    assert sum(b.capacity_tokens * TOKEN_BYTES + b.inflight_bytes for b in budgets) <= plan.budget


def test_memory_plan_buffer_tokens_is_a_floor_of_the_capacity():
    budgets = memory(buffer_tokens=20000).budgets(np.array([0.5, 0.5]), np.array([4, 1]),
                                                 np.array([True, True]))
    assert [(b.window_tokens, b.capacity_tokens) for b in budgets] == [(3072, 20000),
                                                                       (9216, 20000)]


def test_memory_plan_shrinks_windows_to_the_budget_but_never_below_a_row():
    roomy = memory(memory_budget=1 << 30).budgets(np.array([0.5, 0.5]), np.array([1, 1]),
                                                 np.array([True, True]))
    budget = 120_000
    tight = memory(memory_budget=budget).budgets(np.array([0.5, 0.5]), np.array([1, 1]),
                                                np.array([True, True]))
    for small, big in zip(tight, roomy):
        assert 1024 <= small.window_tokens < big.window_tokens
        assert small.inflight_bytes >= 4096   # a range in flight, at least
    assert sum(b.capacity_tokens * TOKEN_BYTES for b in tight) <= budget


def test_memory_plan_refuses_a_budget_that_cannot_hold_the_start():
    with pytest.raises(ConfigError, match=r"memory_budget: 50000 bytes leaves source 'a'"):
        memory(memory_budget=50_000)
    assert memory(memory_budget=None).budget >= 32 << 20   # the default, or what the sources need
