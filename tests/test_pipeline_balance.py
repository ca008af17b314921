"""Issue 20: the deferral bound at one rank, pipeline-aware balancing, outliers grouped across
steps. Deterministic constructed cases (no timing)."""
from __future__ import annotations

import numpy as np
import pytest

from streamload.plan.cost import CostModel
from streamload.plan.planner import Planner
from streamload.plan.types import Candidates, Geometry

from planloop import offer_steps


@pytest.mark.parametrize("method", ["naive", "balanced", "lookahead"])
def test_overdue_items_are_taken_first_at_one_rank(method):
    # The falsifying example hypothesis found (test_plan_properties): arrival order puts item 0
    # (8 tokens, a full row) first; item 3 is overdue and must be taken.
    lengths = np.array([8, 8, 1, 1, 1, 8, 1])
    sources = np.array([1, 1, 1, 2, 2, 2, 2])
    ages = np.array([1, 1, 0, 4, 0, 1, 1])   # item 3 alone is overdue (force_age 2)
    windows = [[lengths[sources == s] for s in range(3)]]
    c = Candidates.from_windows(windows, [[ages[sources == s] for s in range(3)]])
    geometry = Geometry(1, 1, 8)
    cost = CostModel(a=0.0, b=1.0, document_masking=False)
    planner = Planner(geometry, cost, method=method, max_age=2, lookahead=3)
    targets = np.bincount(c.source, weights=c.length, minlength=3).astype(float)
    a = planner.assign(c, targets, step=0)
    overdue = np.flatnonzero(c.age >= planner.force_age)
    assert overdue.size and np.isin(overdue, a.take).all()


def test_pipeline_aware_balancing_lowers_the_1f1b_time():
    """Two ranks of four rows, four pipeline stages. Each rank's share holds four half-row
    documents and short ones. Balancing rank totals alone may stack two halves in one row (its
    sum is the same); under 1F1B that row is paid P - 1 more times. Balancing the rows gives
    every row one half and short documents, and a lower step time."""
    from streamload.plan.cost import pipeline_time
    R, M, C, P = 2, 4, 1024, 4
    cost = CostModel(a=1 / 256, b=1.0)
    rank_items = np.array([512] * 4 + [64] * 32)
    c = Candidates.from_windows([[rank_items.copy()] for _ in range(R)])
    targets = np.array([float(c.length.sum())])
    times = {}
    for stages in (1, P):
        plan = Planner(Geometry(R, M, C, stages), cost, method="balanced").assign(c, targets, 0)
        assert len(plan) == len(c)
        rows = cost.row_costs(plan.length, plan.rank.astype(np.int64) * M + plan.row, R * M)
        times[stages] = float(pipeline_time(rows.reshape(R, M), P).max())
        if stages == P:
            assert plan.step_time is not None and plan.row_cost.shape == (R, M)
            assert float(plan.step_time.max()) == pytest.approx(times[P])
    assert times[P] < 0.95 * times[1], times


def test_outliers_wait_for_a_step_that_gives_every_slot_one():
    """Two ranks of two rows under two pipeline stages: four slots. Full-row documents arrive
    scattered through the stream, one or two at a time. The lookahead keeps them until it can
    give one to every slot, takes them together, and none waits past its bound (2W)."""
    R, M, C, P, W = 2, 2, 1024, 2, 4
    cost = CostModel(a=1 / 256, b=1.0)
    rng = np.random.default_rng(3)
    corpus = []
    for r in range(R):
        shorts = list(rng.integers(16, 96, 120))
        for position in ((5, 60) if r == 0 else (30, 90)):
            shorts.insert(position, C)
        corpus.append([shorts])
    ages = [[[0] * len(x) for x in rank] for rank in corpus]
    planner = Planner(Geometry(R, M, C, P), cost, method="lookahead", lookahead=W)
    targets = np.array([float(R * M * C)])
    plans = offer_steps(corpus, ages, planner, targets, steps=8)
    heavy_steps = [(step, a) for step, (c, a) in enumerate(plans) if (a.length == C).any()]
    assert heavy_steps, "the full-row documents were never taken"
    for step, a in heavy_steps:
        slots = a.rank[a.length == C].astype(int) * M + a.row[a.length == C]
        assert sorted(slots.tolist()) == list(range(R * M)), (step, slots)   # one per slot
    assert sum(int((a.length == C).sum()) for _, a in heavy_steps) == 4
    assert max(int(c.age[a.take].max(initial=0)) for c, a in plans) <= 2 * W


def test_the_loader_logs_its_cost_model_and_planner_at_start(tmp_path, caplog):
    import json
    import logging

    import streamload as sl
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "part-0.jsonl").write_text(
        "".join(json.dumps({"text": "x" * n}) + "\n" for n in (40, 300, 1200, 90)))
    with caplog.at_level(logging.INFO, logger="streamload"):
        records = []
        with sl.Loader([sl.Source(str(docs))], micro_batch_tokens=512, epochs=1,
                       pipeline_stages=2, on_step=records.append) as loader:
            batches = list(loader)
            stats = loader.stats()
    # Per (rank, micro-batch) costs and the 1F1B step time, in stats() and the step records.
    assert np.asarray(stats["row_cost"]).shape == (1, 2) and stats["step_time"] > 0
    assert records and all(r["step_time"] > 0 and 0 < r["pipeline_efficiency"] <= 1
                           for r in records)
    assert batches[-1].row_cost.shape == (1, 2)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "planner lookahead" in text and "a=2.035e-05, b=1" in text
    assert "CostModel.transformer" in text and "2 pipeline stage(s)" in text
