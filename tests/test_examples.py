"""The examples run as their docstrings say."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from corpus import write_jsonl_source

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
        assert f"rank 0: 3 steps, up to step {last_step}," in out, out
    assert (tmp_path / "state.json").read_text().startswith('{"streamload"')
