"""StepCosts: a step's job-wide cost figures, of fixed size. Under control_plane="gather" a
non-zero rank's reply carries its own rank's figures and these alone, so its Batch's
properties and stats() give the values rank 0's full arrays give, and the reply does not grow
with R."""
from __future__ import annotations

import numpy as np
import pytest

from streamload.batch import Batch
from streamload.collective.messages import StepTotals, decode_local_plan, encode_local_plan
from streamload.metrics import StepMetrics
from streamload.mixreport import StepMix
from streamload.plan.cost import StepCosts, balanced_time, pipeline_time

pytestmark = pytest.mark.core

S = 3


def figures(R, M, seed=0):
    rng = np.random.default_rng(seed)
    rows = rng.random((R, M))
    return rng.integers(1, 100, R).astype(np.float64), rows, rows * rng.random((R, M))


def reply(tokens, rows, encoder, stages, rank):
    R, M = rows.shape
    totals = StepTotals(tokens, rows, np.arange(S), 0, 0, 0, 0, 0, 0.0, encoder,
                        StepCosts.of(tokens, rows.sum(axis=1), rows, stages, encoder.sum(axis=1)))
    array = encode_local_plan(0, 0, 1, totals=totals, rank=rank, units=np.ones(S),
                              mix=StepMix(np.ones(S) / S, False, np.zeros(S, bool)))
    return array, decode_local_plan(array, S, R, M)


@pytest.mark.parametrize("R,M,stages", [(2, 1, 1), (5, 4, 2), (64, 8, 4)])
def test_a_rank_gets_its_own_figures_and_the_job_wide_ones(R, M, stages):
    tokens, rows, encoder = figures(R, M, R)
    full = Batch(1, 0, [], tokens, rows.sum(axis=1), row_cost=rows, pipeline_stages=stages,
                 encoder_cost=encoder.sum(axis=1))
    cost = rows.sum(axis=1)
    assert full.imbalance == pytest.approx(cost.max() / cost.mean())
    assert full.step_time == pytest.approx(pipeline_time(rows, stages).max())
    assert full.pipeline_efficiency == pytest.approx(balanced_time(rows, stages)
                                                     / pipeline_time(rows, stages).max())
    backbone = cost - encoder.sum(axis=1)
    assert full.backbone_imbalance == pytest.approx(backbone.max() / backbone.mean())
    for rank in (1, R - 1):
        _, local = reply(tokens, rows, encoder, stages, rank)
        t = local.totals
        assert t.rank_tokens.tolist() == [tokens[rank]]
        assert t.row_cost.tolist() == [rows[rank].tolist()]
        assert t.encoder_cost.tolist() == [encoder[rank].tolist()]
        assert t.costs == full.costs   # bit for bit: the same figures on every rank
        mine = Batch(1, 0, [], t.rank_tokens, t.row_cost.sum(axis=1), row_cost=t.row_cost,
                     pipeline_stages=stages, encoder_cost=t.encoder_cost.sum(axis=1),
                     costs=t.costs)
        for name in ("imbalance", "step_time", "pipeline_efficiency", "encoder_imbalance",
                     "backbone_imbalance"):
            assert getattr(mine, name) == getattr(full, name), name
        assert mine.rank_cost_of(rank) == full.rank_cost_of(rank) == pytest.approx(cost[rank])
        metrics = StepMetrics(step_tokens=R * M * 100)
        metrics.record(t.rank_tokens, t.row_cost, stages, encoder_cost=t.encoder_cost,
                       costs=t.costs)
        whole = StepMetrics(step_tokens=R * M * 100)
        whole.record(tokens, rows, stages, encoder_cost=encoder)
        got, want = metrics.snapshot(), whole.snapshot()
        for key in ("imbalance", "step_time", "encoder_imbalance", "backbone_imbalance",
                    "tokens_per_step"):
            assert got[key] == pytest.approx(want[key]), key
        assert got["rank_cost"] == pytest.approx([cost[rank]])


def test_the_reply_does_not_grow_with_R():
    sizes = {R: reply(*figures(R, 8), 2, 1)[0].nbytes for R in (2, 16, 1024)}
    assert len(set(sizes.values())) == 1, sizes


def test_costs_round_trip_and_a_step_without_rows():
    costs = StepCosts.of([3.0, 5.0], [2.0, 6.0])
    assert StepCosts.from_array(costs.to_array()) == costs
    assert (costs.tokens, costs.step_time, costs.imbalance) == (8.0, 6.0, 1.5)
    assert costs.pipeline_efficiency == 1.0   # no rows: nothing to spread
    empty = StepCosts.of(np.zeros(0), np.zeros(0), np.zeros((0, 2)))
    assert (empty.imbalance, empty.step_time, empty.pipeline_efficiency) == (1.0, 0.0, 1.0)
