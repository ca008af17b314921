"""The job model: one owner of everything that must evolve identically wherever the job is
planned (on rank 0 of the loader, in the dry run, in the benchmarks, in tests with no process
group). Pure: no I/O, no threads, no process group.

It holds the step machine (`plan/stepper.py`: the mixer's carries and schedule, step and epoch
counters, which ranks hold data of each source, the head windows' sizes), the epoch's deal of
every source's shards (`state.py`'s `EpochLayout`), each source's progress through it (which
items were delivered and which are pending, with their ages: `SourceTracker`), the epoch turns
and resumption, and turns it into the resumable `LoaderState`.

    job = JobModel.build(config, sources, mixture, world, states_in_flight, data)
    job.listed(shard_names)              # the sources' listings (the deal needs the counts)
    job.load(state)                      # optional: a saved state, checked by `check_resume`
    job.start()                          # the resume applied, the first epoch dealt
    job.window_tokens()                  # [R, S]: every rank's head window for the next step
    step = job.begin(candidates, exhausted)   # outcome and quota
    plan = job.assign(step)              # the planner
    job.commit(step, take, length, ids)  # what the step took: carries, holding, progress
    job.end_epoch()                      # after an "end_epoch" outcome; True: the run is done
    job.state(job.snapshot())            # the resumable state after the last commit

What drives it supplies the windows: the Runtime from buffers its fetchers fill, the dry run
and the benchmarks from lengths (`plan/windows.py`'s `ItemQueue`, fed from the same layouts
through `layout_feed`). The head-window rule is `plan.windows.head_window` in both.

What a step leaves behind for a later `state_dict()` is a `StepSnapshot`: immutable, one per
delivered batch.

Under control_plane="gather" only rank 0 keeps the job model; every other rank keeps its
`RankShare`: which sources it reads, its buffers before the first step (equal to
`JobModel.budgets(rank)`) and its own deal of the sources it reads, O(S) whatever R.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import msgspec
import numpy as np

from .config import LoaderConfig, Source
from .errors import ConfigError
from .plan.quota_mixer import MixtureState
from .plan.readers import choose_readers, reader_mask, reader_offsets
from .plan.stepper import Step, StepParts, Stepper
from .plan.types import Assignment, Candidates
from .plan.windows import Block, Feed, Offer, Windows
from .state import (STATE_VERSION, DataOptions, EpochLayout, LoaderState, RankProgress,
                    ReadUnit, SourceData, SourceTracker, dealt_again_holding, fresh_holders,
                    fresh_layout, layout_from_progress, redeals)
from .tokenizer import TextTokenizer, identity


@dataclass(frozen=True)
class StepSnapshot:
    """The job right after one step, for `state_dict()`: plain values, and each source's
    tracker with the (immutable) per-rank progress it had then."""
    epoch: int
    step: int
    mixture: MixtureState
    sources: tuple[tuple[SourceTracker, tuple[RankProgress, ...]], ...]
    holding: np.ndarray


def listing_crc(names: Sequence[str]) -> int:
    """A fingerprint of a source's listing, so ranks that listed different shards fail loudly."""
    return zlib.crc32("\n".join(names).encode())


def data_options(config: LoaderConfig, sources: Sequence[Source],
                 tokenizer: Optional[TextTokenizer]) -> DataOptions:
    """The options that decide which tokens the job delivers (`DataOptions`). `config`: the
    Runtime's, whose micro_batch_tokens is a row's (times cp)."""
    return DataOptions(
        micro_batch_tokens=config.micro_batch_tokens, long_documents=config.long_documents,
        tokenizer=identity(tokenizer),
        sources=tuple(SourceData(name=s.name, text_field=s.text_field, tokens_field=s.tokens_field,
                                 format=s.format, on_exhausted=s.on_exhausted, repeat=s.repeat,
                                 images=None if s.images is None
                                 else msgspec.json.encode(s.images).decode())
                      for s in sources))


