"""The dry run's step loop: the loader's planning, on item lengths."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from ...configfile import LoaderSpec
from ...errors import ConfigError
from ...mixreport import MixTracker, StepMix
from ...plan.cost import CostModel
from ...job import JobModel, layout_feed
from ...plan.balance import exchanged_tokens
from ...plan.caps import row_visual
from ...plan.types import Candidates, Geometry
from ...plan.windows import Block, Feed, ItemQueue, Windows
from ...state import deal
from ...vision.cost import EncoderCost
from ...vision.hybrid import encoder_model

from .scan import SourceScan

DEFAULT_RANKS = 8


@dataclass
class StepReport:
    """One simulated step. Arrays are per source [S], per rank [R] or per length quota [Q]."""
    step: int
    epoch: int
    tokens: np.ndarray          # int64 [S]: tokens taken from each source
    samples: np.ndarray         # int64 [S]: items taken from each source
    share: np.ndarray           # [S]: realized share, in the mixture's unit (tokens or samples)
    target_share: np.ndarray    # [S]: the schedule's shares this step (over sources with data)
    quota_share: np.ndarray     # [S]: this step's quotas as shares (target + carried deficits)
    length_quota: np.ndarray    # [Q]: realized share of each length quota's items
    length_quota_target: np.ndarray   # [Q]: each length quota's fraction this step
    rank_cost: np.ndarray       # [R]: predicted cost of each rank
    rank_tokens: np.ndarray     # int64 [R]
    imbalance: float            # max / mean of rank_cost (1.0: perfect)
    deferred: int               # window items offered and not taken (they wait a step)
    max_age: int                # the most steps a taken item had waited
    fill: float                 # tokens / (R * M * C)
    active: np.ndarray          # bool [S]: sources with data in their windows
    cut_work: float = 0.0       # attention work the step's cuts took out of the data
                                # (`CostModel.cut_savings`): the same data uncut costs this more
    row_cost: Optional[np.ndarray] = None   # [R, M]: predicted cost of each (rank, micro-batch)
    step_time: float = 0.0      # the slowest rank's 1F1B time (`cost.pipeline_time`)
    # int64 [2, n]: the taken items that had been deferred (a later item of their window was
    # taken before them): each one's delay (the steps since then) and its tokens
    delays: np.ndarray = field(default_factory=lambda: np.zeros((2, 0), np.int64))
    plan_seconds: float = 0.0   # CPU time of the planner (`Stepper.assign`) for this step
    exchanged: int = 0          # tokens planned onto a rank other than the one holding them
    mix: Optional[StepMix] = None   # the configured target, the tail, run-outs (`mixreport`)
    # An image job: the vision encoder's part of each rank's cost [R] (the rest of rank_cost
    # is the backbone's), and each row's images and patches [R, M, 2] (the caps per row).
    # The encoder's part is measured whether the planner saw it (image_cost="hybrid") or not
    # ("backbone"): `backbone_cost` is the rest of the planned cost either way.
    encoder_cost: Optional[np.ndarray] = None
    backbone_cost: Optional[np.ndarray] = None
    row_visual: Optional[np.ndarray] = None

    @property
    def efficiency(self) -> float:
        """Under the sequential schedule (a rank's time: its encoder's then its backbone's),
        the step's work spread evenly over the slowest rank's: mean / max of the sums."""
        total = self.encoder_cost + self.backbone_cost
        return float(total.mean() / total.max()) if total.max() > 0 else 1.0

    @property
    def waited(self) -> int:
        """Taken items that had been deferred."""
        return int(self.delays.shape[1])

    @property
    def waited_steps(self) -> int:
        """Their delays, summed."""
        return int(self.delays[0].sum())

    @property
    def delay_max(self) -> int:
        return int(self.delays[0].max(initial=0))

    @property
    def waited_token_steps(self) -> int:
        """Their delays weighted by their tokens."""
        return int((self.delays[0] * self.delays[1]).sum())

    @property
    def units(self) -> float:
        return float(self.share.sum())

    def to_dict(self, names: Sequence[str]) -> dict:
        def per_source(values, digits=None):
            return {n: (round(float(v), digits) if digits else int(v))
                    for n, v in zip(names, values)}
        return {"step": self.step, "epoch": self.epoch,
                "tokens": per_source(self.tokens), "samples": per_source(self.samples),
                "share": per_source(self.share, 6), "target_share": per_source(self.target_share, 6),
                "quota_share": per_source(self.quota_share, 6),
                **({} if self.mix is None else {
                    "target": per_source(self.mix.target, 6), "tail": self.mix.tail,
                    "ran_out": [n for n, out in zip(names, self.mix.ran_out) if out]}),
                "length_quota": [round(float(v), 6) for v in self.length_quota],
                "length_quota_target": [round(float(v), 6) for v in self.length_quota_target],
                "rank_cost": [float(c) for c in self.rank_cost],
                "rank_tokens": [int(t) for t in self.rank_tokens],
                "imbalance": round(self.imbalance, 6), "deferred": self.deferred,
                "max_age": self.max_age, "fill": round(self.fill, 6),
                "cut_work": round(self.cut_work, 3),
                "row_cost": None if self.row_cost is None else self.row_cost.tolist(),
                "step_time": self.step_time, "waited": self.waited,
                "waited_steps": self.waited_steps, "delay_max": self.delay_max, "plan_ms": round(1e3 * self.plan_seconds, 3),
                **({} if self.encoder_cost is None else {
                    "encoder_cost": [float(c) for c in self.encoder_cost],
                    "backbone_cost": [float(c) for c in self.backbone_cost],
                    "row_images_max": int(self.row_visual[..., 0].max(initial=0)),
                    "row_patches_max": int(self.row_visual[..., 1].max(initial=0))})}


class _SourceFeed:
    """How one source's items reach the ranks, as `ItemQueue` feeds. A scanned source with its
    shards is dealt by the job model's own layouts (`JobModel.layout_for`, `layout_feed`): the
    loader's deal, epoch by epoch, an endless source pass after pass. Plain arrays are dealt
    round-robin, item by item (pass p > 0 reshuffled); a sampled scan's items come round again
    on every rank."""

    def __init__(self, data: Union[SourceScan, np.ndarray], index: int, seed: int, ranks: int):
        self.index, self.seed, self.ranks = index, seed, ranks
        if isinstance(data, SourceScan):
            self.lengths = np.asarray(data.lengths, dtype=np.int64)
            self.shard_items = np.asarray(data.shard_items, dtype=np.int64)
            self.sampled = not data.complete
        else:
            self.lengths = np.asarray(data, dtype=np.int64).reshape(-1)
            self.shard_items = None
            self.sampled = False
        if self.lengths.size and self.lengths.min() < 1:
            raise ValueError(f"source {index}: item lengths must be >= 1")
        divisible = getattr(data, "divisible", None)
        self.divisible = (np.zeros(self.lengths.size, bool) if divisible is None
                          else np.asarray(divisible, dtype=bool))
        self.by_shards = self.shard_items is not None and not self.sampled
        self._dealt: tuple = (None, None)
        self._item_cost: Optional[np.ndarray] = None
        if self.by_shards:
            self.starts = np.cumsum(self.shard_items) - self.shard_items
        # An image source: each item's images, patches and their flat list (`SourceScan`).
        patches = getattr(data, "image_patches", None)
        self.images = self.patches = self.image_patches = None
        if patches is not None:
            self.images = np.array([len(p) for p in patches], np.int64)
            self.patches = np.array([sum(p) for p in patches], np.int64)
            self.image_patches = np.array([n for p in patches for n in p], np.int64)

    def attributes(self, ids: np.ndarray, encoder) -> tuple:
        """(encoder cost, images, patches) of the items with `ids` (an image source; zeros for
        a text one): what the loader's runtime gives the planner for them."""
        n = ids.shape[0]
        if self.images is None or n == 0:
            return np.zeros(n), np.zeros(n, np.int64), np.zeros(n, np.int64)
        if self.by_shards:
            at = self.starts[ids[:, 0] % self.shard_items.size] + ids[:, 1]
        else:   # dealt item by item: the record field is the item's index
            at = ids[:, 1]
        images, patches = self.images[at], self.patches[at]
        if encoder is None:
            return np.zeros(n), images, patches
        if self._item_cost is None:   # per item: its images' a*P^2 + b*P, summed
            per_image = encoder.image_costs(self.image_patches)
            bounds = np.concatenate([[0], np.cumsum(self.images)])
            self._item_cost = np.add.reduceat(np.append(per_image, 0.0), bounds[:-1]) * \
                (self.images > 0)
        return self._item_cost[at], images, patches

    @property
    def num_shards(self) -> int:
        """Listed shards, for the job model's deal (0: not dealt by shards)."""
        return int(self.shard_items.size) if self.by_shards else 0

    def shard_block(self, shard: int) -> Block:
        """A (virtual, pass-wide) shard's items: ids (shard, item, chunk), chunk 0 for a piece
        of a split document (which the planner may cut) and -1 for a whole one."""
        k = shard % self.shard_items.size
        at = slice(int(self.starts[k]), int(self.starts[k] + self.shard_items[k]))
        lengths, divisible = self.lengths[at], self.divisible[at]
        ids = np.stack([np.full(lengths.size, shard, np.int64),
                        np.arange(lengths.size, dtype=np.int64),
                        np.where(divisible, 0, -1)], axis=1)
        return Block(lengths, ids, divisible)

    def _block(self, items: np.ndarray) -> Block:
        """A block of the items with indices `items`: ids (0, index, -1)."""
        n = items.size
        ids = np.stack([np.zeros(n, np.int64), items, np.full(n, -1, np.int64)], axis=1)
        return Block.of(self.lengths[items], ids, self.divisible[items])

    def rank_items(self, pass_index: int, endless: bool = False) -> list[np.ndarray]:
        """Each rank's items (indices) in pass (epoch) `pass_index`, dealt round-robin; an
        endless source's passes rotate the deal, as the loader's do. Every rank asks for the
        same pass: the last one is kept."""
        if self._dealt[0] != (pass_index, endless):
            self._dealt = ((pass_index, endless), self._deal(pass_index, endless))
        return self._dealt[1]

    def _deal(self, pass_index: int, endless: bool) -> list[np.ndarray]:
        items = np.arange(self.lengths.size, dtype=np.int64)
        if pass_index > 0 and not self.sampled:
            items = items[np.random.default_rng([self.seed, pass_index, self.index])
                          .permutation(items.size)]
        return [deal(items, self.ranks, q, pass_index if endless else 0)
                for q in range(self.ranks)]

    def feed(self, job: JobModel, rank: int, endless: bool) -> Optional[Feed]:
        """Rank `rank`'s feed for the job's current epoch (an endless source: its whole
        stream)."""
        if not self.lengths.size:
            return None
        if self.by_shards:
            layout = job.layout_for(self.index, job.epoch)
            units = layout.stream(rank) if endless else layout.rank_units(rank)
            return layout_feed(units, self.shard_block)
        if self.sampled:   # this rank's items come round again
            first = self.rank_items(0)[rank]
            return (lambda _tokens: self._block(first)) if first.size else None
        passes = iter([job.epoch] if not endless else range(0, 2**62))
        return lambda _tokens: next((self._block(self.rank_items(p, endless)[rank])
                                     for p in passes), None)


def simulate(spec: LoaderSpec, lengths: Sequence[Union[SourceScan, np.ndarray]], steps: int,
             ranks: int = DEFAULT_RANKS) -> list[StepReport]:
    """Drive the loader's job model (`job.JobModel`: the `Stepper`, the deal, the epochs) for
    `steps` steps on `ranks` ranks, on item lengths only, over head windows kept by
    `plan.windows` (the loader's head-window rule).

    `lengths`: per source, a `SourceScan` (from `scan`: shards are dealt to ranks like the
    loader deals them) or an array of item lengths in 1..C (dealt round-robin). Returns one
    report per planned step; fewer than `steps` when the data ends (`epochs`, or a source with
    on_exhausted="stop")."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ConfigError(f"steps: must be >= 0, got {steps!r}", key="steps")
    if isinstance(ranks, bool) or not isinstance(ranks, (int, np.integer)) or ranks < 1:
        raise ConfigError(f"ranks: must be an integer >= 1, got {ranks!r}", key="ranks")
    S = len(spec.sources)
    if len(lengths) != S:
        raise ValueError(f"lengths for {len(lengths)} sources, the configuration has {S}")
    config = spec.config()
    C, R = config.micro_batch_tokens, ranks
    for s, data in enumerate(lengths):
        arr = data.lengths if isinstance(data, SourceScan) else np.asarray(data)
        if arr.size and arr.max() > C:
            raise ValueError(f"source {spec.sources[s].name!r}: item of {int(arr.max())} tokens "
                             f"> micro_batch_tokens ({C}); split long documents first")
    # No progress tracking: the dry run saves no state (the job model's tests do, on lengths).
    job = JobModel.build(config, spec.sources, spec.mixture, R, track=False)
    feeds = [_SourceFeed(data, s, config.seed, R) for s, data in enumerate(lengths)]
    job.listed([[""] * f.num_shards for f in feeds])
    endless = [job.endless(s) for s in range(S)]
    windows = Windows([[ItemQueue(feeds[s].feed(job, r, endless[s])) for s in range(S)]
                       for r in range(R)])
    # An image source: its items' encoder cost (image_cost="hybrid") and images / patches for
    # the caps per row, as the loader's runtime hands them to the planner.
    visual = any(f.images is not None for f in feeds)
    encoder = encoder_model(config)   # None under image_cost="backbone"
    measured = EncoderCost(config.encoder_cost_a, config.encoder_cost_b)   # reported either way
    attributes = (lambda s, ids: feeds[s].attributes(ids, encoder)) if visual else None
    # The ranks dealt items of a source: the queues know (a sampled source, an empty shard).
    job.start(windows.holding())
    mix_tracker = MixTracker(S)   # each step's configured target, tail, run-outs (as the loader)
    reports: list[StepReport] = []
    empty_epochs = 0
    while len(reports) < steps:
        offer = windows.offer(job.window_tokens(), attributes)
        c = offer.candidates
        step = job.begin(c, offer.exhausted)
        if step.outcome == "stop":
            break
        if step.outcome == "end_epoch":
            empty_epochs += 1
            if job.end_epoch() or empty_epochs > 1:   # an epoch without a step: no data
                break
            for s in range(S):
                if not endless[s]:   # `restart` sources go on where they are
                    for r in range(R):
                        windows.queues[r][s].next_epoch(feeds[s].feed(job, r, False))
            job.set_holding(windows.holding())
            continue
        empty_epochs = 0
        if len(c) == 0:
            break
        started = time.process_time()
        assignment = job.assign(step)
        plan_seconds = time.process_time() - started
        take = np.asarray(assignment.take, dtype=np.int64)
        mix_tracker.begin(job.stepper, step)
        units = job.commit(step, take, assignment.length, offer.ids)
        true_encoder = None
        if visual:   # each candidate's encoder cost, whether the planner saw it or not
            true_encoder = np.zeros(len(c))
            for s, feed in enumerate(feeds):
                mine = c.source == s
                true_encoder[mine] = feed.attributes(offer.ids[mine], measured)[0]
        reports.append(_report(step.index, job.epoch, c, step.quota, assignment, take, units,
                               job.stepper.geometry, S, job.stepper.cost,
                               mix_tracker.commit(job.stepper), true_encoder))
        reports[-1].plan_seconds = plan_seconds
        # Taken items leave their windows; the others age.
        delays, tokens = windows.commit(offer, take, assignment.length, step.index)
        reports[-1].delays = np.stack([delays, tokens]).astype(np.int64, copy=False)
    return reports


def _report(step, epoch, c: Candidates, quota, assignment, take, units, geometry: Geometry,
            S: int, cost: CostModel, mix: Optional[StepMix] = None,
            true_encoder: Optional[np.ndarray] = None) -> StepReport:
    lengths = assignment.length
    rows = np.bincount(np.asarray(assignment.rank, np.int64) * geometry.micro_batches +
                       assignment.row, weights=lengths, minlength=geometry.rows)
    if rows.size and rows.max() > geometry.capacity:   # as the loader's packing refuses it
        raise AssertionError(f"step {step}: row {int(np.argmax(rows))} holds {int(rows.max())} "
                             f"tokens > capacity {geometry.capacity}")
    cut = lengths < c.length[take]
    source = c.source[take]
    tokens = np.bincount(source, weights=lengths, minlength=S).astype(np.int64)
    samples = np.bincount(source, minlength=S).astype(np.int64)
    N = float(units.sum())
    share = units / N if N > 0 else np.zeros(S)
    st = quota.source_targets
    quota_share = st / st.sum() if st.sum() > 0 else np.zeros(S)
    Q = quota.quota_fractions.size
    if Q:
        bucket = quota.virtual_quota[quota.candidates.source[take]]
        hit = bucket >= 0
        w = lengths[hit].astype(np.float64) if quota.counts is None else None
        realized = np.bincount(bucket[hit], weights=w, minlength=Q)
        length_quota = realized / N if N > 0 else np.zeros(Q)
    else:
        length_quota = np.zeros(0)
    rank_cost = np.asarray(assignment.rank_cost, dtype=np.float64)

    def per_rank(values: np.ndarray) -> np.ndarray:
        return np.bincount(np.asarray(assignment.rank, np.int64), weights=values,
                           minlength=geometry.ranks)
    rank_tokens = np.bincount(np.asarray(assignment.rank, dtype=np.int64), weights=lengths,
                              minlength=geometry.ranks).astype(np.int64)
    mean = float(rank_cost.mean()) if rank_cost.size else 0.0
    imbalance = float(rank_cost.max() / mean) if mean > 0 else 1.0
    return StepReport(
        step=step, epoch=epoch, mix=mix, tokens=tokens, samples=samples, share=share,
        target_share=np.asarray(quota.shares, dtype=np.float64), quota_share=quota_share,
        length_quota=length_quota, length_quota_target=np.asarray(quota.quota_fractions),
        rank_cost=rank_cost, rank_tokens=rank_tokens, imbalance=imbalance,
        exchanged=exchanged_tokens(c, assignment),
        deferred=int(len(c) - take.size),
        max_age=int(c.age[take].max()) if take.size else 0,
        fill=float(lengths.sum()) / geometry.step_tokens, active=np.asarray(quota.active),
        cut_work=cost.cut_savings(c.length[take][cut], lengths[cut]),
        row_cost=assignment.row_cost,
        step_time=float(assignment.step_time.max(initial=0.0)),
        # the dry run has no sample-cost hooks: an item's extra cost is its encoder's
        encoder_cost=None if true_encoder is None else per_rank(true_encoder[take]),
        backbone_cost=None if true_encoder is None else rank_cost - per_rank(c.extra_cost[take]),
        row_visual=None if true_encoder is None else
        row_visual(c, take, assignment.rank, assignment.row, geometry))
