"""Resumable state: where every rank is in every source's epoch, as plain data (msgspec).

Each rank reads an epoch of a source as an ordered list of *read units*. A unit is a shard plus
an optional filter: keep the items after (record, chunk) `skip_through`, plus the `extras`
listed. A fresh epoch gives rank q the whole shards `perm[q::R]` (the *base*).

Every rank sees every rank's head window (ids included) and every plan, so every rank can track
the whole job's progress: for each (rank, source), the furthest item offered (the *frontier*)
and the items offered but not yet taken (*pending*). Everything before the frontier that is not
pending has been delivered. The state is therefore, per source: the base (a shard bitmap and the
world size it was dealt to), each rank's position in its base, and a few filtered units for
shards in progress. That is kilobytes, whatever the dataset's size.

Resuming at the same world size gives every rank the same remaining stream, so the batches are
identical to an uninterrupted run. At another world size the remaining units and untouched
shards are pooled and dealt again, so every sample of the epoch is still delivered exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import msgspec
import numpy as np

from .errors import ConfigError
from .plan.mixing import MixtureState

STATE_VERSION = 2
_END = (2**62, 2**62)   # skip_through for "only the extras"


class ReadUnit(msgspec.Struct, array_like=True, frozen=True):
    shard: int
    skip_through: Optional[tuple[int, int]] = None    # None: every item of the shard
    extras: tuple[tuple[int, int], ...] = ()

    def keep_filter(self):
        """A predicate on (record, chunk), or None when the whole shard is kept."""
        if self.skip_through is None:
            return None
        skip, extras = tuple(self.skip_through), {tuple(e) for e in self.extras}
        return lambda record, chunk: (record, chunk) > skip or (record, chunk) in extras


class SourceProgress(msgspec.Struct, frozen=True):
    name: str
    num_shards: int
    listing_crc: int
    base_world: int                      # the world size the base was dealt to
    base_shards: Optional[bytes]         # bitmap of shards in the base; None = all shards
    base_position: tuple[int, ...]       # per base rank: how many base shards it has started
    units: tuple[tuple[ReadUnit, ...], ...]   # per base rank: filtered units before the rest


class LoaderState(msgspec.Struct, frozen=True):
    version: int
    seed: int
    world_size: int
    epoch: int
    step: int
    mixture: Optional[MixtureState]      # the schedule's position and carried deficits
    sources: tuple[SourceProgress, ...]
    ages: tuple[tuple[int, int, int, int, int], ...] = ()   # (source, shard, record, chunk, age)


def encode_state(state: LoaderState) -> bytes:
    return msgspec.json.encode(state)


def decode_state(data) -> LoaderState:
    """From bytes (JSON) or a dict (as stored by torch.distributed.checkpoint)."""
    try:
        if isinstance(data, (bytes, bytearray, str)):
            state = msgspec.json.decode(data, type=LoaderState)
        else:
            state = msgspec.convert(data, LoaderState)
    except msgspec.MsgspecError as exc:
        raise ConfigError(f"loader state: not a valid streamload state: {exc}") from None
    if state.version != STATE_VERSION:
        raise ConfigError(f"loader state: version {state.version} is not supported "
                          f"(this streamload writes version {STATE_VERSION})")
    return state


def shard_permutation(num_shards: int, seed: int, epoch: int, source_index: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, source_index]).permutation(num_shards)


@dataclass
class EpochLayout:
    """How one source's epoch is dealt to ranks: per rank, filtered units then base shards."""
    base_world: int
    base_shards: Optional[np.ndarray]          # bool [num_shards]; None = all
    base: list[np.ndarray]                     # per base rank: shard indices in order
    base_position: list[int]                   # per base rank: base shards already started
    units: list[list[ReadUnit]]                # per base rank: filtered units first

    def rank_units(self, rank: int) -> list[ReadUnit]:
        return list(self.units[rank]) + [ReadUnit(int(s)) for s in
                                         self.base[rank][self.base_position[rank]:]]


def fresh_layout(num_shards: int, *, seed: int, epoch: int, source_index: int,
                 world: int, base_shards: Optional[np.ndarray] = None) -> EpochLayout:
    order = shard_permutation(num_shards, seed, epoch, source_index)
    if base_shards is not None:
        order = order[base_shards[order]]
    return EpochLayout(world, base_shards, [order[q::world] for q in range(world)],
                       [0] * world, [[] for _ in range(world)])