def data_mismatches(saved: DataOptions, now: DataOptions) -> list[tuple[str, str]]:
    """(key, 'saved X, this loader has Y') for every option that differs. Sources are compared
    by name (a changed list of sources is `apply_resume`'s error); an unknown tokenizer on
    either side is not compared."""
    out = []
    for key in ("micro_batch_tokens", "long_documents", "tokenizer"):
        old, new = getattr(saved, key), getattr(now, key)
        if old != new and not (key == "tokenizer" and None in (old, new)):
            out.append((key, f"{key}: saved with {old!r}, this loader has {new!r}"))
    current = {s.name: s for s in now.sources}
    for old in saved.sources:
        new = current.get(old.name)
        for key in () if new is None else ("text_field", "tokens_field", "format",
                                           "on_exhausted", "repeat"):
            if getattr(old, key) != getattr(new, key):
                out.append((key, f"source {old.name!r} {key}: saved with {getattr(old, key)!r}, "
                                 f"this loader has {getattr(new, key)!r}"))
        if new is not None:
            out += image_mismatches(old.name, old.images, new.images)
    return out


# An image source's options that do not decide its items: the memory budget's estimate only.
_IMAGE_OPTIONS_NOT_DATA = ("encoded_bytes_per_token",)


def image_mismatches(name: str, saved: Optional[str], now: Optional[str]
                     ) -> list[tuple[str, str]]:
    """An image source's options (`SourceData.images`, JSON) compared field by field: the
    resizing rule (resize, size, patch_size, merge_size, temporal_patch_size, min/max_pixels)
    decides every sample's tokens, the ids, placeholder and fields the tokens themselves, and
    max_images / max_source_pixels which samples are refused. Keys `images.<field>`."""
    if saved == now:
        return []
    if saved is None or now is None:
        return [("images", f"source {name!r} images: saved with {_rule(saved)}, this loader "
                           f"has {_rule(now)}")]
    old, new = msgspec.json.decode(saved), msgspec.json.decode(now)
    out = []
    for key in sorted(set(old) | set(new)):
        if key not in _IMAGE_OPTIONS_NOT_DATA and old.get(key) != new.get(key):
            out.append((f"images.{key}", f"source {name!r} images.{key}: saved with "
                                         f"{old.get(key)!r}, this loader has {new.get(key)!r}"))
    return out


def _rule(images: Optional[str]) -> str:
    return "no images (a text source)" if images is None else f"images {images}"


def check_resume(state: LoaderState, seed: int, data: DataOptions) -> None:
    """Refuse a saved state that this job would resume into other data: another seed, or
    other `DataOptions`; one ConfigError names every mismatch (its key: the first one's). The
    shards are checked once listed (`JobModel.start`)."""
    problems = []
    if state.seed != seed:
        problems.append(("seed", f"seed: saved with {state.seed}, this loader has {seed}"))
    problems += data_mismatches(state.data, data)
    if problems:
        raise ConfigError(
            "loader state: resuming would deliver other data than the saved run did (samples "
            "twice, or never): " + "; ".join(p for _, p in problems)
            + ". Resume with the saved values, or start without the state", key=problems[0][0])


