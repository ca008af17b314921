"""Counters the loader keeps and `Loader.stats()` reports (docs/metrics.md: every field, its
unit, and whether it is this rank's or the job's). Updated on the loop thread only."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .mixreport import MixTally, StepMix
from .plan.cost import StepCosts

FILL_BINS = 1000   # tokens-per-step histogram resolution: 0.1% of a full step
LOW_FILL = 0.9     # a step below this share of its capacity counts as low


@dataclass
class SourceMetrics:
    shards_listed: int = 0
    shards_started: int = 0     # shards this rank began reading (all passes)
    shards_read: int = 0        # of those, read to the end
    records: int = 0            # documents decoded
    samples: int = 0            # buffered items (a split document counts once per chunk)
    tokens: int = 0
    delivered_samples: int = 0  # items this rank packed into its batches
    delivered_tokens: int = 0
    skipped_records: int = 0
    skipped_shards: int = 0
    empty_documents: int = 0
    truncated_documents: int = 0
    dropped_documents: int = 0  # long_documents="drop"
    transform_s: float = 0.0
    step_wait_s: float = 0.0    # time steps waited for this source's head window
    skip_reasons: deque = field(default_factory=lambda: deque(maxlen=8))
    first_skip: Optional[str] = None   # "shard 'x', record 3: reason" of the first skip

    def snapshot(self, store_counters=None, buffer=None) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "skip_reasons"}
        out["skip_reasons"] = list(self.skip_reasons)
        if store_counters is not None:
            lat = np.asarray(store_counters.latencies_s[-1024:], dtype=np.float64)
            out.update(
                requests=store_counters.requests, retries=store_counters.retries,
                bytes_fetched=store_counters.bytes_read,
                fetch_latency_ms={f"p{q}": float(np.percentile(lat, q) * 1e3) if lat.size else None
                                  for q in (50, 90, 99)})
        if buffer is not None:
            out.update(buffer_tokens=buffer.tokens, buffer_capacity_tokens=buffer.capacity_tokens)
        return out


@dataclass
class StepMetrics:
    steps: int = 0
    epoch: int = 0
    # The last step's per-rank figures, kept as arrays (lists only in `snapshot()`: turning
    # R x M floats into Python objects every step would grow a rank's step with R)
    last_rank_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0))
    last_rank_cost: np.ndarray = field(default_factory=lambda: np.zeros(0))
    last_row_cost: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))   # [R, M]
    last_step_time: float = 0.0    # the slowest rank's 1F1B time (`cost.pipeline_time`)
    last_imbalance: float = 0.0
    imbalance_sum: float = 0.0
    # The vision encoder's part of each rank's cost and the rest (the backbone) [R], apart, and
    # their max / mean imbalance (image sources under image_cost="hybrid"; zeros / 1.0 without)
    last_encoder_cost: np.ndarray = field(default_factory=lambda: np.zeros(0))
    last_backbone_cost: np.ndarray = field(default_factory=lambda: np.zeros(0))
    last_encoder_imbalance: float = 1.0
    last_backbone_imbalance: float = 1.0
    encoder_imbalance_sum: float = 0.0
    backbone_imbalance_sum: float = 0.0
    plan_ms: deque = field(default_factory=lambda: deque(maxlen=256))
    exchanged_tokens: int = 0
    deferral_max: int = 0       # most steps any delivered sample waited in a window
    deferral_sum: int = 0
    delivered: int = 0
    step_tokens: int = 0        # R·M·C: the tokens a full step holds
    pieces_cut: int = 0         # pieces of split documents cut to fill a row (the head went)
    cut_work: float = 0.0       # the attention work those cuts took out (CostModel.cut_savings)
    # The job's tokens taken of each source over all steps.
    source_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # The job's mix in the mixture's unit against the configured target (`mixreport`); set by
    # the Runtime, which knows the sources' names.
    mix: MixTally = field(default_factory=lambda: MixTally([]))
    # Steps by fill (the job's tokens over R·M·C) in 0.1% bins: exact enough percentiles of
    # tokens per step in constant memory, however long the run.
    fill_bins: np.ndarray = field(default_factory=lambda: np.zeros(FILL_BINS + 1, np.int64))

    @property
    def delivered_tokens(self) -> int:
        """Tokens delivered over every rank, all steps."""
        return int(self.source_tokens.sum())

    def record_mix(self, epoch: int, step: int, tokens: np.ndarray, units: np.ndarray,
                   mix: StepMix) -> None:
        """One step: the job's tokens and units (the mixture's: tokens or samples) per source,
        and its mix facts."""
        if self.source_tokens.size != tokens.size:
            self.source_tokens = np.zeros(tokens.size)
        self.source_tokens += tokens
        self.mix.add(epoch, step, units, mix)

    def record(self, rank_tokens: np.ndarray, row_cost: np.ndarray, pipeline_stages: int = 1,
               encoder_cost: np.ndarray | None = None, costs: StepCosts | None = None) -> None:
        """One step: tokens per rank [R] and predicted cost per (rank, row) [R, M];
        `encoder_cost` [R, M]: the vision encoder's part of `row_cost`; `costs`: the step's
        job-wide figures, counted from the arrays when not given. Under control_plane="gather"
        a rank other than 0 has only its own rank's arrays ([1], [1, M]) and rank 0's `costs`."""
        self.steps += 1
        rank_cost = row_cost.sum(axis=1)
        encoder = np.zeros_like(rank_cost) if encoder_cost is None else encoder_cost.sum(axis=1)
        if costs is None:
            costs = StepCosts.of(rank_tokens, rank_cost, row_cost, pipeline_stages, encoder)
        # copies: the Batch the trainer gets holds the same arrays
        self.last_row_cost = np.array(row_cost, dtype=np.float64)
        self.last_step_time = costs.step_time
        if self.step_tokens:
            fill = int(costs.tokens) / self.step_tokens
            self.fill_bins[min(int(round(fill * FILL_BINS)), FILL_BINS)] += 1
        self.last_rank_tokens = np.array(rank_tokens, dtype=np.float64)
        self.last_rank_cost = rank_cost
        self.last_imbalance = costs.imbalance
        self.imbalance_sum += self.last_imbalance
        self.last_encoder_cost, self.last_backbone_cost = encoder, rank_cost - encoder
        self.last_encoder_imbalance = costs.encoder_imbalance
        self.last_backbone_imbalance = costs.backbone_imbalance
        self.encoder_imbalance_sum += self.last_encoder_imbalance
        self.backbone_imbalance_sum += self.last_backbone_imbalance

    def tokens_per_step(self) -> dict:
        """The job's tokens per step: mean and p1 / p50 / p99 (to 0.1% of a full step), the
        mean fill, and the steps below LOW_FILL of a full step."""
        if not self.steps or not self.step_tokens:
            return {"mean": None, "p1": None, "p50": None, "p99": None, "fill": None,
                    "steps_below_90pct": 0}
        cumulative = np.cumsum(self.fill_bins)
        def percentile(q):   # the lowest bin holding the q-th percentile step
            k = int(np.searchsorted(cumulative, q / 100 * self.steps, side="left"))
            return int(round(k / FILL_BINS * self.step_tokens))
        low = int(self.fill_bins[:int(LOW_FILL * FILL_BINS)].sum())
        return {"mean": self.delivered_tokens / self.steps, "p1": percentile(1),
                "p50": percentile(50), "p99": percentile(99),
                "fill": self.delivered_tokens / (self.steps * self.step_tokens),
                "steps_below_90pct": low}

    def snapshot(self) -> dict:
        plan = np.asarray(self.plan_ms, dtype=np.float64)
        return {
            "tokens_per_step": self.tokens_per_step(), "step_capacity_tokens": self.step_tokens,
            "steps_planned": self.steps, "epoch": self.epoch,
            "rank_tokens": self.last_rank_tokens.tolist(),
            "rank_cost": self.last_rank_cost.tolist(),
            "row_cost": self.last_row_cost.tolist(), "step_time": self.last_step_time,
            "imbalance": self.last_imbalance,
            "imbalance_mean": self.imbalance_sum / self.steps if self.steps else None,
            "encoder_cost": self.last_encoder_cost.tolist(),
            "backbone_cost": self.last_backbone_cost.tolist(),
            "encoder_imbalance": self.last_encoder_imbalance,
            "backbone_imbalance": self.last_backbone_imbalance,
            "encoder_imbalance_mean": self.encoder_imbalance_sum / self.steps
            if self.steps else None,
            "backbone_imbalance_mean": self.backbone_imbalance_sum / self.steps
            if self.steps else None,
            "plan_ms_median": float(np.median(plan)) if plan.size else None,
            "exchanged_tokens": self.exchanged_tokens,
            "pieces_cut": self.pieces_cut, "cut_work": self.cut_work,
            "deferral_max": self.deferral_max,
            "deferral_mean": self.deferral_sum / self.delivered if self.delivered else None,
        }


def rank_stats(runtime) -> dict:
    """`Loader.stats()`: this rank's counters, per step and per source (a `Runtime`'s, read on
    its loop or after it ended)."""
    elapsed = time.perf_counter() - runtime.started if runtime.started is not None else 0.0
    sources = {}
    for s, source in enumerate(runtime.sources):
        metrics = runtime.source_metrics[s]
        fetcher = runtime.fetchers[s] if runtime.fetchers else None   # None: not read here
        counters = fetcher.store.counters if fetcher is not None else None
        buffer = runtime.buffers[s] if runtime.buffers else None
        gate = runtime.gates[s] if runtime.gates else None
        knobs = runtime.knobs[s]
        out = metrics.snapshot(counters, buffer)
        out.update(
            samples_per_s=metrics.delivered_samples / elapsed if elapsed > 0 else 0.0,
            tokens_per_s=metrics.delivered_tokens / elapsed if elapsed > 0 else 0.0,
            shard_concurrency=knobs.shards, range_readahead=knobs.readahead,
            inflight_bytes=gate.used if gate else 0,
            inflight_bytes_peak=gate.peak if gate else 0,
            inflight_over_budget_peak_bytes=gate.excess_peak if gate else 0,
            inflight_budget_bytes=runtime.budgets[s].inflight_bytes,
            decoded_per_raw_byte=gate.expansion if gate else None,
            buffer_blocked_s=buffer.blocked_s if buffer is not None else 0.0)
        out["autoscale_changes"] = [{"step": step, "shard_concurrency": shards,
                                     "range_readahead": ranges}
                                    for step, shards, ranges in knobs.history[-8:]]
        out["reads"] = fetcher is not None or not runtime.fetchers   # this rank reads it
        sources[source.name] = out
    steps = runtime.step_metrics
    mix = steps.mix.summary()
    read = sum(s.get("bytes_fetched", 0) for s in sources.values())
    delivered = sum(s["delivered_tokens"] for s in sources.values())
    return {"rank": runtime.comm.rank, "world_size": runtime.comm.world,
            **steps.snapshot(), "mix": mix["sources"] if mix["steps"] else {},
            "mix_steps": {"unit": "tokens" if runtime.stepper.mixer.by_tokens else "samples",
                          **{k: mix[k] for k in ("steps", "steps_all_active", "steps_tail",
                                                 "deviation", "tail_deviation")}},
            "bytes_read": read, "tokens_delivered": delivered,
            "bytes_read_per_token": read / delivered if delivered else None, "sources": sources,
            "control_plane": runtime.control_plane()}


def job_totals(ranks: list[dict]) -> dict:
    """`stats(scope="job")`'s totals over every rank's stats: sums of what each rank counts
    for itself, the slowest rank's waits, and per source the sums over ranks."""
    def total(key):
        return sum(r.get(key) or 0 for r in ranks)
    sources: dict[str, dict] = {}
    for r in ranks:
        for name, s in r.get("sources", {}).items():
            into = sources.setdefault(name, {})
            for key in ("shards_read", "records", "delivered_samples", "delivered_tokens",
                        "skipped_records", "skipped_shards", "bytes_fetched", "requests",
                        "retries", "step_wait_s", "transform_s"):
                into[key] = into.get(key, 0) + (s.get(key) or 0)
    read, delivered = total("bytes_read"), total("tokens_delivered")
    return {"ranks": len(ranks), "steps": min((r.get("steps", 0) for r in ranks), default=0),
            "bytes_read": read, "tokens_delivered": delivered,
            "bytes_read_per_token": read / delivered if delivered else None,
            "stall_s_max": max((r.get("stall_s", 0.0) for r in ranks), default=0.0),
            "sources": sources}
