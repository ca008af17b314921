"""The examples run as their docstrings say."""
from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

from corpus import base_ids, write_jsonl_source

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_train_loop_runs_and_resumes_from_its_checkpoint(tmp_path, monkeypatch, capsys):
    write_jsonl_source(tmp_path, "web", shards=3, per_shard=60, seed=1)
    write_jsonl_source(tmp_path, "code", shards=1, per_shard=40, median=900, seed=2)
    script = str(REPO / "examples" / "train_loop.py")
    monkeypatch.setattr(sys, "argv", [script, str(tmp_path / "web"), str(tmp_path / "code"),
                                      "--steps", "3", "--checkpoint", str(tmp_path / "state.json")])
    for last_step in (2, 5):   # the second run resumes from the first one's state
        runpy.run_path(script, run_name="__main__")
        out = capsys.readouterr().out
        assert f"rank 0 of 1: 3 steps, up to step {last_step}," in out, out
    assert (tmp_path / "state.json").read_text().startswith('{"streamload"')


@pytest.mark.timeout(300)
def test_train_loop_under_torchrun_reads_each_sample_once_across_two_ranks(tmp_path):
    """`torchrun --nproc-per-node 2 examples/train_loop.py ...` as its docstring says, for one
    epoch: two ranks of one world, each reading a disjoint part, together every sample once."""
    from distributed import torchrun
    expected = write_jsonl_source(tmp_path, "web", shards=3, per_shard=60, seed=1)
    expected |= write_jsonl_source(tmp_path, "code", shards=2, per_shard=20, median=900, seed=2)
    proc = torchrun(REPO / "examples" / "train_loop.py", tmp_path / "web", tmp_path / "code",
                    "--epochs", "1", "--steps", "100000", "--checkpoint",
                    tmp_path / "state.json", "--sample-ids", tmp_path / "ids", timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = sorted(re.findall(r"rank \d of \d: \d+ steps", proc.stdout))
    assert len(lines) == 2 and lines[0].split(":")[1] == lines[1].split(":")[1], proc.stdout
    assert [line.split(":")[0] for line in lines] == ["rank 0 of 2", "rank 1 of 2"]
    ids = [(tmp_path / "ids" / f"rank-{r}.txt").read_text().split() for r in (0, 1)]
    assert ids[0] and ids[1] and not set(ids[0]) & set(ids[1])   # disjoint parts
    every = ids[0] + ids[1]
    assert len(every) == len(set(every)) and set(base_ids(every)) == expected   # exactly once
    assert (tmp_path / "state.json").read_text().startswith('{"streamload"')   # rank 0's


@pytest.mark.timeout(60)
def test_megatron_external_feeds_one_micro_batch_dict_per_next(monkeypatch, capsys):
    script = str(REPO / "examples" / "megatron_external.py")
    monkeypatch.setattr(sys, "argv", [script, "--steps", "2"])   # its own tiny corpus
    runpy.run_path(script, run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("2 micro-batches of [1, 512]") == 2, out
    assert "step 1:" in out


@pytest.mark.timeout(180)
def test_torchtitan_style_runs_on_a_device_mesh(tmp_path):
    """4 spawned gloo ranks, a ("dp", "tp") DeviceMesh: TP peers report the same samples."""
    import subprocess
    write_jsonl_source(tmp_path, "web", shards=2, per_shard=40, seed=1)
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "torchtitan_style.py"),
                           str(tmp_path / "web"), "--steps", "2"],
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(re.findall(r"rank \d+ \(dp \d+ of \d+, tp \d+\): .*?first ids \[[^\]]*\]",
                              proc.stdout))
    assert len(lines) == 4, proc.stdout
    by_dp = {}
    for line in lines:   # "rank r (dp d of 2, tp t): 2 steps, loss x, first ids [...]"
        dp = line.split("(dp ")[1].split(" ")[0]
        by_dp.setdefault(dp, set()).add(line.split("first ids ")[1])
    assert sorted(by_dp) == ["0", "1"] and all(len(ids) == 1 for ids in by_dp.values()), lines
