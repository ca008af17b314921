"""Per-step metrics (streamload/observe.py), their plots and `streamload report` / `plan --plot`
(streamload/commands/plots.py, report.py)."""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from corpus import write_jsonl_source, write_token_source

import streamload as sl
from streamload.commands.cli import main
from streamload.commands.dryrun import scan, simulate, summarize
from streamload.configfile import load_config
from streamload.observe import MetricsLog, TensorBoardWriter, read_metrics, step_record

pytestmark = pytest.mark.timeout(120)

WIDTH, HEIGHT = 1200, 900
PLAN = """
[loader]
micro_batch_tokens = 1024
micro_batches = 2
planner = "balanced"
seed = 3

[mixture]
weights = { web = 0.7, code = 0.3 }

[[source]]
uri = "web/"

[[source]]
uri = "code/"
"""


def png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG signature and its first chunk, IHDR."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", head[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("observe")
    write_jsonl_source(root, "web", 4, 60, median=200, seed=1)
    write_token_source(root, "code", 4, 40, median=300, seed=2)
    return root


def loader_sources(root):
    return [sl.Source(str(root / "web"), weight=0.7), sl.Source(str(root / "code"), weight=0.3)]


@pytest.fixture(scope="module")
def run_records(corpus):
    """Step records of one epoch (padded rows), with the batches' own numbers to check."""
    C, M = 512, 2
    out = []
    with sl.Loader(loader_sources(corpus), micro_batch_tokens=C, micro_batches=M, epochs=1,
                   pad_to="capacity") as loader:
        for batch in loader:
            record = step_record(batch, C * M * loader.world_size, ["web", "code"])
            ids = [i for mb in batch.micro_batches for i in mb.sample_ids]
            padding = sum(mb.padding for mb in batch.micro_batches)
            out.append((record, batch.num_tokens, ids, padding, batch.step))
    assert len(out) > 3
    return out


# -- step_record ----------------------------------------------------------------------------------
def test_step_record_is_flat_numbers_and_adds_up(run_records):
    padded = 0
    for record, num_tokens, ids, padding, step in run_records:
        assert all(isinstance(k, str) and type(v) is float for k, v in record.items())
        assert record["step"] == step
        assert record["tokens"] == num_tokens
        assert record["tokens/web"] + record["tokens/code"] == num_tokens   # padding excluded
        assert record["samples/web"] + record["samples/code"] == len(ids) == record["samples"]
        assert record["samples/web"] == sum(i.startswith("web/") for i in ids)
        assert record["padding"] == padding
        padded += padding > 0
        assert record["job_tokens"] == num_tokens        # one rank: the job is this rank
        assert record["job_tokens/web"] == record["tokens/web"]
        assert record["job_tokens/code"] == record["tokens/code"]
        assert record["fill"] == pytest.approx(num_tokens / (512 * 2))
        assert 0 < record["fill"] <= 1
        assert record["imbalance"] >= 1.0 - 1e-9
        assert record["rank_cost_max"] >= record["rank_cost_mean"] > 0
        assert record["max_deferral"] >= 0
        assert record["exchanged_tokens"] == 0           # one rank: nothing moves
        assert record["target/web"] == pytest.approx(0.7)
        assert record["tail"] in (0.0, 1.0) and record["ran_out/web"] in (0.0, 1.0)
    assert padded, "some row should have padding"
    assert sum(r["tokens/code"] for r, *_ in run_records) > 0


def job_mix_job(rank, world, root):
    with sl.Loader(loader_sources(Path(root)), micro_batch_tokens=512, micro_batches=2,
                   epochs=1) as loader:
        return [step_record(batch, 512 * 2 * world, ["web", "code"]) for batch in loader]


def test_job_tokens_per_source_are_the_jobs_on_every_rank(corpus):
    """`job_tokens/<source>` is the job's mix: the same on both gloo ranks, the sum of the
    ranks' own `tokens/<source>`, and adding up to `job_tokens`."""
    from distributed import run_ranks
    ranks = run_ranks(job_mix_job, 2, str(corpus), timeout=120)
    assert len(ranks[0]) == len(ranks[1]) > 3
    for a, b in zip(*ranks):
        for name in ("web", "code"):
            assert a[f"job_tokens/{name}"] == b[f"job_tokens/{name}"] \
                == a[f"tokens/{name}"] + b[f"tokens/{name}"]
        assert a["job_tokens/web"] + a["job_tokens/code"] == a["job_tokens"]


def test_step_record_counts_segments_by_sample_id():
    import torch
    rows = [sl.MicroBatch(tokens=torch.zeros(10, dtype=torch.int64),
                          cu_seqlens=torch.tensor([0, 3, 7, 10], dtype=torch.int32),
                          position_ids=None, labels=None, loss_mask=None,
                          sample_ids=["a/s0/1", "b/s3/2:1"], max_seqlen=4, padding=3),
            sl.MicroBatch(tokens=torch.zeros(5, dtype=torch.int64),
                          cu_seqlens=torch.tensor([0, 5], dtype=torch.int32),
                          position_ids=None, labels=None, loss_mask=None,
                          sample_ids=["a/s1/0:0+7"], max_seqlen=5)]
    batch = sl.Batch(step=4, epoch=1, micro_batches=rows, rank_tokens=np.array([12, 8]),
                     rank_cost=np.array([3.0, 1.0]), max_deferral=2)
    record = step_record(batch, 40, ["a", "b", "c"])
    assert record["tokens/a"] == 3 + 5 and record["tokens/b"] == 4 and record["tokens/c"] == 0
    assert record["samples/a"] == 2 and record["samples/b"] == 1
    assert record["tokens"] == 12 and record["padding"] == 3
    assert record["job_tokens"] == 20 and record["fill"] == 0.5
    assert record["imbalance"] == 1.5 and record["rank_cost_max"] == 3.0
    assert record["rank_cost_mean"] == 2.0
    assert (record["step"], record["epoch"], record["max_deferral"]) == (4.0, 1.0, 2.0)


# -- MetricsLog, TensorBoardWriter ----------------------------------------------------------------
def test_metrics_log_writes_one_line_per_step(tmp_path, run_records):
    path = tmp_path / "logs" / "metrics.jsonl"
    records = [r for r, *_ in run_records]
    with MetricsLog(path) as log:
        for record in records:
            log(record)
            # flushed at once: readable while the run goes on
            assert len(path.read_text().splitlines()) == int(record["step"]) + 1
    lines = path.read_text().splitlines()
    assert len(lines) == len(records)
    assert [json.loads(line) for line in lines] == records
    # A resumed run appends; the last record of a step wins, and a torn last line is skipped.
    with MetricsLog(path) as log:
        log({**records[-1], "fill": 0.25})
    with open(path, "a") as f:
        f.write('{"step": 99, "fi')
    back = read_metrics(path)
    assert len(back) == len(records) and back[-1]["fill"] == 0.25


def test_loader_on_step_writes_the_metrics_log(tmp_path, corpus):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log, \
            sl.Loader(loader_sources(corpus), micro_batch_tokens=1024, micro_batches=2,
                      epochs=1, on_step=log) as loader:
        steps = sum(1 for _ in loader)
    records = read_metrics(path)
    assert len(path.read_text().splitlines()) == steps == len(records)
    assert [r["step"] for r in records] == list(range(steps))
    assert all({"tokens/web", "tokens/code", "fill", "imbalance"} <= set(r) for r in records)


def test_tensorboard_writer_writes_event_files(tmp_path, run_records):
    pytest.importorskip("tensorboard")
    records = [r for r, *_ in run_records]
    with TensorBoardWriter(tmp_path / "tb") as tb:
        for record in records:
            tb(record)
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"streamload/fill", "streamload/tokens/web", "streamload/imbalance"} <= tags
    assert "streamload/step" not in tags
    fill = acc.Scalars("streamload/fill")
    assert [e.step for e in fill] == [int(r["step"]) for r in records]
    assert [e.value for e in fill] == pytest.approx([r["fill"] for r in records])


