"""benchmarks/long_context.py's delay report: each dry-run step's deferred items (delay,
tokens) and their breakdown by kind (`delay_breakdown`). Deterministic, no timing."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_delay_breakdown_by_kind_of_item():
    from long_context import delay_breakdown
    C = 1600
    # delays and tokens: three short items (< C/16 = 100), one middling, two long (>= 400)
    delays = np.array([[1, 2, 3, 1, 5, 4], [10, 99, 50, 200, 400, 1600]])
    out = delay_breakdown(delays, C)
    assert out["waited_short_items"] == 3 and out["waited_short_mean"] == pytest.approx(2.0)
    assert out["waited_long_items"] == 2 and out["waited_long_mean"] == pytest.approx(4.5)
    assert out["waited_next"] == pytest.approx(2 / 6, abs=1e-3)
    # every short one at the next step: (1 + 1 + 1 + 1 + 5 + 4) / 6
    assert out["waited_mean_floor"] == pytest.approx(13 / 6, abs=1e-3)
    assert delay_breakdown(np.zeros((2, 0), np.int64), C) == {}


def test_each_dry_run_step_reports_its_deferred_items():
    """The per-item delays a step reports add up to its waited counts (an over-full mix of
    long and short documents, so that items are deferred)."""
    from streamload.commands.dryrun import simulate
    from streamload.configfile import parse_config
    spec = parse_config("[loader]\nmicro_batch_tokens = 1024\nmicro_batches = 2\n"
                        "planner = \"lookahead\"\nseed = 1\n[cost]\na = 0.01\n"
                        "[mixture]\nweights = { a = 1.0, b = 1.0 }\n"
                        '[[source]]\nuri = "/x/a/"\n[[source]]\nuri = "/x/b/"\n')
    rng = np.random.default_rng(0)
    lengths = [rng.integers(200, 1025, 3000), rng.integers(1, 120, 20000)]
    reports = simulate(spec, lengths, steps=40, ranks=4)
    waited = 0
    for r in reports:
        assert r.delays.shape == (2, r.waited)
        assert int(r.delays[0].sum()) == r.waited_steps
        assert int((r.delays[0] * r.delays[1]).sum()) == r.waited_token_steps
        assert (r.delays[0] >= 1).all()
        waited += r.waited
    assert waited > 0


def test_default_dry_runs_reach_the_steady_state_up_to_512_ranks():
    """No item is forced before step 2W = 16 (the planner's default deferral bound): a dry run
    whose default length is not well past it reports the warm-up (32 steps at R = 64 read
    0.975 where the steady state gives 0.93-0.95). Up to R = 512 the default keeps the first
    18 steps to at most a fifth of the run."""
    from long_context import default_sim_steps
    from streamload.plan.planner import DEFERRAL_WINDOWS, Planner
    bound = DEFERRAL_WINDOWS * Planner.lookahead
    assert bound == 16
    for R in (2, 4, 64, 512):
        assert default_sim_steps(R) >= 5 * (bound + 2)