class _Deal:
    """What the job model and a rank's share of it (`RankShare`) both know: the sources'
    listings, which ranks read each source, a loaded state and its checks, and the layouts."""

    def __init__(self, parts, sources: Sequence[Source], seed: int, world: int, data):
        self.sources, self.seed, self.world = list(sources), seed, world
        self._data = data
        self.num_shards = [0] * len(self.sources)   # listed shards per source (`listed`)
        self.listing_crcs = [0] * len(self.sources)
        self.resume: Optional[LoaderState] = None       # `load`; kept for `state` until a step
        self.resume_ages: list[dict] = [{} for _ in self.sources]   # (shard, record, chunk) -> age
        self._fresh: dict[tuple[int, int], EpochLayout] = {}   # (source, epoch): fresh deals
        # Which ranks read each source (`plan/readers.py`), once listed: how many and the first
        # one. Every rank until then.
        S = len(self.sources)
        self.readers = np.full(S, world, dtype=np.int64)
        self.offsets = reader_offsets(self.readers, world)
        self._parts = parts   # the mixer (its largest shares choose the readers)

    # -- listing -----------------------------------------------------------------------------------
    def listed(self, shard_names: Sequence[Sequence[str]]) -> None:
        self.num_shards = [len(names) for names in shard_names]
        self.listing_crcs = [listing_crc(names) for names in shard_names]
        S = len(self.sources)
        self.readers = choose_readers(
            self._parts.mixer.max_shares(), [self.virtual_shards(s) for s in range(S)],
            self.world, [getattr(src, "read_cost", 1.0) for src in self.sources],
            [getattr(src, "readers", None) for src in self.sources])
        self.offsets = reader_offsets(self.readers, self.world)

    def endless(self, source: int) -> bool:
        """A source with on_exhausted="restart": one stream of passes, across epochs."""
        return self.sources[source].on_exhausted == "restart"

    def virtual_shards(self, source: int) -> int:
        """Shards per epoch: each listed shard once per pass (`Source.repeat`)."""
        return self.num_shards[source] * self.sources[source].repeat

    def units_on(self, source: int, rank: int) -> int:
        """How many read units `rank` has of `source` this epoch (for the start-up log)."""
        if not self.reads_source(rank, source):
            return 0
        return len(self.layout_for(source, self.epoch).rank_units(rank))

    @property
    def data(self) -> DataOptions:
        if callable(self._data):
            self._data = self._data()
        return self._data

    # -- resumption --------------------------------------------------------------------------------
    def load(self, state: LoaderState) -> None:
        """Take a saved state, checked already (`check_resume`)."""
        self.resume = state

    def resumed(self) -> bool:
        return self.resume is not None and bool(self.resume.sources)

    def _check_listing(self, state: LoaderState, reads: Optional[np.ndarray] = None) -> None:
        """A loaded state's sources against this job's: names, shard counts and listings; then
        its pending items' ages (of the sources in `reads` only, when given)."""
        names = [s.name for s in self.sources]
        if [p.name for p in state.sources] != names:
            raise ConfigError(f"loader state: saved for sources {[p.name for p in state.sources]}, "
                              f"but this loader has {names}", key="sources")
        for s, progress in enumerate(state.sources):
            if (progress.num_shards, progress.listing_crc) != (self.virtual_shards(s),
                                                               self.listing_crcs[s]):
                raise ConfigError(
                    f"loader state: source {progress.name!r} ({self.sources[s].uri}) has "
                    f"{self.virtual_shards(s)} shards now (times repeat) but "
                    f"{progress.num_shards} when the state was saved (or their names changed); "
                    f"cannot resume exactly", key="sources")
        for source, shard, record, chunk, age in state.ages:
            if reads is None or reads[source]:
                self.resume_ages[source][(shard, record, chunk)] = age

    def _resumed_layout(self, s: int) -> EpochLayout:
        """Source `s`'s rest of the saved epoch (stream), dealt to this job's readers."""
        return layout_from_progress(self.resume.sources[s], seed=self.seed,
                                    epoch=self.resume.epoch, source_index=s, world=self.world,
                                    endless=self.endless(s), rotation=int(self.offsets[s]),
                                    readers=int(self.readers[s]))

    def _deals_again(self, s: int) -> bool:
        """Whether source `s`'s saved deal is dealt again on resuming (`redeals`), so the saved
        holding no longer applies."""
        p, R = self.resume.sources[s], self.world
        if redeals(p, R, int(self.offsets[s]), int(self.readers[s])):
            readers = int(self.readers[s])
            return R != p.base_world or (0 if readers >= R else readers) != p.readers \
                or int(self.offsets[s]) != p.rotation
        return (0 if p.readers >= p.base_world else p.readers) != p.readers

    def _fresh_layout(self, source: int, epoch: int, rank: Optional[int] = None) -> EpochLayout:
        """A fresh deal of `source` for `epoch` (an endless source's first pass: 0), kept while
        asked for (every rank's fetcher, or queue, asks for the same one); `rank`: its deal
        only (`EpochLayout.for_rank`)."""
        key = (source, epoch)
        if key not in self._fresh:
            self._fresh = {k: v for k, v in self._fresh.items() if k[1] >= key[1]}
            self._fresh[key] = fresh_layout(self.virtual_shards(source), seed=self.seed,
                                            epoch=epoch, source_index=source,
                                            world=self.world, endless=self.endless(source),
                                            rotation=int(self.offsets[source]),
                                            readers=int(self.readers[source]), rank=rank)
        return self._fresh[key]

    def _start_state(self) -> LoaderState:
        """The state where this loader starts (`state(None)`)."""
        if self.resume is not None:
            return self.resume
        return LoaderState(STATE_VERSION, self.seed, self.world, 0, 0, None, (), data=self.data)