def layout_from_progress(progress: SourceProgress, *, seed: int, epoch: int, source_index: int,
                         world: int) -> EpochLayout:
    """The rest of an epoch, dealt to `world` ranks."""
    bits = None
    if progress.base_shards is not None:
        bits = np.unpackbits(np.frombuffer(progress.base_shards, np.uint8),
                             count=progress.num_shards).astype(bool)
    saved = fresh_layout(progress.num_shards, seed=seed, epoch=epoch, source_index=source_index,
                         world=progress.base_world, base_shards=bits)
    saved.base_position = list(progress.base_position)
    saved.units = [list(u) for u in progress.units]
    if world == progress.base_world:
        return saved
    # Elastic: pool what is left and deal it again. Untouched shards keep the epoch's order.
    untouched = np.zeros(progress.num_shards, dtype=bool)
    for q in range(saved.base_world):
        untouched[saved.base[q][saved.base_position[q]:]] = True
    pooled = [unit for q in range(saved.base_world) for unit in saved.units[q]]
    layout = fresh_layout(progress.num_shards, seed=seed, epoch=epoch, source_index=source_index,
                          world=world, base_shards=untouched)
    layout.units = [pooled[r::world] for r in range(world)]
    return layout


@dataclass
class RankProgress:
    frontier_unit: int = -1                       # index into rank_units; -1: nothing offered
    frontier: tuple[int, int] = (-1, -1)          # (record, chunk) of the furthest offered item
    pending: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int64))
    # rows: shard, record, chunk, age (as it will be when offered again)


class SourceTracker:
    """Follows one source's epoch on every rank, from the windows and the plans."""

    def __init__(self, layout: EpochLayout):
        self.layout = layout
        self.unit_lists = [layout.rank_units(q) for q in range(layout.base_world)]
        self.unit_index = {}
        for q, units in enumerate(self.unit_lists):
            for i, unit in enumerate(units):
                self.unit_index[unit.shard] = (q, i)
        self.ranks = [RankProgress() for _ in range(layout.base_world)]

    def observe(self, rank: int, ids: np.ndarray, ages: np.ndarray, taken: np.ndarray) -> None:
        """Rank `rank` offered window `ids` (n x 3, in order); `taken` marks what the plan took."""
        if ids.shape[0] == 0:
            return
        shard, record, chunk = (int(v) for v in ids[-1])
        q, unit = self.unit_index[shard]
        assert q == rank, "a window item outside its rank's units"
        # The frontier only moves forward: a window can end before an item an earlier window
        # offered (and the plan took), when only untaken items are left before the marker.
        previous = self.ranks[rank]
        frontier = max((unit, (record, chunk)), (previous.frontier_unit, previous.frontier))
        left = ~taken
        self.ranks[rank] = RankProgress(
            frontier[0], frontier[1],
            np.concatenate([ids[left], (ages[left] + 1)[:, None]], axis=1).astype(np.int64))

    def snapshot(self) -> tuple["SourceTracker", tuple[RankProgress, ...]]:
        """Cheap, per step: the progress objects are replaced, never mutated."""
        return self, tuple(self.ranks)

    def progress(self, ranks: tuple[RankProgress, ...], name: str, listing_crc: int,
                 num_shards: int) -> tuple[SourceProgress, list]:
        """The remaining epoch as SourceProgress, and the pending items' ages."""
        layout = self.layout
        positions, all_units, ages = [], [], []
        for q, p in enumerate(ranks):
            units = self.unit_lists[q]
            filtered = len(layout.units[q])
            position = layout.base_position[q]
            if p.frontier_unit < 0:
                positions.append(position)
                all_units.append(tuple(layout.units[q]))
                continue
            pending_by_shard: dict[int, list[tuple[int, int]]] = {}
            for shard, record, chunk, age in p.pending.tolist():
                pending_by_shard.setdefault(shard, []).append((record, chunk))
                ages.append((shard, record, chunk, age))
            remaining = []
            for i, unit in enumerate(units[:p.frontier_unit + 1]):
                extras = pending_by_shard.get(unit.shard, [])
                if i < p.frontier_unit:
                    if extras:
                        remaining.append(ReadUnit(unit.shard, _END, tuple(extras)))
                    continue
                skip = p.frontier if unit.skip_through is None else max(tuple(unit.skip_through), p.frontier)
                later = [tuple(e) for e in unit.extras if tuple(e) > p.frontier]
                remaining.append(ReadUnit(unit.shard, skip, tuple(sorted(set(extras + later)))))
            remaining += units[p.frontier_unit + 1:filtered]
            if p.frontier_unit >= filtered:   # the frontier is inside the base part
                position += p.frontier_unit - filtered + 1
            positions.append(position)
            all_units.append(tuple(remaining))
        bits = None if layout.base_shards is None else np.packbits(layout.base_shards).tobytes()
        return SourceProgress(name, num_shards, listing_crc, layout.base_world, bits,
                              tuple(positions), tuple(all_units)), ages