def test_tensorboard_writer_names_the_extra_when_tensorboard_is_missing(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ImportError, match=r"pip install streamload\[tensorboard\]"):
        TensorBoardWriter("unused")


# -- plots ----------------------------------------------------------------------------------------
def test_plot_run_draws_a_png_of_the_fixed_size(tmp_path, run_records):
    pytest.importorskip("matplotlib")
    from streamload.commands.plots import plot_run
    records = [r for r, *_ in run_records]
    out = plot_run(records, tmp_path / "run.png", target_shares={"web": 0.7, "code": 0.3})
    assert png_size(out) == (WIDTH, HEIGHT)
    # With an exchange series, no target, and with no steps at all: still a figure.
    exchanged = [{**r, "exchanged_tokens": 100.0 * i} for i, r in enumerate(records)]
    assert png_size(plot_run(exchanged, tmp_path / "x.png")) == (WIDTH, HEIGHT)
    assert png_size(plot_run([], tmp_path / "empty.png")) == (WIDTH, HEIGHT)


def test_plot_plan_draws_a_png_of_the_fixed_size(tmp_path, corpus):
    pytest.importorskip("matplotlib")
    from streamload.commands.plots import plot_plan
    config = tmp_path / "job.toml"
    config.write_text(PLAN.replace('"web/"', f'"{corpus / "web"}/"')
                      .replace('"code/"', f'"{corpus / "code"}/"'))
    spec = load_config(config)
    reports = simulate(spec, scan(spec), 12, 4)
    out = plot_plan(summarize(spec, reports), reports, tmp_path / "plan.png")
    assert png_size(out) == (WIDTH, HEIGHT)


