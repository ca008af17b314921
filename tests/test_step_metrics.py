"""StepMetrics: the last step's per-rank figures kept as arrays, reported as lists by
`snapshot()` (stats()), with the same values, and not changed by what the trainer does to
the Batch's arrays afterwards."""
from __future__ import annotations

import json

import numpy as np
import pytest

from streamload.metrics import StepMetrics
from streamload.plan.cost import pipeline_time

pytestmark = pytest.mark.core


@pytest.mark.parametrize("R,M,stages", [(1, 1, 1), (3, 2, 1), (16, 2, 2), (64, 8, 4)])
def test_last_step_figures_reported_as_lists(R, M, stages):
    rng = np.random.default_rng(R * M)
    metrics = StepMetrics(step_tokens=R * M * 128)
    before = metrics.snapshot()
    for key in ("rank_tokens", "rank_cost", "row_cost", "encoder_cost", "backbone_cost"):
        assert before[key] == []
    for _ in range(2):   # the last step's figures replace the previous ones
        rank_tokens = rng.integers(0, 128 * M, R).astype(np.float64)
        row_cost = rng.random((R, M))
        encoder = row_cost * rng.random((R, M))
        metrics.record(rank_tokens, row_cost, stages, encoder_cost=encoder)
    expected = {"rank_tokens": rank_tokens.tolist(), "row_cost": row_cost.tolist(),
                "rank_cost": row_cost.sum(axis=1).tolist(),
                "encoder_cost": encoder.sum(axis=1).tolist(),
                "backbone_cost": (row_cost.sum(axis=1) - encoder.sum(axis=1)).tolist()}
    row_cost *= 0.0   # the trainer's Batch holds these arrays
    rank_tokens += 1.0
    snap = metrics.snapshot()
    json.dumps(snap["row_cost"] + snap["rank_tokens"])   # plain lists of floats
    for key, value in expected.items():
        assert type(snap[key]) is list
        assert np.allclose(snap[key], value, rtol=0, atol=1e-12), key
    assert snap["steps_planned"] == 2
    assert snap["step_time"] == pytest.approx(
        float(pipeline_time(np.array(expected["row_cost"]), stages).max()))
    cost = np.array(expected["rank_cost"])
    assert snap["imbalance"] == pytest.approx(cost.max() / cost.mean())
