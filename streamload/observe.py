"""Per-step metrics for the operator: one flat record per step, and where it goes.

    record = step_record(batch, step_tokens=R * M * C, sources=["web", "code"])
    log = MetricsLog("metrics.jsonl")          # one JSON line per step
    tb = TensorBoardWriter("runs/job")         # one scalar per key (needs tensorboard)
    log(record); tb(record)

`Loader(on_step=callback)` calls its callback with each step's record on the trainer's thread;
`MetricsLog` and `TensorBoardWriter` are such callbacks. `streamload report metrics.jsonl
--plot out.png` reads the log back (`read_metrics`) and draws it (`commands/plots.py`).

The record is a flat dict of numbers (float), so every key is a time series:

    step, epoch           the batch's step (over all epochs) and epoch
    tokens                this rank's documents' tokens (`Batch.num_tokens`: padding not counted)
    samples, padding      this rank's documents (pieces of split documents count one each), pad
                          tokens in its rows (pad_to="capacity")
    job_tokens            tokens planned for the whole job this step (sum of `rank_tokens`)
    fill                  job_tokens / step_tokens (step_tokens = R * M * C)
    imbalance             predicted max / mean rank cost (1.0: perfect)
    rank_cost_max, rank_cost_mean   the predicted rank costs
    step_time, row_cost_max  the step's predicted time (the slowest rank's 1F1B time over its
                          micro-batches, `Batch.step_time`) and its costliest micro-batch
    pipeline_efficiency   the step's work spread evenly over every (rank, micro-batch), over
                          step_time (1.0: nothing waits)
    encoder_imbalance, backbone_imbalance   max / mean over ranks of the vision encoder's part
                          of the predicted rank costs and of the rest (`Batch.encoder_cost`,
                          `Batch.backbone_cost`; image sources under image_cost="hybrid")
    max_deferral          steps the longest-waiting sample of this step was deferred
    tokens/<source>, samples/<source>   this rank's tokens and documents of each source
    job_tokens/<source>   the job's tokens of each source this step, over every DP rank (the
                          mix the schedule is held to; the same on every rank)
    exchanged_tokens      the job's tokens moved to another rank this step (the exchange)
    target/<source>       the configured share of each source at this step (the schedule's,
                          over every source: `mixreport`)
    tail                  1 once the epoch's tail has begun (a source's windows hold all it
                          has left), else 0
    ran_out/<source>      1 on the step that took a source's last items of the epoch, else 0
    skipped_records/<source>, skipped_shards/<source>   what on_error="skip" skipped of each
                          source on this rank so far (running totals; `stats()` has the reasons)

Per-source tokens come from the rows' `cu_seqlens`: segment k of a row is `sample_ids[k]`, and a
padded row's last segment (its padding) has no sample id, so it is not counted. They add up to
`tokens`, except on a context-parallel rank (a CP part's segments include the split's alignment
padding) and on a pipeline stage that receives no tokens (`tokens` is 0 there, the per-source
counts still describe its rows).
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

if TYPE_CHECKING:   # step_record reads a Batch's fields; importing it would import torch
    from .batch import Batch

__all__ = ["step_record", "MetricsLog", "TensorBoardWriter", "read_metrics", "source_of"]


def source_of(sample_id: str) -> str:
    """The source of a sample id "source/shard/record[:k]" (source names hold no '/')."""
    return sample_id.split("/", 1)[0]


def step_record(batch: "Batch", step_tokens: int, sources: Sequence[str]) -> dict[str, float]:
    """One step's metrics, a flat {name: float} (see the module docstring). `sources`: the
    sources' names, so that every record holds every source's keys (0 when it sent nothing)."""
    tokens = {name: 0 for name in sources}
    samples = {name: 0 for name in sources}
    padding = 0
    for mb in batch.micro_batches:
        ids = mb.sample_ids
        padding += int(getattr(mb, "padding", 0) or 0)
        lengths: Optional[np.ndarray] = None
        if mb.cu_seqlens is not None:
            cu = np.asarray(mb.cu_seqlens, dtype=np.int64).reshape(-1)
            lengths = np.diff(cu)[:len(ids)]   # the documents' segments; the padding's is last
        for k, sample_id in enumerate(ids):
            name = source_of(sample_id)
            samples[name] = samples.get(name, 0) + 1
            tokens.setdefault(name, 0)
            if lengths is not None and k < lengths.size:
                tokens[name] += int(lengths[k])
    costs = batch.costs   # the job-wide figures: the same on every rank
    job_tokens = costs.tokens
    record = {
        "step": float(batch.step), "epoch": float(batch.epoch),
        "tokens": float(batch.num_tokens),
        "samples": float(sum(len(mb.sample_ids) for mb in batch.micro_batches)),
        "padding": float(padding),
        "job_tokens": job_tokens,
        "fill": job_tokens / step_tokens if step_tokens > 0 else 0.0,
        "imbalance": costs.imbalance,
        "rank_cost_max": costs.rank_cost_max,
        "rank_cost_mean": costs.rank_cost_mean,
        "step_time": costs.step_time,
        "pipeline_efficiency": costs.pipeline_efficiency,
        "row_cost_max": costs.row_cost_max,
        "max_deferral": float(batch.max_deferral),
    }
    if getattr(batch, "encoder_cost", None) is not None:
        record["encoder_imbalance"] = costs.encoder_imbalance
        record["backbone_imbalance"] = costs.backbone_imbalance
    for name, count in tokens.items():
        record[f"tokens/{name}"] = float(count)
    for name, count in samples.items():
        record[f"samples/{name}"] = float(count)
    job_sources = getattr(batch, "source_tokens", None)
    if job_sources is not None and len(job_sources) == len(sources):
        for name, count in zip(sources, np.asarray(job_sources).tolist()):
            record[f"job_tokens/{name}"] = float(count)
    record["exchanged_tokens"] = float(getattr(batch, "exchanged_tokens", 0))
    mix = getattr(batch, "mix", None)
    if mix is not None and len(mix.target) == len(sources):
        record["tail"] = float(mix.tail)
        for name, share, out in zip(sources, mix.target.tolist(), mix.ran_out.tolist()):
            record[f"target/{name}"] = float(share)
            record[f"ran_out/{name}"] = float(out)
    skipped = getattr(batch, "skipped", None)
    if skipped is not None and len(skipped) == len(sources):
        for name, (records, shards) in zip(sources, np.asarray(skipped).tolist()):
            record[f"skipped_records/{name}"] = float(records)
            record[f"skipped_shards/{name}"] = float(shards)
    return record


def _number(value: Any) -> Any:
    """json.dumps' `default`: NumPy scalars (a caller's own keys) as Python numbers."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not a number: {value!r}")