def test_the_fill_line_is_not_hidden_under_the_tokens_line():
    """Was: the job's tokens, drawn on the right axis scaled to their own top, lay exactly on
    the fill line (tokens = fill x R*M*C) and hid it. Now the right axis reads the fill line in
    tokens, and only this rank's tokens (when they differ) get a line of their own."""
    pytest.importorskip("matplotlib")
    from streamload.commands.plots import _figure, series_from_records
    fill = [0.5, 1.0, 0.9, 0.75]
    records = [{"step": float(i), "fill": f, "job_tokens": f * 2048, "tokens": f * 1024,
                "imbalance": 1.0} for i, f in enumerate(fill)]
    fig = _figure(series_from_records(records))
    panel = next(ax for ax in fig.axes if ax.get_title() == "fill and tokens per step")
    twin = next(ax for ax in fig.axes if ax is not panel
                and ax.get_position().bounds == panel.get_position().bounds)
    lines = panel.get_lines() + twin.get_lines()
    assert [line.get_label() for line in lines] == ["fill (tokens, job)", "tokens (this rank)"]
    shown = [line.get_transform().transform(line.get_xydata()) for line in lines]
    assert not np.allclose(shown[0], shown[1])
    assert twin.get_ylim()[1] == pytest.approx(panel.get_ylim()[1] * 2048)


def test_plots_name_the_extra_when_matplotlib_is_missing(tmp_path, monkeypatch):
    import builtins
    from streamload.commands.plots import plot_run
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install streamload\[plot\]"):
        plot_run([{"step": 0, "tokens": 1.0}], tmp_path / "no.png")


# -- the commands ---------------------------------------------------------------------------------
def test_report_command_summarizes_and_plots(tmp_path, run_records, capsys):
    pytest.importorskip("matplotlib")
    log = tmp_path / "metrics.jsonl"
    with MetricsLog(log) as write:
        for record, *_ in run_records:
            write(record)
    out_png = tmp_path / "report.png"
    rc = main(["report", str(log), "--plot", str(out_png), "--target", "web=0.7,code=0.3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"{len(run_records)} steps" in out
    assert "fill: mean" in out and "p50" in out and "imbalance: mean" in out
    assert re.search(r"web +0\.700 \|", out) and "code 0.300 |" in out
    assert png_size(out_png) == (WIDTH, HEIGHT)
    # Without --target: the log's own targets (each step record has them).
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"web +0\.700 \|", out) and "code 0.300 |" in out
    assert "--target" not in out
    # A log written before targets were recorded: no target, and how to give one.
    old = tmp_path / "old.jsonl"
    with MetricsLog(old) as write:
        for record, *_ in run_records:
            write({k: v for k, v in record.items() if not k.startswith(("target/", "ran_out/"))})
    assert main(["report", str(old)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"web +- \|", out) and "no target in the log" in out


def test_report_command_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    assert main(["report", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    good.write_text('{"step": 0, "tokens": 5}\n')
    assert main(["report", str(good), "--target", "web"]) == 2
    assert "NAME=SHARE" in capsys.readouterr().err


def test_plan_command_plots(tmp_path, corpus, capsys):
    pytest.importorskip("matplotlib")
    config = tmp_path / "job.toml"
    config.write_text(PLAN.replace('"web/"', f'"{corpus / "web"}/"')
                      .replace('"code/"', f'"{corpus / "code"}/"'))
    out_png = tmp_path / "plan.png"
    rc = main(["plan", str(config), "--steps", "10", "--ranks", "2", "--json",
               "--plot", str(out_png)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert json.loads(out.strip().splitlines()[-1])["summary"]["steps"] == 10
    assert png_size(out_png) == (WIDTH, HEIGHT)
