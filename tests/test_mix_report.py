"""The mix as configured (issue 21, item 5): `stats()` / `summary()`, the metrics log and
`streamload report` give the target as configured, the mix realized while every source had
data, each epoch's with the step a source ran out at, and the epoch tail apart."""
from __future__ import annotations

import numpy as np
import pytest

import streamload as sl
from corpus import write_jsonl_source
from distributed import run_ranks
from streamload.mixreport import MixTally, StepMix, format_mix

pytestmark = pytest.mark.timeout(180)


def make_corpus(root):
    # "small" has the larger weight but runs out well before "big": the epoch has a tail. It
    # holds several times the default lookahead's windows (8 steps of its share), else its
    # windows hold all it has from the first step and no step has every source active.
    write_jsonl_source(root, "small", shards=2, per_shard=160, median=150, seed=1)
    write_jsonl_source(root, "big", shards=3, per_shard=480, median=150, seed=2)


def mix_job(rank, world, root):
    from pathlib import Path
    root = Path(root)
    records = []
    with sl.Loader([sl.Source(str(root / "small"), weight=0.6),
                    sl.Source(str(root / "big"), weight=0.4)],
                   micro_batch_tokens=1024, micro_batches=2, epochs=1, seed=3,
                   on_step=records.append) as loader:
        for _ in loader:
            pass
        return loader.stats(), loader.summary(), records


def last_step_with(records, name):
    return max(int(r["step"]) for r in records if r[f"job_tokens/{name}"] > 0)


@pytest.mark.parametrize("world", [1, 2])
def test_the_target_is_the_configured_share_whatever_the_world_size(tmp_path, world):
    """Was: a weight of 0.6 reported as a target of 0.29 (the shares renormalized over the
    sources left, averaged over a run whose tail depends on the world size)."""
    make_corpus(tmp_path)
    if world == 1:
        results = [mix_job(0, 1, str(tmp_path))]
    else:
        results = run_ranks(mix_job, world, str(tmp_path))
    stats, summary, records = results[0]
    mix, steps = stats["mix"], stats["mix_steps"]
    assert mix["small"]["target"] == pytest.approx(0.6)
    assert mix["big"]["target"] == pytest.approx(0.4)
    assert 0 < steps["steps_all_active"] and 0 < steps["steps_tail"]
    assert steps["steps_all_active"] + steps["steps_tail"] == steps["steps"] == len(records)
    assert abs(mix["small"]["realized_all_active"] - 0.6) < 0.05, mix
    assert steps["deviation"] < 0.05
    (epoch,) = mix["small"]["epochs"]
    assert epoch["ran_out_at_step"] == last_step_with(records, "small")
    assert mix["big"]["epochs"][0]["ran_out_at_step"] == last_step_with(records, "big")
    assert f"(ran out at step {epoch['ran_out_at_step']})" in summary
    assert "small 0.600 |" in summary, summary
    # The step records: the targets, the tail (once begun, to the end), the run-out events.
    assert [r["target/small"] for r in records] == [pytest.approx(0.6)] * len(records)
    tail = [r["tail"] for r in records]
    assert tail == sorted(tail) and tail[-1] == 1.0
    assert [int(r["step"]) for r in records if r["ran_out/small"]] == [epoch["ran_out_at_step"]]
    # The exchange panel's series: the job's tokens moved between ranks, every step.
    assert sum(r["exchanged_tokens"] for r in records) == stats["exchanged_tokens"]
    if world == 2:
        assert stats["exchanged_tokens"] > 0


def test_report_reads_the_mix_from_the_log_without_a_target_flag(tmp_path, capsys):
    from streamload.commands.cli import main
    from streamload.commands.report import summarize_records
    from streamload.observe import MetricsLog, read_metrics
    make_corpus(tmp_path)
    stats, _, records = mix_job(0, 1, str(tmp_path))
    with MetricsLog(tmp_path / "metrics.jsonl") as log:
        for record in records:
            log(record)
    summary = summarize_records(read_metrics(tmp_path / "metrics.jsonl"))
    for name in ("small", "big"):
        got, want = summary["mix"]["sources"][name], stats["mix"][name]
        for key in ("target", "realized", "realized_all_active"):
            assert got[key] == pytest.approx(want[key]), (name, key)
        assert [(e["epoch"], e["ran_out_at_step"]) for e in got["epochs"]] == \
            [(e["epoch"], e["ran_out_at_step"]) for e in want["epochs"]]
    assert summary["mix"]["deviation"] == pytest.approx(stats["mix_steps"]["deviation"])
    assert main(["report", str(tmp_path / "metrics.jsonl")]) == 0
    out = capsys.readouterr().out
    ran_out = stats["mix"]["small"]["epochs"][0]["ran_out_at_step"]
    assert "small 0.600 |" in out and f"ran out at step {ran_out}" in out
    assert "epoch tails" in out


@pytest.mark.core
def test_the_tally_keeps_the_tail_apart_and_each_epoch_with_its_run_out():
    tally = MixTally(["a", "b"])
    target = np.array([0.75, 0.25])
    none = np.zeros(2, dtype=bool)
    for step in range(4):   # all active: exactly on target
        tally.add(0, step, [75, 25], StepMix(target, False, none))
    tally.add(0, 4, [10, 90], StepMix(target, True, np.array([True, False])))   # a ran out
    tally.add(0, 5, [0, 100], StepMix(target, True, np.array([False, True])))
    tally.add(1, 6, [60, 40], StepMix(target, False, none))
    s = tally.summary()
    assert (s["steps"], s["steps_all_active"], s["steps_tail"]) == (7, 5, 2)
    assert s["sources"]["a"]["target"] == pytest.approx(0.75)
    assert s["sources"]["a"]["realized_all_active"] == pytest.approx(360 / 500)
    assert s["deviation"] == pytest.approx(0.75 - 360 / 500)
    # In the tail the target is over the sources left: a takes none once it ran out (step 5).
    assert s["sources"]["a"]["target_tail"] == pytest.approx((0.75 * 100 + 0) / 200)
    assert s["tail_deviation"] == pytest.approx(0.375 - 10 / 200)
    assert [(e["epoch"], e["ran_out_at_step"]) for e in s["sources"]["a"]["epochs"]] == \
        [(0, 4), (1, None)]
    assert s["sources"]["a"]["epochs"][0]["realized"] == pytest.approx(310 / 600)
    lines = format_mix(s)
    assert any("a 0.750 | 0.720 | epoch 0 0.517 (ran out at step 4), epoch 1 0.600" in line
               for line in lines), lines
    assert any("epoch tails (2 steps" in line for line in lines), lines