class JobModel(_Deal):
    def __init__(self, stepper: Stepper, sources: Sequence[Source], seed: int, world: int,
                 states_in_flight: int = 0, data=None, track: bool = True):
        """`data`: the options that decide the data, recorded in the state and checked on a
        resume (`data_options`); a DataOptions, or a function giving it (a Hugging Face
        tokenizer's digest is worked out when a state is first saved or loaded). `track`:
        follow each source's progress (False: the dry run over lengths alone, which has no
        state to save)."""
        super().__init__(stepper, sources, seed, world, data)
        self.stepper = stepper
        self.track = track
        self.states_in_flight = states_in_flight
        self.trackers: list[SourceTracker] = []
        self.resumed_layouts: list[EpochLayout] = []
        # [R, S] whether rank r reads source s. Every rank until listed.
        self.reads = np.ones((world, len(self.sources)), dtype=bool)
        self._redealt = False    # a resumed layout was dealt again (another world or readers)

    @classmethod
    def build(cls, config: LoaderConfig, sources: Sequence[Source], mixture, world: int,
              states_in_flight: int = 0, data=None, track: bool = True) -> "JobModel":
        return cls(Stepper.build(config, sources, mixture, world), sources, config.seed, world,
                   states_in_flight, data, track)

    # -- what the stepper says -------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.stepper.epoch

    @property
    def step(self) -> int:
        return self.stepper.step

    @property
    def holding(self) -> np.ndarray:
        return self.stepper.holding

    @property
    def finished(self) -> bool:
        return self.stepper.finished

    def window_tokens(self) -> np.ndarray:
        """int64 [R, S]: every rank's head window for the next step."""
        return self.stepper.window_tokens()

    def budgets(self, rank: int):
        """Rank `rank`'s buffers for the next step (`Stepper.budgets`)."""
        return self.stepper.budgets(rank)

    # -- listing -----------------------------------------------------------------------------------
    def listed(self, shard_names: Sequence[Sequence[str]]) -> None:
        super().listed(shard_names)
        self.reads = reader_mask(self.readers, self.offsets, self.world)
        self.stepper.set_readers(self.reads)

    def reads_source(self, rank: int, source: int) -> bool:
        """Whether `rank` reads `source` (runs its fetcher, buffer and head window)."""
        return bool(self.reads[rank, source])

    # -- resumption --------------------------------------------------------------------------------
    def start(self, holding: Optional[np.ndarray] = None) -> None:
        """After listing: apply a loaded state (checked against this job's shards), then deal
        the first epoch. `holding` [R, S]: which ranks hold data of each source, where the
        driver knows better than the deal (the dry run's sampled sources); None: the deal's."""
        if self.resume is not None:
            self._apply_resume()
        dealt = self._start_epoch(self.stepper.epoch)
        if not self.resumed() or self.resume.holding is None \
                or self.resume.world_size != self.world or self._redealt:
            self.stepper.start_epoch(dealt if holding is None else holding)
        # else: the windows the saved run had

    def _apply_resume(self) -> None:
        state = self.resume
        R, S = self.world, len(self.sources)
        holding = None
        if state.holding is not None and state.world_size == R and state.sources:
            holding = np.unpackbits(np.frombuffer(state.holding, np.uint8),
                                    count=R * S).astype(bool).reshape(R, S)
        self.stepper.restore(state.epoch, state.step, state.mixture, holding)
        if not state.sources:   # saved before the first step: a fresh start
            self.resume = None
            return
        self._check_listing(state)
        self.resumed_layouts = [self._resumed_layout(s) for s in range(S)]
        self._redealt = any(self._deals_again(s) for s in range(S))

    # -- epochs ------------------------------------------------------------------------------------
    def layout_for(self, source: int, epoch: int) -> EpochLayout:
        """A finite source's layout for `epoch`; an endless source's whole stream."""
        endless = self.endless(source)
        if self.resumed() and (endless or epoch == self.resume.epoch):
            return self.resumed_layouts[source]
        return self._fresh_layout(source, 0 if endless else epoch)

    def _start_epoch(self, epoch: int) -> np.ndarray:
        """New trackers for the finite sources (endless sources keep theirs). Returns [R, S]:
        the ranks whose layout has units of each source (every rank, for an endless source)."""
        if not self.track:
            return self._holding([self.layout_for(s, epoch) for s in range(len(self.sources))])
        previous = self.trackers
        self.trackers = [previous[s] if previous and self.endless(s)
                         else SourceTracker(self.layout_for(s, epoch),
                                            states_in_flight=self.states_in_flight)
                         for s in range(len(self.sources))]
        return self._holding([t.layout for t in self.trackers])

    def _holding(self, layouts: Sequence[EpochLayout]) -> np.ndarray:
        """bool [R, S]: the ranks that read each source and have units of it this epoch (every
        reader, for an endless source), column by column (R x S Python calls took 2.6 s at
        R=4,096, S=300)."""
        return np.stack([layout.readers_mask() if self.endless(s) else layout.holding_mask()
                         for s, layout in enumerate(layouts)], axis=1).reshape(
                             self.world, len(self.sources))

    def end_epoch(self) -> bool:
        """After an "end_epoch" outcome: the next epoch, dealt. Returns True when the run has
        done its epochs (then nothing is dealt)."""
        self.stepper.end_epoch()
        if self.stepper.finished:
            return True
        self.stepper.start_epoch(self._start_epoch(self.stepper.epoch))
        return False

    def set_holding(self, holding: np.ndarray) -> None:
        """[R, S]: which ranks hold data of each source at an epoch's start, where the driver
        knows better than the deal (the dry run: a sampled source, an empty shard)."""
        self.stepper.start_epoch(holding)

    # -- every step --------------------------------------------------------------------------------
    def begin(self, candidates: Candidates, exhausted: np.ndarray) -> Step:
        """Every rank's windows gathered: the outcome and the quota (`Stepper.begin`)."""
        return self.stepper.begin(candidates, exhausted)

    def assign(self, step: Step) -> Assignment:
        """The planner's plan for a "continue" step (`Stepper.assign`)."""
        return self.stepper.assign(step)

    def commit(self, step: Step, take: np.ndarray, length: np.ndarray,
               ids: Optional[np.ndarray] = None) -> np.ndarray:
        """The step took candidates `take`, `length` tokens of each; `ids` [n, 3] line up with
        the candidates (needed when tracking). Returns the realized units per source."""
        units = self.stepper.commit(step, take, length)
        if self.track:
            self._observe(step.candidates, ids, take, length)
        return units

    def _observe(self, candidates: Candidates, ids: np.ndarray, take: np.ndarray,
                 length: np.ndarray) -> None:
        """The step offered `candidates` (with their `ids`, shard/record/chunk) and took `take`,
        `length` tokens of each: what every rank's window delivered and what stays pending."""
        taken = np.zeros(len(candidates), dtype=bool)
        taken[take] = True
        cut = length < candidates.length[take]
        if cut.any():   # the rest of a cut piece is pending, under its new offset (`pieces`)
            ids = ids.copy()
            ids[take[cut], 2] += length[cut]
            taken[take[cut]] = False
        ages = candidates.age.astype(np.int64)
        for (s, q), window in candidates.windows():
            self.trackers[s].observe(q, ids[window], ages[window], taken[window])

    def snapshot(self) -> StepSnapshot:
        """Cheap, per step: the trackers' progress objects are replaced, never mutated."""
        stepper = self.stepper
        return StepSnapshot(stepper.epoch, stepper.step, stepper.mixer.to_state(),
                            tuple(t.snapshot() for t in self.trackers), stepper.holding.copy())

    def state(self, snapshot: Optional[StepSnapshot]) -> LoaderState:
        """The resumable state as of `snapshot` (None: where this loader would start). Runs
        where the trackers live: on the loop, or once the loop has ended."""
        if snapshot is None:
            return self._start_state()
        sources, ages = [], []
        for s, (source, (tracker, ranks)) in enumerate(zip(self.sources, snapshot.sources)):
            progress, pending = tracker.progress(ranks, source.name, self.listing_crcs[s],
                                                 self.virtual_shards(s))
            sources.append(progress)
            ages += [(s, *a) for a in pending]
        return LoaderState(STATE_VERSION, self.seed, self.world, snapshot.epoch, snapshot.step,
                           snapshot.mixture, tuple(sources), tuple(sorted(ages)),
                           np.packbits(snapshot.holding).tobytes(), self.data)


