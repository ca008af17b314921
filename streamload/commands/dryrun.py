"""`streamload plan CONFIG.toml --steps N`: dry-run a configuration's plan without training.

It reads only lengths, then runs the loader's step loop on them: the mixture's quotas
(`QuotaMixer`), the planner (`Planner`) and the head windows, with no tokens, no buffers and no
process group. What it prints is what a job with that configuration would get: the realized mix
per step against the target, and the predicted cost balance across ranks.

    scans = scan(spec, max_docs=None)                 # per source: item lengths (I/O, once)
    lengths = scan_lengths(spec, max_docs=None)       # the same, just the arrays
    reports = simulate(spec, scans, steps=100, ranks=8)   # pure NumPy
    summary = summarize(spec, reports)

Reading lengths
    Token shards (`.tokens.npy`): the lengths come straight from each shard's `.offsets.npy`
    index (np.diff(offsets)); the token arrays are never read. JSONL: a fast length scan that
    decodes the records and measures each text with the configured tokenizer (UTF-8 bytes
    without one, like the loader). `max_docs` caps the documents read per source (a scan only
    reads as far as it needs); a source cut short this way is *sampled* (see below).
    Documents longer than `micro_batch_tokens` (C) become items exactly as the loader makes them
    (`long_documents`: split into chunks of C, the last shorter; truncate; drop), and empty
    documents are left out.

The simulated loop (the loader's `Runtime._step_loop`, on lengths)
    * Each source's items are dealt to R ranks like the loader deals them: the seeded
      permutation of its shards, strided by rank (`state.fresh_layout`), records in order. A
      sampled source deals its items round-robin over ranks instead and repeats them when a
      rank's share runs out, standing for a source much larger than the sample; plain arrays
      given to `simulate` are dealt round-robin too.
    * Every (rank, source) has a FIFO head window of `window_tokens` tokens, sized by
      `plan_memory` as the loader sizes it (about window_factor x share x M x C + C): the shortest
      prefix holding that many tokens, or everything left in the epoch.
    * Every step: the windows become `Candidates`; `QuotaMixer.quota` sets the quotas,
      `Planner.assign` selects and places items, `QuotaMixer.update` carries the deficits. Taken
      items leave their windows; the rest stay in order and age by one step.
    * When sources run out, `QuotaMixer.outcome` decides: the others go on, the epoch ends (the
      carried deficits reset, shards are dealt again, up to `epochs`), or a `stop` source ends
      the run. A `restart` source never runs out: each rank goes on with its share of the next
      pass (the deal rotated, `state.deal`), across epochs, as the loader does.
    Fetching is assumed to keep up (every window is full when the step is planned), so the dry
    run shows the plan, not I/O stalls.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np

from ..configfile import LoaderSpec, load_config
from ..errors import ConfigError, DataError, StorageError, StreamloadError
from ..formats.tokens import (_BadShard, _check_offsets, _offsets_what, _read_offsets,
                             offsets_uri)
from ..pipeline.autoscale import MemoryPlan
from ..pipeline.fetch import Shard, list_shards
from ..plan.cost import CostModel
from ..plan.quota_mixer import QuotaMixer
from ..plan.planner import Planner
from ..plan.types import Candidates, Geometry
from ..state import deal, deal_epoch
from ..storage import open_store
from ..tokenizer import TokenizerError

DEFAULT_RANKS = 8
DEFAULT_STEPS = 100
SCAN_CONCURRENCY = 8
SCAN_CHUNK_BYTES = 4 << 20


# -- reading lengths -------------------------------------------------------------------------------
@dataclass
class SourceScan:
    """One source's item lengths, as the loader would make its items."""
    name: str
    format: str                  # "tokens", "jsonl", or both joined by "+"
    method: str                  # "index" (offsets files), "scan" (decoded records), or both
    lengths: np.ndarray          # int64 item lengths: shard by shard, records in order
    shard_items: np.ndarray      # int64 [shards read]: items per shard (sums to lengths.size)
    shards: int = 0              # shards listed
    shards_read: int = 0
    documents: int = 0           # records read (including empty ones)
    empty: int = 0               # empty documents (left out, like the loader)
    split: int = 0               # documents longer than C split into chunks
    truncated: int = 0
    dropped: int = 0
    skipped: int = 0             # bad records or shards skipped (on_error="skip")
    complete: bool = True        # False: max_docs cut the scan short; the items are a sample
    divisible: Optional[np.ndarray] = None   # bool per item: a piece of a split document

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def to_dict(self) -> dict:
        return {"name": self.name, "format": self.format, "method": self.method,
                "shards": self.shards, "shards_read": self.shards_read,
                "documents": self.documents, "items": int(self.lengths.size),
                "tokens": self.tokens, "empty": self.empty, "split": self.split,
                "truncated": self.truncated, "dropped": self.dropped, "skipped": self.skipped,
                "sampled": not self.complete}


