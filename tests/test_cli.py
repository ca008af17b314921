"""The `streamload` command: inspect (local and S3), the demo end to end, calibrate's hand-off."""
from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from streamload.commands.cli import main
from streamload.formats import write_jsonl, write_token_shard

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def small_source(tmp_path):
    """Two JSONL shards (plain and gz) plus a stray file; texts with multi-byte characters."""
    root = tmp_path / "src"
    a = ["hello", "café " * 3, "x" * 5000]            # 5, 18 and 5000 UTF-8 bytes
    b = ["日本", "ab", "abcd", "z" * 100]                # 6, 2, 4, 100
    write_jsonl(root / "part-0.jsonl", a)
    write_jsonl(root / "part-1.jsonl.gz", b)
    (root / "README.txt").write_text("not a shard")
    return root, a + b


@pytest.mark.timeout(60)
def test_inspect_local_json(small_source, capsys):
    root, texts = small_source
    assert main(["inspect", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shards_listed"] == 2
    assert [(s["name"], s["records"]) for s in report["shards"]] == \
        [("part-0.jsonl", 3), ("part-1.jsonl.gz", 4)]
    assert [s["size"] for s in report["shards"]] == \
        [(root / "part-0.jsonl").stat().st_size, (root / "part-1.jsonl.gz").stat().st_size]
    lengths = sorted(len(t.encode()) for t in texts)
    assert report["records"] == 7
    assert report["tokens"] == sum(lengths)
    assert report["length"]["min"] == 2 and report["length"]["max"] == 5000
    assert report["longer_than_capacity"] == 1
    assert sum(b["count"] for b in report["histogram"]) == 7
    # Power-of-two bins: 2 -> [2,4), 4,5,6 -> [4,8), 18 -> [16,32), 100 -> [64,128), 5000 -> [4096, 8192)
    counts = {b["lo"]: b["count"] for b in report["histogram"]}
    assert counts[2] == 1 and counts[4] == 3 and counts[16] == 1 and counts[64] == 1
    assert counts[4096] == 1


@pytest.mark.timeout(60)
def test_inspect_text_report_glob_and_tokens(tmp_path, small_source, capsys):
    root, _ = small_source
    assert main(["inspect", str(root / "*.gz")]) == 0
    out = capsys.readouterr().out
    assert "part-1.jsonl.gz" in out and "part-0.jsonl " not in out
    assert "4 records" in out and "#" in out

    docs = [np.arange(n, dtype=np.uint16) for n in (3, 10, 0, 7)]
    write_token_shard(tmp_path / "tok" / "shard-a", docs)
    write_token_shard(tmp_path / "tok" / "shard-b", docs[:2])
    assert main(["inspect", str(tmp_path / "tok"), "--format", "tokens", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in report["shards"]] == ["shard-a.tokens.npy", "shard-b.tokens.npy"]
    assert report["records"] == 6 and report["tokens"] == 20 + 13
    assert report["empty_records"] == 1


@pytest.mark.timeout(60)
def test_inspect_reports_bad_records_and_missing_paths(tmp_path, capsys):
    path = tmp_path / "bad" / "part.jsonl"
    path.parent.mkdir()
    path.write_bytes(b'{"text": "ok"}\n{"text": 3}\nnot json\n{"body": "x"}\n')
    assert main(["inspect", str(path.parent), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["records"] == 1 and report["skipped_records"] == 3
    assert any("record 1" in p for p in report["problems"])

    assert main(["inspect", str(tmp_path / "nothing-here")]) == 1
    assert "nothing-here" in capsys.readouterr().err

    assert main(["inspect", str(tmp_path), "--endpoint-url", "http://127.0.0.1:1"]) == 1
    assert "remote" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_inspect_s3(tmp_path, s3_bucket, capsys):
    client, bucket = s3_bucket
    texts = [f"document {i} " + "word " * i for i in range(20)]
    local = write_jsonl(tmp_path / "web.jsonl.zst", texts)
    client.upload_file(str(local), bucket, "web/part-000.jsonl.zst")
    client.put_object(Bucket=bucket, Key="web/part-001.jsonl.gz",
                      Body=gzip.compress(b'{"body": "abc"}\n'))
    # The endpoint comes from AWS_ENDPOINT_URL (set by the fixture), or from --endpoint-url.
    assert main(["inspect", f"s3://{bucket}/web/", "--text-field", "text", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shards_listed"] == 2
    assert report["shards"][0]["records"] == 20
    assert report["tokens"] == sum(len(t.encode()) for t in texts)
    assert report["skipped_records"] == 1          # part-001 lacks the "text" field

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    assert main(["inspect", f"s3://{bucket}/web/*.gz", "--text-field", "body",
                 "--endpoint-url", endpoint, "--storage-option", "region_name=us-east-1",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["records"] == 1 and report["tokens"] == 3


def test_calibrate_is_handed_its_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("streamload.commands.calibrate")
    fake.calibrate_main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "streamload.commands.calibrate", fake)
    assert main(["calibrate", "--device", "cpu", "--help-me"]) == 7
    assert seen == [["--device", "cpu", "--help-me"]]


def test_help_and_no_command(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "demo" in out and "inspect" in out and "calibrate" in out
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    assert "--planner" in capsys.readouterr().out


def _run_demo(cwd: Path, *args: str,
              timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    """`streamload demo ARGS` in a fresh interpreter, which also reports whether the demo's own
    process imported torch (test_cli_imports.CHECK: exit code 3 if it did)."""
    from test_cli_imports import CHECK
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}   # no fixture leakage
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", CHECK, "demo", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    summary = json.loads(lines[-1]) if lines else {}
    return proc, summary


@pytest.mark.timeout(120)
def test_demo_small_delivers_everything_exactly_once(tmp_path):
    proc, summary = _run_demo(tmp_path, "--small", "--workdir", str(tmp_path / "work"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The ranks import torch; the demo's own process (moto, the dry run, the summary) need not.
    assert "imported: []" in proc.stderr, proc.stderr[-3000:]
    assert summary["exactly_once"] is True and summary["ok"] is True
    assert summary["duplicates"] == 0 and summary["missing"] == 0
    # Every item once, some split, and pieces the planner cut to fill rows arrive in parts.
    assert summary["samples"] >= summary["expected_samples"] > summary["documents"]
    assert summary["tokens"] == summary["corpus_tokens"]
    assert summary["ranks"] == 2 and summary["equal_steps_on_every_rank"]
    assert set(summary["mix"]) == {"web", "code", "books", "math"}
    assert summary["skipped"]["records"] == 0
    # The dry run drives the loader's step machine: it predicts the run step for step.
    assert summary["predicted_steps"] == summary["steps"] and summary["prediction_matches"]
    out = proc.stdout
    assert "predicted cost" in out and "exactly-once   OK" in out
    assert "s3://streamload-demo/web/" in out
    # The loader's summary, and the run's plot: where it went, a PNG of the expected size.
    assert "mix of tokens: target (as configured)" in out and "tokens/step: mean" in out
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:   # the demo works without it
        assert "no plot:" in out
    else:   # matplotlib is in the test extra: the plot must be there
        assert "no plot:" not in out, out
        plot = tmp_path / "streamload-demo.png"
        assert f"plot of the run (mix, fill, balance, deferrals): {plot}" in out
        header = plot.read_bytes()[:24]
        assert header[:8] == b"\x89PNG\r\n\x1a\n"
        assert int.from_bytes(header[16:20], "big") == 1200
    manifest = json.loads((tmp_path / "work" / "corpus" / "manifest.json").read_text())
    assert {s["name"]: s["location"] for s in manifest["sources"]} == \
        {"web": "s3", "code": "s3", "books": "local", "math": "local"}


@pytest.mark.timeout(120)
def test_demo_stops_after_steps_and_refuses_a_bad_option_before_starting_ranks(tmp_path):
    proc, summary = _run_demo(tmp_path, "--small", "--steps", "3", "--micro-batch-tokens", "1024")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["steps"] == 3 and summary["epoch_complete"] is False
    assert summary["exactly_once"] is None and summary["duplicates"] == 0
    assert summary["samples"] < summary["expected_samples"]

    proc, summary = _run_demo(tmp_path, "--small", "--planner", "no-such-planner")
    assert proc.returncode == 2 and not summary   # the loader's own validation, up front
    assert "planner: must be one of 'naive', 'balanced', 'lookahead', got 'no-such-planner'" \
        in proc.stderr, proc.stderr


def test_demo_names_the_signal_that_killed_a_rank():
    """What a SIGBUS in both ranks looked like (a flake once, from outside the project: nothing
    the demo maps can be truncated by it): the demo now says which signal ended a rank, and each
    rank enables faulthandler, so the next one leaves its Python stacks on stderr."""
    from streamload.commands.demo.run import _describe_exit
    assert _describe_exit(-signal.SIGBUS) == "killed by SIGBUS (exit code -7)"
    assert _describe_exit(-signal.SIGKILL) == "killed by SIGKILL (exit code -9)"
    assert _describe_exit(1) == "exit code 1"


@pytest.mark.timeout(60)
def test_demo_corpus_matches_inspect(tmp_path, capsys):
    from streamload.commands.demo.corpus import generate

    corpus = generate(tmp_path / "corpus", small=True, capacity=4096)
    books = corpus.source("books")
    assert books.longer_than(4096) >= 1                       # the demo exercises splitting
    assert {s.format for s in corpus.sources} == {"jsonl", "tokens"}
    for source in corpus.sources:
        assert main(["inspect", source.local_dir, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert [s["name"] for s in report["shards"]] == source.shards
        assert [s["records"] for s in report["shards"]] == [len(x) for x in source.lengths]
        assert report["tokens"] == source.tokens
    assert len(corpus.expected_items(4096)) == sum(s.samples(4096) for s in corpus.sources)
    again = generate(tmp_path / "again", small=True, capacity=4096)
    assert [s.lengths for s in again.sources] == [s.lengths for s in corpus.sources]