class RankShare(_Deal):
    """One rank's share of the job, where rank 0 alone keeps the job model (control_plane
    "gather"): which sources this rank reads, its fetchers' layouts (its own deal only:
    `EpochLayout.for_rank`) and its buffers before the first step, equal to what
    `JobModel.budgets(rank)` gives (afterwards rank 0 sends them with its replies). A pure
    function of the configuration, the listings, a loaded state and the rank: what it keeps
    is O(S), not O(R x S) (`docs/architecture.md`)."""

    def __init__(self, parts: StepParts, sources: Sequence[Source], seed: int, world: int,
                 rank: int, data=None):
        super().__init__(parts, sources, seed, world, data)
        self.stepper, self.rank = parts, rank   # the geometry, cost, mixer and memory plan
        self.epoch = self.step = 0
        self._reads = np.ones(len(self.sources), dtype=bool)   # [S]: this rank reads s
        self._budgets: list = []
        self._resumed: dict[int, EpochLayout] = {}   # this rank's deal of the saved epoch

    @classmethod
    def build(cls, config: LoaderConfig, sources: Sequence[Source], mixture, world: int,
              rank: int, data=None) -> "RankShare":
        return cls(StepParts.build(config, sources, mixture, world), sources, config.seed,
                   world, rank, data)

    def listed(self, shard_names: Sequence[Sequence[str]]) -> None:
        super().listed(shard_names)
        self._reads = (self.rank - self.offsets) % max(self.world, 1) < self.readers

    def reads_source(self, rank: int, source: int) -> bool:
        self._own(rank)
        return bool(self._reads[source])

    def budgets(self, rank: int):
        """This rank's buffers before the first step (`start`)."""
        self._own(rank)
        return self._budgets

    def _own(self, rank: int) -> None:
        if rank != self.rank:
            raise ValueError(f"rank {self.rank} keeps its own share of the job; asked about "
                             f"rank {rank} (only rank 0 keeps the job model)")

    def start(self) -> None:
        """After listing: apply a loaded state, then this rank's buffers, as `JobModel.start`
        and `JobModel.budgets(rank)` would give them: from the mix's shares, how many ranks
        hold data of each source (counted without dealing the other ranks' shards when the
        deal is fresh) and whether this one does."""
        state, S, R = self.resume, len(self.sources), self.world
        if state is not None:
            self.epoch, self.step = state.epoch, state.step
            if state.mixture is not None:
                self.stepper.mixer.load_state(state.mixture)
            if not state.sources:   # saved before the first step: a fresh start
                self.resume = None
            else:   # the ages of the items its fetchers read, not the whole job's
                self._check_listing(state, self._reads)
        resumed = self.resumed()
        if resumed and state.holding is not None and state.world_size == R \
                and not any(self._deals_again(s) for s in range(S)):   # the saved run's windows
            holding = np.unpackbits(np.frombuffer(state.holding, np.uint8),
                                    count=R * S).astype(bool).reshape(R, S)
            holders, held = holding.sum(axis=0), holding[self.rank].copy()
        else:
            holders, held = np.zeros(S, dtype=np.int64), np.zeros(S, dtype=bool)
            for s in range(S):
                holders[s], held[s] = self._holders(s) if resumed else self._fresh_holders(s)
        shares = self.stepper.mixer.shares_at(holders > 0)
        self._budgets = self.stepper.memory.budgets(shares, holders, held, self._reads)

    def _fresh_holders(self, s: int) -> tuple[int, bool]:
        """(ranks holding data of source `s`, this rank is one) for a fresh deal."""
        held = bool(self._reads[s]) and (self.endless(s) or
                                         self.layout_for(s, self.epoch).has_units(self.rank))
        return fresh_holders(self.virtual_shards(s), self.world, int(self.readers[s]),
                             self.endless(s)), held

    def _holders(self, s: int) -> tuple[int, bool]:
        """The same for the saved epoch: an endless source's readers; a finite source's from
        what is left of it, counted without dealing when it is dealt again, else dealt for
        every rank here and then dropped (kept for this rank alone, if it reads `s`)."""
        if self.endless(s):   # `readers_mask`, the new world's or the same saved one
            return fresh_holders(0, self.world, int(self.readers[s]), True), bool(self._reads[s])
        progress = self.resume.sources[s]
        rotation, readers = int(self.offsets[s]), int(self.readers[s])
        if redeals(progress, self.world, rotation, readers):
            mask = dealt_again_holding(progress, seed=self.seed, epoch=self.resume.epoch,
                                       source_index=s, world=self.world, rotation=rotation,
                                       readers=readers)
        else:
            layout = self._resumed_layout(s)
            mask = layout.holding_mask()
            if self._reads[s]:
                self._resumed[s] = layout.for_rank(self.rank)
        return int(mask.sum()), bool(mask[self.rank])

    def layout_for(self, source: int, epoch: int) -> EpochLayout:
        """This rank's deal of a source it reads, for `epoch` (an endless source: its stream)."""
        if not self._reads[source]:
            raise ValueError(f"rank {self.rank} does not read source "
                             f"{self.sources[source].name!r}: no layout kept for it")
        endless = self.endless(source)
        if self.resumed() and (endless or epoch == self.resume.epoch):
            if source not in self._resumed:
                self._resumed[source] = self._resumed_layout(source).for_rank(self.rank)
            return self._resumed[source]
        return self._fresh_layout(source, 0 if endless else epoch, self.rank)

    def state(self, snapshot) -> LoaderState:
        """Where this loader starts (`snapshot` None); any later state comes from rank 0."""
        if snapshot is not None:
            raise ValueError(f"rank {self.rank} keeps no job model: its states come from rank 0")
        return self._start_state()


