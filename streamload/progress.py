"""The job's progress through its epochs, and resumption: which data is delivered, per source and
rank, from the gathered windows and the plans (`SourceTracker`, state.py), as `LoaderState`.

Loop-owned: `observe` runs on the loader's loop every step, and so does `state` (the Loader hops
there for `state_dict()`, or calls it directly once the loop has ended). What a step leaves
behind for a later `state_dict()` is a `StepSnapshot`: immutable, one per delivered batch.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .config import LoaderConfig, Source
from .errors import ConfigError
from .plan.quota_mixer import MixtureState
from .plan.stepper import Stepper
from .plan.types import Candidates
from .state import (STATE_VERSION, DataOptions, EpochLayout, LoaderState, RankProgress,
                    SourceData, SourceTracker, fresh_layout, layout_from_progress)
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
                                 format=s.format, on_exhausted=s.on_exhausted, repeat=s.repeat)
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
    return out


def check_resume(state: LoaderState, seed: int, data: DataOptions) -> None:
    """Refuse a saved state that this job would resume into other data: another seed, or
    other `DataOptions`; one ConfigError names every mismatch (its key: the first one's). The
    shards are checked once listed (`JobProgress.apply_resume`)."""
    problems = []
    if state.seed != seed:
        problems.append(("seed", f"seed: saved with {state.seed}, this loader has {seed}"))
    problems += data_mismatches(state.data, data)
    if problems:
        raise ConfigError(
            "loader state: resuming would deliver other data than the saved run did (samples "
            "twice, or never): " + "; ".join(p for _, p in problems)
            + ". Resume with the saved values, or start without the state", key=problems[0][0])


class JobProgress:
    def __init__(self, sources: Sequence[Source], seed: int, world: int, states_in_flight: int,
                 data: Optional[DataOptions] = None):
        """`data`: the options that decide the data, recorded in the state and checked on a
        resume (`data_options`); a DataOptions, or a function giving it (a Hugging Face
        tokenizer's digest is worked out when a state is first saved or loaded)."""
        self.sources, self.seed, self.world = list(sources), seed, world
        self._data = data
        self.states_in_flight = states_in_flight
        self.num_shards = [0] * len(self.sources)   # listed shards per source (`listed`)
        self.listing_crcs = [0] * len(self.sources)
        self.trackers: list[SourceTracker] = []
        self.resume: Optional[LoaderState] = None       # `load`; kept for `state` until a step
        self.resumed_layouts: list[EpochLayout] = []
        self.resume_ages: list[dict] = [{} for _ in self.sources]   # (shard, record, chunk) -> age

    def listed(self, shard_names: Sequence[Sequence[str]]) -> None:
        self.num_shards = [len(names) for names in shard_names]
        self.listing_crcs = [listing_crc(names) for names in shard_names]

    def endless(self, source: int) -> bool:
        """A source with on_exhausted="restart": one stream of passes, across epochs."""
        return self.sources[source].on_exhausted == "restart"

    def virtual_shards(self, source: int) -> int:
        """Shards per epoch: each listed shard once per pass (`Source.repeat`)."""
        return self.num_shards[source] * self.sources[source].repeat

    @property
    def data(self) -> DataOptions:
        if callable(self._data):
            self._data = self._data()
        return self._data

    # -- resumption --------------------------------------------------------------------------------
    def load(self, state: LoaderState) -> None:
        """Take a saved state, checked already (`check_resume`)."""
        self.resume = state

    def apply_resume(self, stepper: Stepper) -> None:
        """Check the saved state against this job's shards (after listing) and set the stepper,
        the layouts and the pending items' ages from it."""
        state = self.resume
        R, S = self.world, len(self.sources)
        holding = None
        if state.holding is not None and state.world_size == R and state.sources:
            holding = np.unpackbits(np.frombuffer(state.holding, np.uint8),
                                    count=R * S).astype(bool).reshape(R, S)
        stepper.restore(state.epoch, state.step, state.mixture, holding)
        if not state.sources:   # saved before the first step: a fresh start
            self.resume = None
            return
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
        self.resumed_layouts = [
            layout_from_progress(p, seed=self.seed, epoch=state.epoch, source_index=s,
                                 world=R, endless=self.endless(s))
            for s, p in enumerate(state.sources)]
        for source, shard, record, chunk, age in state.ages:
            self.resume_ages[source][(shard, record, chunk)] = age

    def resumed(self) -> bool:
        return self.resume is not None and bool(self.resume.sources)

    # -- epochs ------------------------------------------------------------------------------------
    def layout_for(self, source: int, epoch: int) -> EpochLayout:
        """A finite source's layout for `epoch`; an endless source's whole stream."""
        endless = self.endless(source)
        if self.resumed() and (endless or epoch == self.resume.epoch):
            return self.resumed_layouts[source]
        return fresh_layout(self.virtual_shards(source), seed=self.seed,
                            epoch=0 if endless else epoch, source_index=source,
                            world=self.world, endless=endless)

    def start_epoch(self, epoch: int) -> np.ndarray:
        """New trackers for the finite sources (endless sources keep theirs). Returns [R, S]:
        the ranks whose layout has units of each source (every rank, for an endless source)."""
        previous = self.trackers
        self.trackers = [previous[s] if previous and self.endless(s)
                         else SourceTracker(self.layout_for(s, epoch),
                                            states_in_flight=self.states_in_flight)
                         for s in range(len(self.sources))]
        return np.array([[self.endless(s) or bool(t.layout.rank_units(q))
                          for s, t in enumerate(self.trackers)] for q in range(self.world)],
                        dtype=bool).reshape(self.world, len(self.sources))

    # -- every step ----------------------------------------------------------------------------------
    def observe(self, candidates: Candidates, ids: np.ndarray, take: np.ndarray,
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
        for (s, q), window in candidates.windows():
            self.trackers[s].observe(q, ids[window], candidates.age[window].astype(np.int64),
                                     taken[window])

    def snapshot(self, stepper: Stepper) -> StepSnapshot:
        """Cheap, per step: the trackers' progress objects are replaced, never mutated."""
        return StepSnapshot(stepper.epoch, stepper.step, stepper.mixer.to_state(),
                            tuple(t.snapshot() for t in self.trackers), stepper.holding.copy())

    def state(self, snapshot: Optional[StepSnapshot]) -> LoaderState:
        """The resumable state as of `snapshot` (None: where this loader would start). Runs
        where the trackers live: on the loop, or once the loop has ended."""
        if snapshot is None:
            if self.resume is not None:
                return self.resume
            return LoaderState(STATE_VERSION, self.seed, self.world, 0, 0, None, (),
                               data=self.data)
        sources, ages = [], []
        for s, (source, (tracker, ranks)) in enumerate(zip(self.sources, snapshot.sources)):
            progress, pending = tracker.progress(ranks, source.name, self.listing_crcs[s],
                                                 self.virtual_shards(s))
            sources.append(progress)
            ages += [(s, *a) for a in pending]
        return LoaderState(STATE_VERSION, self.seed, self.world, snapshot.epoch, snapshot.step,
                           snapshot.mixture, tuple(sources), tuple(ages),
                           np.packbits(snapshot.holding).tobytes(), self.data)
