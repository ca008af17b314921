"""What an operator sees: the streamload logger, stats() fields that agree with each other,
summary(), and the on_step callback."""
from __future__ import annotations

import logging

import streamload as sl
from corpus import write_jsonl_source


def loader_for(root, **kw):
    return sl.Loader([sl.Source(str(root / "web"), weight=0.7),
                      sl.Source(str(root / "tiny"), weight=0.3)],
                     micro_batch_tokens=1024, micro_batches=2, epochs=1, **kw)


def test_the_logger_says_what_is_read_and_when_a_source_runs_out(tmp_path, caplog):
    write_jsonl_source(tmp_path, "web", shards=3, per_shard=60, seed=1)
    write_jsonl_source(tmp_path, "tiny", shards=1, per_shard=5, seed=2)
    caplog.set_level(logging.INFO, logger="streamload")
    with loader_for(tmp_path) as loader:
        steps = sum(1 for _ in loader)
    text = [r.getMessage() for r in caplog.records if r.name == "streamload"]
    assert any("source 'web'" in t and "3 shard(s), 3 on rank 0 of 1" in t for t in text), text
    assert any("memory budget" in t for t in text), text
    ran_out = [t for t in text if "source 'tiny' ran out of data for epoch 0" in t]
    assert len(ran_out) == 1 and "the other sources take its share" in ran_out[0], text
    assert len(text) < 10 < steps          # nothing per step


def test_the_logger_warns_of_a_source_that_can_never_be_read(tmp_path, caplog):
    """Weight 0 next to a source that restarts forever: the source is never read and its epoch
    never ends. Said once at start; not said when a schedule point gives it weight."""
    write_jsonl_source(tmp_path, "web", shards=1, per_shard=20, seed=1)
    write_jsonl_source(tmp_path, "tiny", shards=1, per_shard=5, seed=2)
    caplog.set_level(logging.WARNING, logger="streamload")
    sources = [sl.Source(str(tmp_path / "web"), on_exhausted="restart"),
               sl.Source(str(tmp_path / "tiny"), weight=0)]
    with sl.Loader(sources, micro_batch_tokens=1024) as loader:
        next(iter(loader))
    never = [r.getMessage() for r in caplog.records if "never read" in r.getMessage()]
    assert len(never) == 1 and "source 'tiny' has weight 0" in never[0], never
    caplog.clear()
    later = sl.Mixture(schedule=[sl.MixPoint(at=0, weights={"web": 1, "tiny": 0}),
                                 sl.MixPoint(at=100, weights={"web": 1, "tiny": 1})])
    with sl.Loader(sources, mixture=later, micro_batch_tokens=1024) as loader:
        next(iter(loader))
    assert not any("never read" in r.getMessage() for r in caplog.records)


def test_the_logger_is_quiet_by_default(tmp_path, capsys):
    write_jsonl_source(tmp_path, "web", shards=1, per_shard=10, seed=1)
    write_jsonl_source(tmp_path, "tiny", shards=1, per_shard=2, seed=2)
    with loader_for(tmp_path) as loader:
        list(loader)
    captured = capsys.readouterr()
    assert "streamload" not in captured.err and "streamload" not in captured.out
    # pytest's own handlers swallow records in this process, so check in a fresh one too: a
    # warning with no logging configured prints nothing (the library's NullHandler).
    import subprocess
    import sys
    code = ("import logging, streamload; "
            "logging.getLogger('streamload').warning('a warning')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == "", proc.stderr


def test_a_log_line_names_streamload_once(tmp_path):
    """The logger's name is the prefix (logging's formats print %(name)s); a message that
    starts with 'streamload:' printed it twice ('INFO:streamload:streamload: source ...')."""
    import subprocess
    import sys
    write_jsonl_source(tmp_path, "web", shards=1, per_shard=30, seed=1)
    write_jsonl_source(tmp_path, "tiny", shards=1, per_shard=2, seed=2)
    code = ("import logging, sys, streamload as sl; logging.basicConfig(level=logging.INFO); "
            "root = __import__('pathlib').Path(sys.argv[1]); "
            "loader = sl.Loader([sl.Source(str(root / 'web'), weight=0.7), "
            "sl.Source(str(root / 'tiny'), weight=0.3)], micro_batch_tokens=1024, epochs=1); "
            "list(loader); loader.close()")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "streamload" in line]
    assert any(line.startswith("INFO:streamload:source 'web'") for line in lines), lines
    assert any(line.startswith("WARNING:streamload:source 'tiny' ran out") for line in lines)
    assert not [line for line in lines if line.count("streamload") > 1 and
                "streamload:streamload" in line.replace(" ", "")], lines


def test_no_log_call_in_the_package_repeats_the_loggers_name():
    """Every logging call, run or not: its message does not start with 'streamload'."""
    import ast
    from pathlib import Path
    wrong = []
    for path in sorted(Path(sl.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("debug", "info", "warning", "error", "exception",
                                           "critical") and node.args
                    and isinstance(node.args[0], (ast.Constant, ast.JoinedStr))
                    and ast.unparse(node.args[0]).lstrip("f").strip("'\"").startswith(
                        "streamload")):
                wrong.append(f"{path.name}:{node.lineno}")
    assert not wrong, wrong


def test_stats_agree_with_the_steps_taken_and_summary_reads_them(tmp_path):
    write_jsonl_source(tmp_path, "web", shards=3, per_shard=60, seed=1)
    write_jsonl_source(tmp_path, "tiny", shards=1, per_shard=40, seed=2)
    records = []
    with loader_for(tmp_path, prefetch_steps=4, on_step=records.append) as loader:
        batches = [b for _, b in zip(range(6), loader)]
        stats = loader.stats()
        summary = loader.summary()
    assert stats["steps"] == 6 and stats["steps_planned"] >= 6    # the loop runs ahead
    web = stats["sources"]["web"]
    assert web["shards_started"] >= 1 and web["shards_read"] <= web["shards_started"]
    mix = stats["mix"]
    assert set(mix) == {"web", "tiny"}
    assert abs(sum(m["realized"] for m in mix.values()) - 1) < 1e-9
    assert abs(mix["web"]["target"] - 0.7) < 0.05
    assert stats["bytes_read"] > 0 and stats["tokens_delivered"] > 0
    assert "6 steps taken" in summary and "mix of tokens: target (as configured)" in summary
    # on_step: one flat record of numbers per step, in order.
    assert [r["step"] for r in records] == [b.step for b in batches]
    assert all(isinstance(v, (int, float)) for r in records for v in r.values())


def job_stats_job(rank, world, root):
    from pathlib import Path
    with loader_for(Path(root)) as loader:
        for _ in zip(range(3), loader):
            pass
        return loader.stats(scope="job"), loader.stats()


def test_job_stats_gather_every_rank(tmp_path):
    from distributed import run_ranks
    write_jsonl_source(tmp_path, "web", shards=3, per_shard=60, seed=1)
    write_jsonl_source(tmp_path, "tiny", shards=1, per_shard=40, seed=2)
    results = run_ranks(job_stats_job, 2, str(tmp_path))
    (job0, mine0), (job1, mine1) = results
    assert [r["rank"] for r in job0["ranks"]] == [0, 1] and job0["job"] == job1["job"]
    assert job0["job"]["ranks"] == 2 and job0["job"]["steps"] == 3
    assert job0["job"]["tokens_delivered"] >= mine0["tokens_delivered"]
    web = job0["job"]["sources"]["web"]
    assert web["bytes_fetched"] == sum(r["sources"]["web"]["bytes_fetched"] for r in job0["ranks"])