def step_windows(job: JobModel, windows: Windows) -> tuple[Step, Offer, Optional[Assignment]]:
    """One step of the job model over length windows (`plan.windows.Windows`; the benchmarks'
    and the job model's tests' loop): the windows' offer, `begin`, and, when the step goes on,
    `assign` with the plan committed to the model and to the windows. The plan is None when
    the step does not go on (`step.outcome` says why)."""
    offer = windows.offer(job.window_tokens())
    step = job.begin(offer.candidates, offer.exhausted)
    if step.outcome != "continue":
        return step, offer, None
    plan = job.assign(step)
    job.commit(step, plan.take, plan.length, offer.ids)
    windows.commit(offer, plan.take, plan.length, step.index)
    return step, offer, plan


def layout_feed(units: Iterable[ReadUnit], shard_block: Callable[[int], Block],
                ages: Optional[dict] = None) -> Feed:
    """A rank's items of a source, as `plan.windows.ItemQueue` takes them: the read units in
    order (`EpochLayout.rank_units` for an epoch, `.stream` for an endless source), each
    shard's items (`shard_block(shard)`, ids with that shard id) kept by the unit's filter as
    the fetcher keeps them (`pipeline.transform`): the rest of a cut piece from its offset, and
    with its age from a resumed state (`ages`: (shard, record, chunk) -> age, `resume_ages`)."""
    units = iter(units)

    def feed(_tokens: int) -> Optional[Block]:   # a whole shard, whatever the window needs
        unit = next(units, None)
        if unit is None:
            return None
        block = shard_block(unit.shard)
        keep = unit.keep_filter()
        if keep is not None:
            rows, starts = [], []
            for i, (record, chunk) in enumerate(block.ids[:, 1:].tolist()):
                start = keep(record, chunk)
                if start is not None:
                    rows.append(i)
                    starts.append(start)
            rows, starts = np.asarray(rows, np.int64), np.asarray(starts, np.int64)
            ids = block.ids[rows].copy()
            ids[:, 2] |= starts
            block = Block(block.lengths[rows] - starts, ids, block.divisible[rows])
        if ages:
            block = Block(block.lengths, block.ids, block.divisible, np.array(
                [ages.get(tuple(i), 0) for i in block.ids.tolist()], np.int64))
        return block
    return feed
