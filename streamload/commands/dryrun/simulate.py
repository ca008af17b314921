"""The dry run's step loop: the loader's planning, on item lengths."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np

from ...configfile import LoaderSpec
from ...errors import ConfigError
from ...mixreport import MixTracker, StepMix
from ...plan.cost import CostModel
from ...plan.stepper import Stepper
from ...plan.types import Candidates, Geometry
from ...state import deal, deal_epoch

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
    waited: int = 0             # taken items that had been deferred (a later item of their
                                # window was taken before them) ...
    waited_steps: int = 0       # ... and the steps since then, summed (their delays)
    delay_max: int = 0          # the longest of those delays
    waited_token_steps: int = 0  # their delays weighted by their tokens
    plan_seconds: float = 0.0   # CPU time of the planner (`Stepper.assign`) for this step
    mix: Optional[StepMix] = None   # the configured target, the tail, run-outs (`mixreport`)

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
                "waited_steps": self.waited_steps, "delay_max": self.delay_max, "plan_ms": round(1e3 * self.plan_seconds, 3)}


class _Window:
    """One (rank, source) buffer: items deferred at its head (with their ages), then the rank's
    feed of items not yet offered.

    Items are kept *coded*, `length * 2 + divisible` (a piece of a split document, which the
    planner may cut: its rest stays at the head, as in `SourceBuffer.take`)."""

    def __init__(self, feed: np.ndarray, next_pass: Optional[Callable[[], np.ndarray]] = None,
                 coded: bool = False):
        """`next_pass`: where the items after `feed` come from, for a stream without end (a
        sampled source's items again, an endless source's next pass); None: it ends. Both give
        coded items when `coded`, else plain lengths (nothing divisible)."""
        self.head = np.zeros(0, np.int64)
        self.head_age = np.zeros(0, np.int64)
        # The step from which each head item was deferred: a later item of this window was
        # taken while it stayed (-1: never). Its delay, when taken, counts from there.
        self.head_skipped = np.zeros(0, np.int64)
        self.coded = coded
        self.next_pass = next_pass if (coded or next_pass is None) else (lambda: 2 * next_pass())
        self._set_feed(feed if coded else 2 * np.asarray(feed, dtype=np.int64))
        self.offered = 0            # head items in this step's window
        self.fresh = 0              # feed items in this step's window
        self.divisible = np.zeros(0, bool)   # of this step's window

    def _set_feed(self, feed: np.ndarray) -> None:
        self.feed = feed
        self.ptr = 0
        self.prefix = np.concatenate([[0], np.cumsum(feed >> 1)])   # tokens in feed[:j]

    def restart(self, feed: np.ndarray) -> None:
        """The next pass (epoch) of this rank's items, after what is still at the head."""
        self._set_feed(feed if self.coded else 2 * np.asarray(feed, dtype=np.int64))

    def window(self, tokens: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """The shortest prefix holding >= `tokens` tokens, or all that is left: (lengths, ages,
        done). `done`: the window holds the rest of the pass (SourceBuffer.window). Which
        items are divisible: `self.divisible`."""
        head_lengths = self.head >> 1
        head_before = np.cumsum(head_lengths) - head_lengths
        n_head = int(np.searchsorted(head_before, tokens, side="left"))
        fresh = 0
        if n_head == self.head.size:
            need = tokens - int(head_lengths.sum())
            while True:
                stop = int(np.searchsorted(self.prefix[:-1], need + self.prefix[self.ptr],
                                           side="left"))
                fresh = max(stop - self.ptr, 0) if need > 0 else 0
                if not (self.next_pass and need > 0 and self.ptr + fresh >= self.feed.size):
                    break
                self._set_feed(np.concatenate([self.feed[self.ptr:], self.next_pass()]))
        self.offered, self.fresh = n_head, fresh
        codes = np.concatenate([self.head[:n_head], self.feed[self.ptr:self.ptr + fresh]])
        lengths, self.divisible = codes >> 1, (codes & 1).astype(bool)
        ages = np.concatenate([self.head_age[:n_head], np.zeros(fresh, np.int64)])
        done = (self.next_pass is None and n_head == self.head.size
                and self.ptr + fresh >= self.feed.size and int(lengths.sum()) < tokens)
        return lengths, ages, done

    def commit(self, taken: np.ndarray, lengths: np.ndarray, ages: np.ndarray,
               taken_lengths: Optional[np.ndarray] = None, step: int = 0) -> np.ndarray:
        """Remove the taken window positions (`taken_lengths`: tokens taken of each; an item
        cut short keeps its rest in place); the rest of the window ages one step. Returns
        [2, n]: the delays of the taken items that had been deferred (steps since a later item
        of this window went ahead of them) and their tokens."""
        keep = np.ones(lengths.size, dtype=bool)
        keep[taken] = False
        skipped = np.concatenate([self.head_skipped[:self.offered],
                                  np.full(lengths.size - self.offered, -1, np.int64)])
        whole = np.asarray(taken)[np.asarray(taken_lengths) >= lengths[taken]] \
            if taken_lengths is not None else np.asarray(taken)
        late = whole[skipped[whole] >= 0]
        delays = np.stack([step - skipped[late], np.asarray(lengths, np.int64)[late]])
        if whole.size:   # a later item went ahead of what stays before it
            overtaken = keep & (np.arange(lengths.size) < int(whole.max())) & (skipped < 0)
            skipped[overtaken] = step
        lengths = np.asarray(lengths, dtype=np.int64).copy()
        if taken_lengths is not None:
            cut = np.asarray(taken_lengths) < lengths[taken]
            lengths[taken[cut]] -= np.asarray(taken_lengths)[cut]
            keep[taken[cut]] = True
        codes = lengths * 2 + self.divisible
        self.head = np.concatenate([codes[keep], self.head[self.offered:]])
        self.head_age = np.concatenate([ages[keep] + 1, self.head_age[self.offered:]])
        self.head_skipped = np.concatenate([skipped[keep], self.head_skipped[self.offered:]])
        self.ptr += self.fresh
        self.offered = self.fresh = 0
        return delays

    @property
    def has_items(self) -> bool:
        return self.head.size > 0 or self.ptr < self.feed.size or self.next_pass is not None


class _SourceFeed:
    """How one source's items are dealt to ranks, pass by pass, as coded items (`_Window`)."""

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
        self.codes = 2 * self.lengths + (0 if divisible is None else
                                         np.asarray(divisible, dtype=np.int64))
        self.by_shards = self.shard_items is not None and not self.sampled
        if self.by_shards:
            self.starts = np.cumsum(self.shard_items) - self.shard_items

    def rank_items(self, pass_index: int, endless: bool = False) -> list[np.ndarray]:
        """Each rank's items in pass (epoch) `pass_index`; an endless source's passes rotate the
        deal, as the loader's do."""
        R, offset = self.ranks, pass_index if endless else 0
        if self.by_shards:   # the loader's own deal (`state.deal_epoch`)
            n = self.shard_items.size
            out = []
            for shards in deal_epoch(n, seed=self.seed, epoch=pass_index, source_index=self.index,
                                     world=R, endless=endless, rotation=self.index % R):
                parts = [self.codes[self.starts[k]:self.starts[k] + self.shard_items[k]]
                         for k in shards % n]
                out.append(np.concatenate(parts) if parts else np.zeros(0, np.int64))
            return out
        items = self.codes
        if pass_index > 0 and not self.sampled:
            items = items[np.random.default_rng([self.seed, pass_index, self.index])
                          .permutation(items.size)]
        return [deal(items, R, q, offset) for q in range(R)]

    def window(self, rank: int, endless: bool) -> "_Window":
        """Rank `rank`'s first window: a sampled source cycles through its items, an endless
        one goes on pass after pass (each rank at its own pace, as in the loader)."""
        first = self.rank_items(0, endless)[rank]
        if not self.lengths.size:
            return _Window(first, coded=True)
        if self.sampled:   # this rank's items come round again
            return _Window(first, (lambda: first) if first.size else None, coded=True)
        if endless:
            passes = iter(range(1, 2**62))
            return _Window(first, lambda: self.rank_items(next(passes), True)[rank], coded=True)
        return _Window(first, coded=True)


def simulate(spec: LoaderSpec, lengths: Sequence[Union[SourceScan, np.ndarray]], steps: int,
             ranks: int = DEFAULT_RANKS) -> list[StepReport]:
    """Run the loader's step machine (`plan.stepper.Stepper`) for `steps` steps on `ranks`
    ranks, on item lengths only.

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
    stepper = Stepper.build(config, spec.sources, spec.mixture, R)
    restartable = [p == "restart" for p in stepper.mixer.on_exhausted]
    feeds = [_SourceFeed(data, s, config.seed, R) for s, data in enumerate(lengths)]
    windows = [[feeds[s].window(r, restartable[s]) for s in range(S)] for r in range(R)]

    def holding_now() -> np.ndarray:   # an epoch's start: the ranks dealt items of a source
        return np.array([[windows[r][s].has_items for s in range(S)] for r in range(R)],
                        dtype=bool).reshape(R, S)

    stepper.start_epoch(holding_now())
    mix_tracker = MixTracker(S)   # each step's configured target, tail, run-outs (as the loader)
    reports: list[StepReport] = []
    passes = [0] * S
    empty_epochs = 0
    while len(reports) < steps:
        window_tokens = stepper.window_tokens()
        views = [[windows[r][s].window(window_tokens[r, s]) for s in range(S)] for r in range(R)]
        exhausted = np.array([[views[r][s][2] for s in range(S)] for r in range(R)])
        c = Candidates.from_windows(
            [[views[r][s][0] for s in range(S)] for r in range(R)],
            [[views[r][s][1] for s in range(S)] for r in range(R)], None,
            [[windows[r][s].divisible for s in range(S)] for r in range(R)])
        step = stepper.begin(c, exhausted)
        if step.outcome == "stop":
            break
        if step.outcome == "end_epoch":
            stepper.end_epoch()
            empty_epochs += 1
            if stepper.finished or empty_epochs > 1:   # an epoch without a step: no data
                break
            for s in range(S):
                if not restartable[s]:   # `restart` sources go on where they are
                    passes[s] += 1
                    for r, items in enumerate(feeds[s].rank_items(passes[s])):
                        windows[r][s].restart(items)
            stepper.start_epoch(holding_now())
            continue
        empty_epochs = 0
        if len(c) == 0:
            break
        started = time.process_time()
        assignment = stepper.assign(step)
        plan_seconds = time.process_time() - started
        take = np.asarray(assignment.take, dtype=np.int64)
        mix_tracker.begin(stepper, step)
        units = stepper.commit(step, take, assignment.length)
        reports.append(_report(step.index, stepper.epoch, c, step.quota, assignment, take, units,
                               stepper.geometry, S, stepper.cost, mix_tracker.commit(stepper)))
        reports[-1].plan_seconds = plan_seconds
        # Taken items leave their windows; the others age.
        taken = np.zeros(len(c), dtype=np.int64)   # tokens taken of each candidate
        taken[take] = assignment.length
        delays = []
        for (s, r), window in c.windows():
            positions = np.flatnonzero(taken[window])
            delays.append(windows[r][s].commit(positions, c.length[window],
                                               c.age[window].astype(np.int64),
                                               taken[window][positions], step.index))
        delays, tokens = np.concatenate(delays, axis=1) if delays else np.zeros((2, 0), np.int64)
        report = reports[-1]
        report.waited, report.waited_steps = int(delays.size), int(delays.sum())
        report.waited_token_steps = int((delays * tokens).sum())
        report.delay_max = int(delays.max(initial=0))
    return reports


def _report(step, epoch, c: Candidates, quota, assignment, take, units, geometry: Geometry,
            S: int, cost: CostModel, mix: Optional[StepMix] = None) -> StepReport:
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
    rank_tokens = np.bincount(np.asarray(assignment.rank, dtype=np.int64), weights=lengths,
                              minlength=geometry.ranks).astype(np.int64)
    mean = float(rank_cost.mean()) if rank_cost.size else 0.0
    imbalance = float(rank_cost.max() / mean) if mean > 0 else 1.0
    return StepReport(
        step=step, epoch=epoch, mix=mix, tokens=tokens, samples=samples, share=share,
        target_share=np.asarray(quota.shares, dtype=np.float64), quota_share=quota_share,
        length_quota=length_quota, length_quota_target=np.asarray(quota.quota_fractions),
        rank_cost=rank_cost, rank_tokens=rank_tokens, imbalance=imbalance,
        deferred=int(len(c) - take.size),
        max_age=int(c.age[take].max()) if take.size else 0,
        fill=float(lengths.sum()) / geometry.step_tokens, active=np.asarray(quota.active),
        cut_work=cost.cut_savings(c.length[take][cut], lengths[cut]),
        row_cost=assignment.row_cost,
        step_time=float(assignment.step_time.max(initial=0.0)))