def items_from_documents(docs: np.ndarray, capacity: int, long_documents: str
                         ) -> tuple[np.ndarray, dict]:
    """Document lengths -> item lengths, as `pipeline.transform.records_to_items` makes items:
    empty documents are left out; longer than C: split into chunks of C (the last shorter),
    truncated to C, or dropped."""
    docs = np.asarray(docs, dtype=np.int64)
    long = docs > capacity
    counts = {"empty": int((docs == 0).sum()), "split": 0, "truncated": 0, "dropped": 0}
    docs = docs[docs > 0]
    if not long.any():
        return docs, counts
    long = docs > capacity
    if long_documents == "truncate":
        counts["truncated"] = int(long.sum())
        return np.minimum(docs, capacity), counts
    if long_documents == "drop":
        counts["dropped"] = int(long.sum())
        return docs[~long], counts
    counts["split"] = int(long.sum())
    pieces = -(-docs // capacity)
    out = np.full(int(pieces.sum()), capacity, dtype=np.int64)
    last = np.cumsum(pieces) - 1
    out[last] = docs - (pieces - 1) * capacity
    return out, counts


def divisible_items(docs: np.ndarray, capacity: int, long_documents: str) -> np.ndarray:
    """Which of `items_from_documents`'s items are pieces of a split document (the planner may
    cut those to fill a row, `plan/fill.py`)."""
    docs = np.asarray(docs, dtype=np.int64)
    docs = docs[docs > 0]
    if long_documents == "drop":
        docs = docs[docs <= capacity]
    if long_documents != "split":
        return np.zeros(docs.size, dtype=bool)
    return np.repeat(docs > capacity, np.maximum(-(-docs // capacity), 1))


def _store_options(spec: LoaderSpec, source) -> dict:
    """The storage options the loader's Runtime gives this source's store."""
    scheme = source.uri.split("://", 1)[0] if "://" in source.uri else "file"
    shared = (spec.storage_options or {}) if scheme != "file" else {}
    return {**shared, **(source.storage_options or {})}


class _Skips:
    def __init__(self):
        self.count = 0

    def __call__(self, record, reason) -> None:
        self.count += 1


async def _index_lengths(store, source, shard: Shard, skips: Optional[_Skips]) -> np.ndarray:
    """Document lengths of a token shard from its offsets index alone."""
    uri = offsets_uri(shard.info.uri)
    try:
        offsets = await _read_offsets(store, uri)
        _check_offsets(offsets, None, _offsets_what(uri))   # no token file: no end check
        lengths = np.diff(offsets)
    except _BadShard as exc:
        if skips is None:
            raise DataError(str(exc), source=source.name, shard=shard.name) from None
        skips(None, str(exc))
        return np.zeros(0, np.int64)
    return lengths.astype(np.int64)


async def _scan_lengths(store, source, shard: Shard, tokenizer, skips: Optional[_Skips],
                        limit: Optional[int]) -> np.ndarray:
    """Document lengths of a record shard: decode, measure; stops once `limit` records are
    read (it may return a few more: the rest of the last decoded range)."""
    out: list[int] = []

    def add(records) -> None:
        texts = [r for r in records if isinstance(r.payload, str)]
        ids = None
        if tokenizer is not None and texts:
            try:
                ids = iter(tokenizer.encode_texts([r.payload for r in texts]))
            except TokenizerError as exc:
                raise DataError(str(exc), source=source.name, shard=shard.name,
                                record=texts[exc.index].index) from None
        for r in records:
            payload = r.payload
            if isinstance(payload, str):
                out.append(len(payload.encode("utf-8")) if ids is None else int(np.size(next(ids))))
            else:
                out.append(int(np.size(payload)))

    stream = await shard.format.open(store, shard.info, source=source.name, shard_name=shard.name,
                                     on_skip=skips, chunk_bytes=SCAN_CHUNK_BYTES)
    for start, end in stream.ranges():
        add(stream.decode(await store.read_range(shard.info.uri, start, end)))
        if limit is not None and len(out) >= limit:
            return np.array(out, dtype=np.int64)
    add(stream.finish())
    return np.array(out, dtype=np.int64)


async def _scan_source(spec: LoaderSpec, index: int, tokenizer, max_docs: Optional[int],
                       capacity: int, long_documents: str, on_error: str, retry) -> SourceScan:
    source = spec.sources[index]
    store = open_store(source.uri, _store_options(spec, source) or None, retry=retry)
    skips = _Skips() if on_error == "skip" else None
    try:
        try:
            shards = await list_shards(source, store)
        except StorageError as exc:
            if repr(source.name) in str(exc):
                raise
            raise StorageError(f"source {source.name!r}: {exc}", uri=source.uri) from None
        per_shard: list[np.ndarray] = []
        methods, formats = set(), set()
        budget = max_docs
        slots = asyncio.Semaphore(SCAN_CONCURRENCY)

        async def read(shard: Shard, limit: Optional[int]) -> np.ndarray:
            async with slots:
                if shard.format.name == "tokens":
                    return await _index_lengths(store, source, shard, skips)
                # One record more than needed tells whether the cap cut the shard short.
                return await _scan_lengths(store, source, shard, tokenizer, skips,
                                           None if limit is None else limit + 1)

        # Shards in listing order, a wave at a time, until max_docs documents are read.
        at, cut = 0, False
        while at < len(shards) and not cut:
            wave = shards[at:at + SCAN_CONCURRENCY]
            at += len(wave)
            results = await asyncio.gather(*(read(s, budget) for s in wave))
            for shard, docs in zip(wave, results):
                if budget is not None:
                    if docs.size > budget:
                        docs, cut = docs[:budget], True
                    budget -= docs.size
                per_shard.append(docs)
                methods.add("index" if shard.format.name == "tokens" else "scan")
                formats.add(shard.format.name)
                if cut:
                    break
            if budget == 0 and at < len(shards):
                cut = True
        complete = not cut
    finally:
        await store.aclose()

    counts = {"empty": 0, "split": 0, "truncated": 0, "dropped": 0}
    items, shard_items, divisible = [], [], []
    for docs in per_shard:
        lengths, c = items_from_documents(docs, capacity, long_documents)
        items.append(lengths)
        divisible.append(divisible_items(docs, capacity, long_documents))
        shard_items.append(lengths.size)
        for k, v in c.items():
            counts[k] += v
    return SourceScan(
        name=source.name, format="+".join(sorted(formats)) or "-",
        method="+".join(m for m in ("index", "scan") if m in methods) or "-",
        lengths=np.concatenate(items) if items else np.zeros(0, np.int64),
        shard_items=np.array(shard_items, dtype=np.int64), shards=len(shards),
        shards_read=len(per_shard), documents=int(sum(d.size for d in per_shard)),
        skipped=skips.count if skips else 0, complete=complete,
        divisible=np.concatenate(divisible) if divisible else np.zeros(0, bool), **counts)


def scan(spec: LoaderSpec, max_docs: Optional[int] = None) -> list[SourceScan]:
    """Every source's item lengths (see the module docstring). Reads offsets indexes for token
    shards and decodes JSONL records; `max_docs` caps the documents read per source."""
    if max_docs is not None and max_docs < 1:
        raise ConfigError(f"max_docs: must be an integer >= 1, got {max_docs!r}")
    config = spec.config()
    tokenizer = spec.load_tokenizer()

    async def all_sources():
        return await asyncio.gather(*(
            _scan_source(spec, s, tokenizer, max_docs, config.micro_batch_tokens,
                         config.long_documents, config.on_error, config.retry)
            for s in range(len(spec.sources))))

    return list(asyncio.run(all_sources()))


def scan_lengths(spec: LoaderSpec, max_docs: Optional[int] = None) -> list[np.ndarray]:
    """Per source, item lengths (int64): shard by shard in listing order, records in order."""
    return [s.lengths for s in scan(spec, max_docs)]


# -- the simulated step loop ------------------------------------------------------------------------
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
                "length_quota": [round(float(v), 6) for v in self.length_quota],
                "length_quota_target": [round(float(v), 6) for v in self.length_quota_target],
                "rank_cost": [float(c) for c in self.rank_cost],
                "rank_tokens": [int(t) for t in self.rank_tokens],
                "imbalance": round(self.imbalance, 6), "deferred": self.deferred,
                "max_age": self.max_age, "fill": round(self.fill, 6)}


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
               taken_lengths: Optional[np.ndarray] = None) -> None:
        """Remove the taken window positions (`taken_lengths`: tokens taken of each; an item
        cut short keeps its rest in place); the rest of the window ages one step."""
        keep = np.ones(lengths.size, dtype=bool)
        keep[taken] = False
        lengths = np.asarray(lengths, dtype=np.int64).copy()
        if taken_lengths is not None:
            cut = np.asarray(taken_lengths) < lengths[taken]
            lengths[taken[cut]] -= np.asarray(taken_lengths)[cut]
            keep[taken[cut]] = True
        codes = lengths * 2 + self.divisible
        self.head = np.concatenate([codes[keep], self.head[self.offered:]])
        self.head_age = np.concatenate([ages[keep] + 1, self.head_age[self.offered:]])
        self.ptr += self.fresh
        self.offered = self.fresh = 0

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


def _memory_plan(spec: LoaderSpec, config, mixer: QuotaMixer, ranks: int) -> MemoryPlan:
    return MemoryPlan(config, mixer.max_shares(), [s.name for s in spec.sources], ranks)


def _window_tokens(memory: MemoryPlan, mixer: QuotaMixer, holding: np.ndarray) -> np.ndarray:
    """[R, S] head windows, as the loader's Runtime sizes them (`MemoryPlan.for_rank`): ranks
    holding the same sources get the same windows, so each distinct row is sized once."""
    shares = mixer.shares_at(holding.any(axis=0))
    holders = holding.sum(axis=0)
    rows, inverse = np.unique(holding, axis=0, return_inverse=True)
    sized = np.array([[b.window_tokens for b in memory.budgets(shares, holders, held)]
                      for held in rows], dtype=np.int64)
    return sized[np.asarray(inverse).reshape(-1)]


def simulate(spec: LoaderSpec, lengths: Sequence[Union[SourceScan, np.ndarray]], steps: int,
             ranks: int = DEFAULT_RANKS) -> list[StepReport]:
    """Run the loader's planning loop for `steps` steps on `ranks` ranks, on item lengths only.

    `lengths`: per source, a `SourceScan` (from `scan`: shards are dealt to ranks like the
    loader deals them) or an array of item lengths in 1..C (dealt round-robin). Returns one
    report per planned step; fewer than `steps` when the data ends (`epochs`, or a source with
    on_exhausted="stop")."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ConfigError(f"steps: must be >= 0, got {steps!r}")
    if isinstance(ranks, bool) or not isinstance(ranks, (int, np.integer)) or ranks < 1:
        raise ConfigError(f"ranks: must be an integer >= 1, got {ranks!r}")
    S = len(spec.sources)
    if len(lengths) != S:
        raise ValueError(f"lengths for {len(lengths)} sources, the configuration has {S}")
    config = spec.config()
    C, M, R = config.micro_batch_tokens, config.micro_batches, ranks
    for s, data in enumerate(lengths):
        arr = data.lengths if isinstance(data, SourceScan) else np.asarray(data)
        if arr.size and arr.max() > C:
            raise ValueError(f"source {spec.sources[s].name!r}: item of {int(arr.max())} tokens "
                             f"> micro_batch_tokens ({C}); split long documents first")
    geometry = Geometry(R, M, C)
    cost = CostModel(config.cost_a, config.cost_b, config.document_masking)
    planner = Planner(geometry, cost, method=config.planner, seed=config.seed,
                      max_age=config.max_deferral, lookahead=config.lookahead,
                      step_overhead=config.step_overhead)
    mixer = QuotaMixer.from_sources(spec.mixture, spec.sources, capacity=C)
    memory = _memory_plan(spec, config, mixer, R)
    feeds = [_SourceFeed(data, s, config.seed, R) for s, data in enumerate(lengths)]
    passes = [0] * S
    windows = [[None] * S for _ in range(R)]   # windows[rank][source]
    restartable = [p == "restart" for p in mixer.on_exhausted]
    for s, feed in enumerate(feeds):
        for r in range(R):
            windows[r][s] = feed.window(r, restartable[s])

    def holding_now() -> np.ndarray:   # an epoch's start: the ranks dealt items of a source
        return np.array([[windows[r][s].has_items for s in range(S)] for r in range(R)],
                        dtype=bool).reshape(R, S)

    window_tokens = _window_tokens(memory, mixer, holding_now())

    reports: list[StepReport] = []
    epoch, step = 0, 0
    step_tokens = geometry.step_tokens
    empty_epochs = 0
    while step < steps:
        views = [[windows[r][s].window(window_tokens[r, s]) for s in range(S)] for r in range(R)]
        has_data = np.array([any(views[r][s][0].size for r in range(R)) for s in range(S)])
        exhausted = np.array([[views[r][s][2] for s in range(S)] for r in range(R)])
        outcome = mixer.outcome(has_data, exhausted)
        if outcome == "stop":
            break
        if outcome == "end_epoch":
            epoch += 1
            if config.epochs is not None and epoch >= config.epochs:
                break
            empty_epochs += 1
            if empty_epochs > 1:   # an epoch without a single step: there is no data
                break
            mixer.new_epoch()
            for s in range(S):
                if not restartable[s]:   # `restart` sources go on where they are
                    passes[s] += 1
                    for r, items in enumerate(feeds[s].rank_items(passes[s])):
                        windows[r][s].restart(items)
            window_tokens = _window_tokens(memory, mixer, holding_now())
            continue
        empty_epochs = 0

        win_lengths = [[views[r][s][0] for s in range(S)] for r in range(R)]
        win_ages = [[views[r][s][1] for s in range(S)] for r in range(R)]
        c = Candidates.from_windows(win_lengths, win_ages, None,
                                    [[windows[r][s].divisible for s in range(S)] for r in range(R)])
        if len(c) == 0:
            break
        quota = mixer.quota(c, step_tokens, step)
        assignment = planner.assign_quota(quota, step)
        take = np.asarray(assignment.take, dtype=np.int64)
        units = mixer.update(quota, take, assignment.length)
        whole = assignment.length == c.length[take]   # a cut item's rest stays
        window_tokens = _window_tokens(memory, mixer,
                                       MemoryPlan.holding_after(c, take[whole], exhausted))
        reports.append(_report(step, epoch, c, quota, assignment, take, units, geometry, S))

        # Taken items leave their windows; the others age. Candidates are (source, rank, pos).
        taken = np.zeros(len(c), dtype=np.int64)   # tokens taken of each candidate
        taken[take] = assignment.length
        at = 0
        for s in range(S):
            for r in range(R):
                n = win_lengths[r][s].size
                positions = np.flatnonzero(taken[at:at + n])
                windows[r][s].commit(positions, win_lengths[r][s], win_ages[r][s],
                                     taken[at:at + n][positions])
                at += n
        step += 1
    return reports


def _report(step, epoch, c: Candidates, quota, assignment, take, units, geometry: Geometry,
            S: int) -> StepReport:
    lengths = assignment.length
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
        step=step, epoch=epoch, tokens=tokens, samples=samples, share=share,
        target_share=np.asarray(quota.shares, dtype=np.float64), quota_share=quota_share,
        length_quota=length_quota, length_quota_target=np.asarray(quota.quota_fractions),
        rank_cost=rank_cost, rank_tokens=rank_tokens, imbalance=imbalance,
        deferred=int(len(c) - take.size),
        max_age=int(c.age[take].max()) if take.size else 0,
        fill=float(lengths.sum()) / geometry.step_tokens, active=np.asarray(quota.active))


def summarize(spec: LoaderSpec, reports: Sequence[StepReport]) -> dict:
    """The run in numbers: balance (imbalance mean / max), the mix over the run against the
    target (per source, and the largest |difference| over the run and in any one step),
    deferrals and fill."""
    names = [s.name for s in spec.sources]
    S = len(names)
    out: dict = {"steps": len(reports)}
    if not reports:
        return {**out, "imbalance_mean": None, "imbalance_max": None, "mix_max_abs_dev": None,
                "mix_step_max_abs_dev": None, "max_deferral": None, "fill_mean": None,
                "sources": {n: {} for n in names}}
    share = np.array([r.share for r in reports]).reshape(-1, S)
    totals = np.array([r.units for r in reports])      # 1 per step with data, 0 when empty
    # Realized and target shares over the run, weighting each step by what it delivered.
    unit_totals = np.array([(r.tokens if spec.mixture.by == "tokens" else r.samples).sum()
                            for r in reports], dtype=np.float64)
    realized = (share * unit_totals[:, None]).sum(axis=0)
    target = np.array([r.target_share for r in reports]).reshape(-1, S)
    wanted = (target * unit_totals[:, None]).sum(axis=0)
    N = float(unit_totals.sum())
    run_share = realized / N if N > 0 else np.zeros(S)
    run_target = wanted / N if N > 0 else np.zeros(S)
    step_dev = np.abs(share - target)[totals > 0]
    imbalance = np.array([r.imbalance for r in reports])
    out.update({
        "imbalance_mean": float(imbalance.mean()), "imbalance_max": float(imbalance.max()),
        "max_rank_cost": float(max(r.rank_cost.max() for r in reports)),
        "mix_max_abs_dev": float(np.abs(run_share - run_target).max()),
        "mix_step_max_abs_dev": float(step_dev.max()) if step_dev.size else 0.0,
        "max_deferral": int(max(r.max_age for r in reports)),
        "deferred_mean": float(np.mean([r.deferred for r in reports])),
        "fill_mean": float(np.mean([r.fill for r in reports])),
        "epochs": int(reports[-1].epoch) + 1,
        "tokens": int(sum(int(r.tokens.sum()) for r in reports)),
        "sources": {n: {"share": float(run_share[s]), "target": float(run_target[s]),
                        "tokens": int(sum(int(r.tokens[s]) for r in reports)),
                        "samples": int(sum(int(r.samples[s]) for r in reports))}
                    for s, n in enumerate(names)},
    })
    if spec.mixture.quotas:
        lq = np.array([r.length_quota for r in reports])
        lt = np.array([r.length_quota_target for r in reports])
        out["length_quotas"] = [
            {"quota": q.describe(), "fraction": q.fraction,
             "share": float((lq[:, i] * unit_totals).sum() / N) if N > 0 else 0.0,
             "target": float((lt[:, i] * unit_totals).sum() / N) if N > 0 else 0.0,
             "min_step_share": float(lq[:, i].min())}
            for i, q in enumerate(spec.mixture.quotas)]
    return out


# -- the command ----------------------------------------------------------------------------------
def format_table(spec: LoaderSpec, reports: Sequence[StepReport], every: int = 1) -> list[str]:
    names = [s.name for s in spec.sources]
    width = max(11, *(len(n) for n in names))
    unit = "tokens" if spec.mixture.by == "tokens" else "samples"
    lines = [f"realized/target share of {unit} per source; imbalance = max/mean rank cost",
             f"{'step':>6} " + " ".join(f"{n:>{width}}" for n in names)
             + f" {'imbalance':>9} {'max cost':>10} {'fill':>6} {'defer':>5} {'age':>3}"]
    for i, r in enumerate(reports):
        if i % max(every, 1) and i != len(reports) - 1:
            continue
        mix = " ".join(f"{f'{a:.3f}/{t:.3f}':>{width}}" for a, t in zip(r.share, r.target_share))
        lines.append(f"{r.step:>6} {mix} {r.imbalance:>9.3f} {r.rank_cost.max():>10.4g} "
                     f"{r.fill:>6.3f} {r.deferred:>5} {r.max_age:>3}")
    return lines


def format_summary(summary: dict) -> list[str]:
    if not summary["steps"]:
        return ["no steps planned: the sources hold no data"]
    lines = [f"{summary['steps']} steps, {summary['tokens']:,} tokens, "
             f"{summary['epochs']} epoch(s)",
             f"imbalance: mean {summary['imbalance_mean']:.4f}, max "
             f"{summary['imbalance_max']:.4f} (max rank cost {summary['max_rank_cost']:.4g})",
             f"mix over the run: max |realized - target| {summary['mix_max_abs_dev']:.4f} "
             f"(worst single step {summary['mix_step_max_abs_dev']:.4f})"]
    for name, s in summary["sources"].items():
        lines.append(f"  {name}: {s['share']:.4f} realized vs {s['target']:.4f} target, "
                     f"{s['tokens']:,} tokens, {s['samples']:,} items")
    for q in summary.get("length_quotas", []):
        lines.append(f"  quota {q['quota']}: {q['share']:.4f} of the run (at least "
                     f"{q['fraction']:g}; lowest step {q['min_step_share']:.4f})")
    lines.append(f"deferral: max {summary['max_deferral']} step(s), "
                 f"{summary['deferred_mean']:.1f} items deferred per step; "
                 f"fill {summary['fill_mean']:.4f}")
    return lines


def run(args: argparse.Namespace) -> int:
    def fail(message: str, code: int) -> int:
        print(f"streamload plan: {message}", file=sys.stderr)
        return code

    for name in ("steps", "ranks", "max_docs", "every"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "steps" else 1):
            return fail(f"--{name.replace('_', '-')}: must be >= "
                        f"{0 if name == 'steps' else 1}, got {value}", 2)
    try:
        spec = load_config(args.config)
        config = spec.config()
        mixer = QuotaMixer.from_sources(spec.mixture, spec.sources,
                                        capacity=config.micro_batch_tokens)
        _memory_plan(spec, config, mixer, args.ranks)   # memory_budget problems too
    except ConfigError as exc:
        return fail(str(exc), 2)
    try:
        scans = scan(spec, args.max_docs)
        reports = simulate(spec, scans, args.steps, args.ranks)
    except ConfigError as exc:
        return fail(str(exc), 2)
    except StreamloadError as exc:
        return fail(str(exc), 1)
    summary = summarize(spec, reports)
    names = [s.name for s in spec.sources]
    head = {"config": spec.path, "ranks": args.ranks, "micro_batches": config.micro_batches,
            "micro_batch_tokens": config.micro_batch_tokens, "planner": config.planner,
            "by": spec.mixture.by, "scans": [s.to_dict() for s in scans]}
    if args.json:
        print(json.dumps({"summary": {**head, **summary},
                          "steps": [r.to_dict(names) for r in reports]}))
        return 0
    C, M, R = config.micro_batch_tokens, config.micro_batches, args.ranks
    print(f"plan {spec.path}: R={R} ranks x M={M} rows x C={C:,} tokens = "
          f"{R * M * C:,} tokens per step, planner {config.planner}")
    for s in scans:
        note = f" (sampled: first {s.documents:,} documents, repeated)" if not s.complete else ""
        long = ", ".join(f"{v:,} {k}" for k, v in (("split", s.split), ("truncated", s.truncated),
                                                   ("dropped", s.dropped)) if v)
        print(f"  {s.name}: {s.format} by {s.method}, {s.shards_read}/{s.shards} shards, "
              f"{s.documents:,} docs -> {s.lengths.size:,} items, {s.tokens:,} tokens"
              + (f" ({long} long documents)" if long else "")
              + (f", {s.skipped} skipped" if s.skipped else "") + note)
    print()
    for line in format_table(spec, reports, args.every):
        print(line)
    print()
    for line in format_summary(summary):
        print(line)
    print(json.dumps({"summary": {**head, **summary}}))
    return 0