class MetricsLog:
    """A step callback that appends each record to `path` as one JSON line, flushed at once
    (a run killed mid-step loses at most that line). Appends to an existing log (a resumed
    run); `read_metrics` keeps the last record of a repeated step."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def __call__(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=_number, separators=(",", ":")) + "\n")
        self._file.flush()

    on_step = __call__

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics log, by step: for a step logged more than once (a run resumed
    from an earlier checkpoint into the same log), the last. A torn last line (the run was
    killed while writing it) is skipped; a malformed line elsewhere is a ValueError naming it."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    by_step: dict[float, dict] = {}
    unnumbered: list[dict] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            if number == len(lines):
                break
            raise ValueError(f"{os.fspath(path)}:{number}: not a metrics record ({exc})") from None
        if "step" in record:
            by_step[float(record["step"])] = record
        else:
            unnumbered.append(record)
    return [by_step[s] for s in sorted(by_step)] + unnumbered


class TensorBoardWriter:
    """A step callback that writes every key of the record (but `step`, the x axis) as a
    TensorBoard scalar `prefix + key` at `record["step"]`, through
    `torch.utils.tensorboard.SummaryWriter(log_dir)`, or through the trainer's own `writer`.
    Needs the tensorboard package (`pip install streamload[tensorboard]`)."""

    def __init__(self, log_dir: Optional[str | os.PathLike] = None, *, writer: Any = None,
                 prefix: str = "streamload/"):
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:   # torch raises this when tensorboard is missing
                raise ImportError(
                    "TensorBoardWriter needs the tensorboard package: "
                    f"pip install streamload[tensorboard] ({exc})") from exc
            writer = SummaryWriter(log_dir=None if log_dir is None else os.fspath(log_dir))
            self._owned = True
        else:
            self._owned = False
        self.writer = writer
        self.prefix = prefix

    def __call__(self, record: dict) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step":
                self.writer.add_scalar(self.prefix + key, float(value), global_step=step)

    on_step = __call__

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Flush; close the SummaryWriter this object made (a given `writer` stays open)."""
        self.writer.flush()
        if self._owned:
            self.writer.close()

    def __enter__(self) -> "TensorBoardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
