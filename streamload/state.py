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

A source with on_exhausted="restart" is *endless*: after its base, each rank goes on with pass
after pass, each pass a fresh seeded permutation. Its shards get pass-wide ids
`pass * num_shards + shard`, so the same record in two passes is two distinct items, and the
state records each rank's pass beside its position. Such a stream ignores epoch boundaries: the
finite sources end the epoch, the endless ones go on where they are.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Iterator, Optional

import msgspec
import numpy as np

from . import pieces
from .errors import ConfigError
from .plan.quota_mixer import MixtureState

STATE_VERSION = 6   # 4: the options that decide the data (`DataOptions`) are recorded;
                    # 5: saved in O(sources + ranks) (`SavedState`), not per (rank, source);
                    # 6: the pending items saved as runs (`_runs`), columns narrowed (`_pack`);
                    # version 5 is still read
_END = (2**62, 2**62)   # skip_through for "only the extras"


class ReadUnit(msgspec.Struct, array_like=True, frozen=True):
    shard: int
    skip_through: Optional[tuple[int, int]] = None    # None: every item of the shard
    extras: tuple[tuple[int, int], ...] = ()

    def keep_filter(self) -> Optional["KeepFilter"]:
        """None when the whole shard is kept; else a `KeepFilter`."""
        return None if self.skip_through is None else KeepFilter(self)


class KeepFilter:
    """What a resumed shard still has to deliver: every item after `skip_through`, plus the
    extras (items at or before it that were pending). An extra whose chunk carries an offset
    (`pieces`) is the rest of a piece the planner cut: the piece is kept from there."""

    def __init__(self, unit: ReadUnit):
        self.skip = tuple(unit.skip_through)
        self.extras, self.rests = set(), {}
        for record, chunk in unit.extras:
            offset = chunk & pieces.OFFSET_MASK if chunk >= 0 else 0
            if offset:
                self.rests[(record, chunk - offset)] = offset
            else:
                self.extras.add((record, chunk))
        self.records = {record for record, _ in unit.extras}

    def __call__(self, record: int, chunk: int) -> Optional[int]:
        """The offset to start item (record, chunk) at (0: whole), or None to leave it out."""
        if (record, chunk) in self.rests:
            return self.rests[(record, chunk)]
        return 0 if (record, chunk) > self.skip or (record, chunk) in self.extras else None

    def wants(self, record: int) -> bool:
        """Whether any item of `record` may still be delivered. A record that is not is only
        read past (its place in the shard), never tokenized: resuming late in a shard costs
        its bytes, not its tokenizer time."""
        return record >= self.skip[0] or record in self.records

    def wants_any(self, first: int, end: int) -> bool:
        """Whether any record in [first, end) is wanted (`wants`)."""
        return end - 1 >= self.skip[0] or any(first <= r < end for r in self.records)


class SourceProgress(msgspec.Struct, frozen=True):
    name: str
    num_shards: int
    listing_crc: int
    base_world: int                      # the world size the base was dealt to
    base_shards: Optional[bytes]         # bitmap of shards in the base; None = all shards
    base_position: tuple[int, ...]       # per base rank: how many base shards it has started
    units: tuple[tuple[ReadUnit, ...], ...]   # per base rank: filtered units before the rest
    first_pass: int = 0                  # endless sources: the pass the base was dealt from
    passes: tuple[int, ...] = ()         # endless sources: per base rank, its base's pass
    rotation: int = 0                    # the deal starts at rank `rotation` (0: states saved
                                         # before sources were rotated)
    readers: int = 0                     # the base was dealt over this many ranks from
                                         # `rotation` on (0: every rank; `plan/readers.py`)


class SourceData(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A source's options that decide its items: resumed with others, the saved positions
    would name other items (duplicates and gaps). Its weight, URI and storage may change."""
    name: str
    text_field: Optional[str]
    tokens_field: Optional[str]
    format: Optional[str]                # None: detected from the file names
    on_exhausted: str                    # "restart" reads the state's positions as passes
    repeat: int
    # An image source's options (`vision.Images`, as JSON): the resizing rule decides how many
    # tokens each sample takes. None: a text source (and states saved before this field).
    images: Optional[str] = None


class DataOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What decides which tokens a job delivers, besides the seed and the shards (checked by
    `listing_crc`). The world size, the mixture's weights, the planner and the step's rows may
    change on a resume; these may not (docs/reliability.md)."""
    micro_batch_tokens: int              # a row's tokens (x cp): long documents are cut to it
    long_documents: str
    tokenizer: Optional[str]             # `tokenizer.identity`; None: unknown, not checked
    sources: tuple[SourceData, ...]


class LoaderState(msgspec.Struct, frozen=True):
    version: int
    seed: int
    world_size: int
    epoch: int
    step: int
    mixture: Optional[MixtureState]      # the schedule's position and carried deficits
    sources: tuple[SourceProgress, ...]
    ages: tuple[tuple[int, int, int, int, int], ...] = ()   # (source, shard, record, chunk, age)
    # [world_size, sources] bits, row-major: which ranks still held data of which source after
    # the last step. Head windows are sized from it (`MemoryPlan`), so an exact resume needs it.
    holding: Optional[bytes] = None
    data: Optional[DataOptions] = None   # always written (version >= 4); `decode_state` requires it


# -- the saved form (version 5): O(sources + ranks), not O(ranks x sources) ------------------------
#
# A source's progress in memory (`SourceProgress`) has per base rank its position in the base
# and its filtered units. Saved, the positions of a finite source are one bitmap over its shards
# (which base shards were started: a rank's are a prefix of its own base, so its position is
# how many of its shards are set), and the units in progress, of every source, one packed
# array for the whole state, as are the pending items' ages. What grows with R is then only
# what is in flight: a shard in progress per reading rank, the items offered and not taken,
# and the holding bits (R x S bits).


class SavedSource(msgspec.Struct, array_like=True, frozen=True):
    num_shards: int
    listing_crc: int
    base_world: int
    rotation: int
    first_pass: int
    base_shards: Optional[bytes]     # bitmap of the base's shards; None: all of them
    started: Optional[bytes]         # finite: bitmap of the base's shards started; None: none
    readers: int = 0                 # ranks the base was dealt over (0: all; `plan/readers.py`)


class SavedState(msgspec.Struct, frozen=True):
    version: int
    seed: int
    world_size: int
    epoch: int
    step: int
    mixture: Optional[MixtureState]
    sources: tuple[SavedSource, ...]
    # packed integer columns (`_pack`): the filtered units in read order, rows (source, rank,
    # shard, skip record, skip chunk), skip record -1: none; their extras, rows (unit, record,
    # chunk); endless sources' positions, rows (source, rank, pass, position); the pending
    # items: version 5 as rows (source, shard, record, chunk, age) in `pending`, version 6 as
    # runs (`_runs`: source, shard, first record, count - 1, chunk) in `pending_runs` and their
    # ages in `pending_ages`; version 5's columns are all int64, version 6's narrowed (`_pack`)
    units: bytes = b""
    extras: bytes = b""
    positions: bytes = b""
    pending: bytes = b""
    holding: Optional[bytes] = None
    data: Optional[DataOptions] = None
    pending_runs: bytes = b""
    pending_ages: bytes = b""


_SIZES = (1, 2, 4, 8)   # a column's bytes per value (version 6): the narrowest that holds it


def _pack(rows, width: int, delta: tuple[int, ...] = ()) -> bytes:
    """rows [n, width] of ints as zlib'd little-endian integer columns, the `delta` columns as
    differences from the row before: sorted ids become runs of small numbers, which is most of
    what makes the saved state small. Each column in the narrowest of int8/16/32/64 that holds
    it, named by a first byte per column (its size)."""
    table = np.asarray(rows, dtype=np.int64).reshape(-1, width)
    if not table.shape[0]:
        return b""
    columns = table.T.copy()
    for k in delta:
        columns[k] = np.diff(columns[k], prepend=0)
    sizes, body = [], []
    for column in columns:
        size = next(n for n in _SIZES if np.iinfo(f"<i{n}").min <= column.min()
                    and column.max() <= np.iinfo(f"<i{n}").max)
        sizes.append(size)
        body.append(column.astype(f"<i{size}").tobytes())
    return zlib.compress(bytes(sizes) + b"".join(body), 9)


def _unpack(data: bytes, width: int, delta: tuple[int, ...] = (),
            version: int = STATE_VERSION) -> np.ndarray:
    if not data:
        return np.zeros((0, width), np.int64)
    raw = zlib.decompress(data)
    if version == 5:   # every column int64
        columns = np.frombuffer(raw, dtype="<i8").reshape(width, -1).copy()
    else:
        sizes = list(raw[:width])
        if len(sizes) != width or any(n not in _SIZES for n in sizes) or \
                (len(raw) - width) % sum(sizes):
            raise ValueError(f"a packed table of {width} columns with column sizes {sizes} "
                             f"and {len(raw) - width} bytes")
        n, at, parts = (len(raw) - width) // sum(sizes), width, []
        for size in sizes:
            parts.append(np.frombuffer(raw, f"<i{size}", n, at).astype(np.int64))
            at += n * size
        columns = np.stack(parts)
    for k in delta:
        columns[k] = np.cumsum(columns[k])
    return columns.T


_UNIT_DELTA = (0, 1)          # units: source, rank, shard, skip record (-1: none), skip chunk
_EXTRA_DELTA = (0,)           # extras: unit, record, chunk
_PENDING_DELTA = (0, 1, 2)    # pending (version 5): source, shard, record, chunk, age (sorted)
_RUNS_DELTA = (0, 1, 2)       # pending runs: source, shard, first record, count - 1, chunk
_AGES_DELTA = (0,)            # pending ages, one per item in the runs' order


def _runs(pending) -> tuple[np.ndarray, np.ndarray]:
    """The sorted pending items (source, shard, record, chunk, age) as runs [n, 5] (source,
    shard, first record, count - 1, chunk) and the items' ages: the items of one shard and chunk
    at consecutive records are one run (most pending items are a shard's next records, their
    ages falling by 0 or 1 from one to the next)."""
    table = np.asarray(pending, dtype=np.int64).reshape(-1, 5)
    if not table.shape[0]:
        return np.zeros((0, 5), np.int64), np.zeros(0, np.int64)
    prev = table[:-1]
    cont = ((table[1:, [0, 1, 3]] == prev[:, [0, 1, 3]]).all(axis=1)
            & (table[1:, 2] == prev[:, 2] + 1))
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    counts = np.diff(np.append(starts, table.shape[0]))
    first = table[starts]
    return np.column_stack((first[:, :3], counts - 1, first[:, 3])), table[:, 4].copy()


def _items(runs: np.ndarray, ages: np.ndarray) -> np.ndarray:
    """`_runs` undone: the pending items [n, 5], in the order they were saved."""
    if not runs.shape[0]:
        if ages.size:
            raise ValueError(f"{ages.size} pending ages without their items")
        return np.zeros((0, 5), np.int64)
    counts = runs[:, 3] + 1
    if (counts < 1).any() or counts.sum() != ages.size:
        raise ValueError(f"pending runs of {counts.sum()} items with {ages.size} ages")
    rows = np.repeat(runs, counts, axis=0)
    offset = np.arange(rows.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.column_stack((rows[:, :2], rows[:, 2] + offset, rows[:, 4], ages))


def _bits(mask: np.ndarray) -> Optional[bytes]:
    return np.packbits(mask).tobytes() if mask.any() else None


def _base(progress: SourceProgress, seed: int, epoch: int, source_index: int,
          endless: bool) -> list[np.ndarray]:
    """The base each base rank was dealt (`layout_from_progress`'s, before any position)."""
    bits = None
    if progress.base_shards is not None:
        bits = np.unpackbits(np.frombuffer(progress.base_shards, np.uint8),
                             count=progress.num_shards).astype(bool)
    return deal_epoch(progress.num_shards, seed=seed,
                      epoch=progress.first_pass if endless else epoch,
                      source_index=source_index, world=progress.base_world,
                      endless=endless, base_shards=bits, rotation=progress.rotation,
                      readers=progress.readers)


def encode_state(state: LoaderState) -> bytes:
    endless = [False] * len(state.sources) if state.data is None else [
        s.on_exhausted == "restart" for s in state.data.sources]
    sources, units, extras, positions = [], [], [], []
    # A pending item is an extra of its shard's unit too: saved once, in `pending`.
    pending_ids = {tuple(row[:4]) for row in state.ages}
    for s, p in enumerate(state.sources):
        started = None
        if endless[s]:
            passes = list(p.passes) or [p.first_pass] * p.base_world
            for q, (pass_index, position) in enumerate(zip(passes, p.base_position)):
                positions += [s, q, pass_index, position]
        else:
            mask = np.zeros(p.num_shards, dtype=bool)
            for q, shards in enumerate(_base(p, state.seed, state.epoch, s, False)):
                mask[shards[:p.base_position[q]]] = True
            started = _bits(mask)
        for q, rank_units in enumerate(p.units):
            for u in rank_units:
                skip = (-1, 0) if u.skip_through is None else tuple(u.skip_through)
                extras += [(len(units), *e) for e in u.extras
                           if (s, u.shard, *e) not in pending_ids]   # those: from `pending`
                units.append((s, q, u.shard, *skip))
        sources.append(SavedSource(p.num_shards, p.listing_crc, p.base_world, p.rotation,
                                   p.first_pass, p.base_shards, started, p.readers))
    runs, ages = _runs(sorted(state.ages))
    saved = SavedState(STATE_VERSION, state.seed, state.world_size, state.epoch, state.step,
                       state.mixture, tuple(sources), _pack(units, 5, _UNIT_DELTA),
                       _pack(extras, 3, _EXTRA_DELTA), _pack(positions, 4),
                       b"", state.holding, state.data, _pack(runs, 5, _RUNS_DELTA),
                       _pack(ages, 1, _AGES_DELTA))
    return msgspec.json.encode(saved)


def _progress(saved: SavedState, s: int, units: list, positions: dict) -> SourceProgress:
    """A source's `SourceProgress` again, from its saved form."""
    source, endless = saved.sources[s], saved.data.sources[s].on_exhausted == "restart"
    W = source.base_world
    progress = SourceProgress(saved.data.sources[s].name, source.num_shards, source.listing_crc,
                              W, source.base_shards, (0,) * W, ((),) * W, source.first_pass,
                              (), source.rotation, source.readers)
    if endless:
        rows = [positions.get((s, q), (source.first_pass, 0)) for q in range(W)]
        base_position, passes = tuple(r[1] for r in rows), tuple(r[0] for r in rows)
    else:
        started = np.zeros(source.num_shards, dtype=bool)
        if source.started is not None:
            started = np.unpackbits(np.frombuffer(source.started, np.uint8),
                                    count=source.num_shards).astype(bool)
        base = _base(progress, saved.seed, saved.epoch, s, False)
        base_position, passes = tuple(int(started[b].sum()) for b in base), ()
    per_rank = [[] for _ in range(W)]
    for q, unit in units:
        per_rank[q].append(unit)
    return msgspec.structs.replace(progress, base_position=base_position, passes=passes,
                                   units=tuple(tuple(u) for u in per_rank))


def _from_saved(saved: SavedState) -> LoaderState:
    extras: dict[int, list] = {}
    v = saved.version
    for unit, record, chunk in _unpack(saved.extras, 3, _EXTRA_DELTA, v).tolist():
        extras.setdefault(unit, []).append((record, chunk))
    if v == 5:
        items = _unpack(saved.pending, 5, _PENDING_DELTA, v)
    else:
        items = _items(_unpack(saved.pending_runs, 5, _RUNS_DELTA),
                       _unpack(saved.pending_ages, 1, _AGES_DELTA)[:, 0])
    ages = tuple(tuple(row) for row in items.tolist())
    pending: dict[tuple[int, int], list] = {}   # (source, shard) -> its pending (record, chunk)
    for s, shard, record, chunk, _ in ages:
        pending.setdefault((s, shard), []).append((record, chunk))
    units: dict[int, list] = {}
    rows = _unpack(saved.units, 5, _UNIT_DELTA, v).tolist()
    for i, (s, q, shard, record, chunk) in enumerate(rows):
        both = extras.get(i, []) + pending.get((s, shard), [])
        units.setdefault(s, []).append(
            (q, ReadUnit(shard, None if record == -1 else (record, chunk),
                         tuple(sorted(both)))))
    positions = {(s, q): (pass_index, position) for s, q, pass_index, position
                 in _unpack(saved.positions, 4, (), v).tolist()}
    sources = tuple(_progress(saved, s, units.get(s, []), positions)
                    for s in range(len(saved.sources)))
    return LoaderState(STATE_VERSION, saved.seed, saved.world_size, saved.epoch, saved.step,
                       saved.mixture, sources, ages, saved.holding, saved.data)


def decode_state(data) -> LoaderState:
    """From bytes (JSON) or a dict (as stored by torch.distributed.checkpoint)."""
    try:
        raw = msgspec.json.decode(data) if isinstance(data, (bytes, bytearray, str)) else data
        version = raw.get("version") if isinstance(raw, dict) else None
        if not isinstance(version, int):
            raise msgspec.ValidationError(f"no integer 'version' (got {version!r})")
    except msgspec.MsgspecError as exc:
        raise ConfigError(f"loader state: not a valid streamload state: {exc}") from None
    if version < 4:
        raise ConfigError(
            f"loader state: version {version} was saved by an older streamload, which did "
            f"not record the options that decide the data (micro_batch_tokens, long_documents, "
            f"the sources' text_field, tokens_field and format, the tokenizer), so a resume "
            f"cannot be checked against them; resume it with the streamload that saved it, or "
            f"start without it", key="version")
    if version < 5:
        raise ConfigError(
            f"loader state: version {version} was saved by an older streamload, whose states "
            f"recorded every rank's position in every source (they grew with ranks x sources); "
            f"this one reads versions 5 and {STATE_VERSION} only. Resume it with the "
            f"streamload that saved it, or start without it", key="version")
    if version > STATE_VERSION:
        raise ConfigError(f"loader state: version {version} is not supported "
                          f"(this streamload writes version {STATE_VERSION})", key="version")
    try:
        saved = msgspec.convert(raw, SavedState)
    except msgspec.MsgspecError as exc:
        raise ConfigError(f"loader state: not a valid streamload state: {exc}") from None
    if saved.data is None:
        raise ConfigError(f"loader state: version {version} without its 'data' record (the "
                          f"options that decide the data); not a state written by "
                          f"Loader.state_dict()", key="data")
    if saved.sources and len(saved.data.sources) != len(saved.sources):
        raise ConfigError("loader state: not a valid streamload state: its 'data' and "
                          "'sources' list different numbers of sources")
    try:
        return _from_saved(saved)
    except (zlib.error, ValueError, IndexError) as exc:
        raise ConfigError(f"loader state: not a valid streamload state: {exc}") from None


@functools.lru_cache(maxsize=1024)
def shard_permutation(num_shards: int, seed: int, epoch: int, source_index: int) -> np.ndarray:
    """The epoch's (an endless source's pass's) shard order. Kept (read-only): every rank's
    layout, tracker and elastic resume asks for the same passes again."""
    order = np.random.default_rng([seed, epoch, source_index]).permutation(num_shards)
    order.setflags(write=False)
    return order


def deal(order: np.ndarray, world: int, rank: int, offset: int = 0) -> np.ndarray:
    """Rank `rank`'s share of `order`: every `world`-th shard from position (rank + offset) %
    world. Endless passes rotate the offset, so with fewer shards than ranks every rank gets
    shards in some passes."""
    return order[(rank + offset) % world::world]


def reads(world: int, rank: int, rotation: int, readers: int) -> bool:
    """Whether `rank` is one of the `readers` ranks from `rotation` on (0: every rank reads)."""
    return not 0 < readers < world or (rank - rotation) % world < readers


def deal_readers(order: np.ndarray, world: int, rank: int, rotation: int, shift: int,
                 readers: int) -> np.ndarray:
    """Rank `rank`'s share of `order` when only `readers` ranks from `rotation` on read it (0:
    all `world`): reader j ((rank - rotation) mod world) takes every k-th shard from (j + shift)
    mod k; other ranks none. With every rank reading this is `deal(order, world, rank,
    shift - rotation)`: the deal before readers existed."""
    k = readers if 0 < readers < world else world
    j = (rank - rotation) % world
    if j >= k:
        return order[:0]
    return order[(j + shift) % k::k]


class OneRank(Sequence):
    """A per-rank list of which one rank's entry is kept (`EpochLayout.for_rank`): O(1) in the
    world size. Asking for another rank's entry is a bug, and raises."""
    __slots__ = ("world", "rank", "value")

    def __init__(self, world: int, rank: int, value):
        self.world, self.rank, self.value = world, rank, value

    def __len__(self) -> int:
        return self.world

    def __getitem__(self, rank):
        if rank != self.rank:
            raise IndexError(f"a layout kept for rank {self.rank} was asked about rank {rank}")
        return self.value


@dataclass
class EpochLayout:
    """How one source's epoch is dealt to ranks: per rank, filtered units then base shards
    (and, for an endless source, one pass after another after that)."""
    base_world: int
    base_shards: Optional[np.ndarray]          # bool [num_shards]; None = all
    base: list[np.ndarray]                     # per base rank: shard ids in order
    base_position: list[int]                   # per base rank: base shards already started
    units: list[Sequence[ReadUnit]]            # per base rank: filtered units first (never
                                               # mutated: a rank with none may share ())
    num_shards: int
    seed: int
    source_index: int
    endless: bool = False
    passes: Optional[list[int]] = None         # endless: per base rank, the pass of its base
    first_pass: int = 0                        # endless: the pass `base_shards` refers to
    rotation: int = 0                          # the deal's first rank (`deal_epoch`)
    readers: int = 0                           # ranks dealt shards, from `rotation` (0: all)

    def for_rank(self, rank: int) -> "EpochLayout":
        """This layout as one rank sees it (`rank_units`, `stream`, `has_units` of `rank`
        only): its per-rank lists shrunk to that rank's entries, so what a rank keeps does not
        grow with the world size (`job.RankShare`)."""
        def one(values):
            return None if values is None else OneRank(self.base_world, rank, values[rank])
        return dataclasses.replace(self, base=one(self.base),
                                   base_position=one(self.base_position),
                                   units=one(self.units), passes=one(self.passes))

    def reads(self, rank: int) -> bool:
        """Whether `rank` is one of the source's readers (is dealt its shards at all)."""
        return reads(self.base_world, rank, self.rotation, self.readers)

    def has_units(self, rank: int) -> bool:
        """Whether `rank_units(rank)` has any (without building them)."""
        return bool(self.units[rank]) or self.base_position[rank] < len(self.base[rank])

    def readers_mask(self) -> np.ndarray:
        """bool [base_world]: `reads` for every rank at once."""
        if not 0 < self.readers < self.base_world:
            return np.ones(self.base_world, dtype=bool)
        return (np.arange(self.base_world) - self.rotation) % self.base_world < self.readers

    def holding_mask(self) -> np.ndarray:
        """bool [base_world]: the readers with units this epoch (`reads` and `has_units`),
        asking `has_units` of the readers only."""
        mask = self.readers_mask()
        ranks = np.flatnonzero(mask)
        mask[ranks] = np.fromiter(map(self.has_units, ranks.tolist()), bool, ranks.shape[0])
        return mask

    def rank_units(self, rank: int) -> list[ReadUnit]:
        """The filtered units and the rest of the base: the whole epoch of a finite source."""
        units, base, position = self.units[rank], self.base[rank], self.base_position[rank]
        if position >= len(base):   # most ranks of a source with few readers, at scale
            return list(units)
        return list(units) + [ReadUnit(s) for s in base[position:].tolist()]

    def pass_shards(self, rank: int, pass_index: int) -> np.ndarray:
        """An endless source's pass `pass_index` for one rank, as pass-wide shard ids."""
        order = shard_permutation(self.num_shards, self.seed, pass_index, self.source_index)
        return deal_readers(order, self.base_world, rank, self.rotation, pass_index,
                            self.readers) + pass_index * self.num_shards   # `deal_epoch`'s

    def later_passes(self, rank: int) -> Iterator[tuple[int, list[ReadUnit]]]:
        """(pass, units) for each pass after the base, without end; nothing if finite."""
        pass_index = self.passes[rank] if self.endless else 0
        while self.endless and self.reads(rank):   # a non-reader: no pass has shards for it
            pass_index += 1
            yield pass_index, [ReadUnit(int(s)) for s in self.pass_shards(rank, pass_index)]

    def stream(self, rank: int) -> Iterator[ReadUnit]:
        """Every unit this rank reads: the epoch, then (endless) all later passes."""
        yield from self.rank_units(rank)
        for _, units in self.later_passes(rank):
            yield from units


def _epoch_order(num_shards: int, seed: int, epoch: int, source_index: int, endless: bool,
                 base_shards: Optional[np.ndarray]) -> np.ndarray:
    """The shards `deal_epoch` deals, in order: the epoch's permutation (of `base_shards` only,
    when given); an endless source's as pass-wide ids."""
    order = shard_permutation(num_shards, seed, epoch, source_index)
    if base_shards is not None:
        order = order[base_shards[order]]
    if endless:
        order = order + epoch * num_shards
        order.setflags(write=False)
    return order


def deal_epoch(num_shards: int, *, seed: int, epoch: int, source_index: int, world: int,
               endless: bool, base_shards: Optional[np.ndarray] = None,
               rotation: int = 0, readers: int = 0) -> list[np.ndarray]:
    """Every rank's shards of an epoch in order: the seeded permutation (of `base_shards` only,
    when given), strided by rank, the first shard to rank `rotation`. For an endless source
    `epoch` is a pass: pass-wide shard ids, and the deal rotated by the pass too.

    Fresh layouts rotate by the source's index, so sources with fewer shards than ranks start
    on different ranks: five one-shard sources on two ranks are read 3 and 2, not 5 and 0.
    `readers` (0: all): only that many ranks from `rotation` on are dealt shards."""
    order = _epoch_order(num_shards, seed, epoch, source_index, endless, base_shards)
    shift = epoch if endless else 0
    k = readers if 0 < readers < world else world
    # `deal_readers` for every rank at once: reader j is rank (rotation + j) % world, the others
    # get none (a loop over the k readers only: one over every rank took 1.6 s at R=4,096, S=300)
    out = [order[:0]] * world
    for j in range(k):
        out[(rotation + j) % world] = order[(j + shift) % k::k]
    return out


def fresh_holders(num_shards: int, world: int, readers: int, endless: bool) -> int:
    """How many ranks a fresh layout deals shards to (`holding_mask().sum()`, every reader for
    an endless source), without dealing: reader j gets shards j, j + k, ... (j < k readers)."""
    k = readers if 0 < readers < world else world
    return k if endless else min(k, num_shards)


def fresh_layout(num_shards: int, *, seed: int, epoch: int, source_index: int,
                 world: int, base_shards: Optional[np.ndarray] = None,
                 endless: bool = False, rotation: Optional[int] = None,
                 readers: int = 0, rank: Optional[int] = None) -> EpochLayout:
    """A fresh epoch; for an endless source, `epoch` is the pass its base deals. `rotation`:
    the deal's first rank (default: the source's index, modulo the world); `readers`: the
    ranks dealt shards, from `rotation` on (0 or >= world: all). `rank`: that rank's deal only
    (`EpochLayout.for_rank`), without dealing the others."""
    rotation = source_index % world if rotation is None else rotation
    readers = 0 if readers >= world else readers
    if rank is None:
        base = deal_epoch(num_shards, seed=seed, epoch=epoch, source_index=source_index,
                          world=world, endless=endless, base_shards=base_shards,
                          rotation=rotation, readers=readers)
        per_rank = [0] * world, [()] * world, [epoch] * world if endless else None
    else:
        order = _epoch_order(num_shards, seed, epoch, source_index, endless, base_shards)
        base = OneRank(world, rank, deal_readers(order, world, rank, rotation,
                                                 epoch if endless else 0, readers))
        per_rank = (OneRank(world, rank, 0), OneRank(world, rank, ()),
                    OneRank(world, rank, epoch) if endless else None)
    position, units, passes = per_rank
    return EpochLayout(world, base_shards, base, position, units, num_shards, seed,
                       source_index, endless, passes, epoch if endless else 0, rotation, readers)


def _deal_units(pooled: list, layout: EpochLayout) -> list[list]:
    """Units pooled from an earlier deal, dealt again over `layout`'s readers (round-robin;
    every rank, when every rank reads)."""
    world = layout.base_world
    if not layout.readers:
        return [pooled[r::world] for r in range(world)]
    k = layout.readers
    return [pooled[(r - layout.rotation) % world::k] if layout.reads(r) else ()
            for r in range(world)]


def redeals(progress: SourceProgress, world: int, rotation: Optional[int] = None,
            readers: Optional[int] = None) -> bool:
    """Whether `layout_from_progress` deals what is left again (another world size, another
    first reader or another reader count than the state was saved with), rather than
    continuing every rank's saved stream."""
    readers = None if readers is None else (0 if readers >= world else readers)
    saved_readers = 0 if progress.readers >= progress.base_world else progress.readers
    return not (world == progress.base_world and rotation in (None, progress.rotation)
                and readers in (None, saved_readers))


def layout_from_progress(progress: SourceProgress, *, seed: int, epoch: int, source_index: int,
                         world: int, endless: bool = False, rotation: Optional[int] = None,
                         readers: Optional[int] = None) -> EpochLayout:
    """The rest of an epoch (an endless source: the rest of its stream), dealt to `world` ranks
    (to `readers` of them from `rotation` on, when given). At the saved world size with the
    saved readers, every rank's exact stream; else what is left, pooled and dealt again."""
    saved = _saved_layout(progress, seed=seed, epoch=epoch, source_index=source_index,
                          endless=endless)
    if not redeals(progress, world, rotation, readers):
        return saved
    readers = 0 if readers is None or readers >= world else readers
    if endless:
        # Elastic: what each rank has left of every pass up to the furthest one becomes units,
        # dealt again; the next pass starts fresh for the new world.
        top = max(saved.passes)
        pooled = []
        for q in range(saved.base_world):
            pooled += saved.rank_units(q)
            pooled += [ReadUnit(int(s)) for p in range(saved.passes[q] + 1, top + 1)
                       for s in saved.pass_shards(q, p)]
        layout = fresh_layout(progress.num_shards, seed=seed, epoch=top + 1,
                              source_index=source_index, world=world, endless=True,
                              rotation=rotation, readers=readers)
        layout.units = _deal_units(pooled, layout)
        return layout
    # Elastic: pool what is left and deal it again. Untouched shards keep the epoch's order.
    untouched, pooled = _left_over(saved)
    layout = fresh_layout(progress.num_shards, seed=seed, epoch=epoch, source_index=source_index,
                          world=world, base_shards=untouched, rotation=rotation,
                          readers=readers)
    layout.units = _deal_units(pooled, layout)
    return layout


def dealt_again_holding(progress: SourceProgress, *, seed: int, epoch: int, source_index: int,
                        world: int, rotation: int, readers: int) -> np.ndarray:
    """bool [world]: `layout_from_progress(...).holding_mask()` for a finite source whose saved
    deal it deals again (`redeals`), without dealing: reader j gets untouched shards j, j + k,
    ... and pooled units j, j + k, ... (units by rank, not reader, when every rank reads)."""
    untouched, pooled = _left_over(_saved_layout(progress, seed=seed, epoch=epoch,
                                                 source_index=source_index, endless=False))
    readers = 0 if readers >= world else readers
    k = readers or world
    ranks = np.arange(world)
    reader = (ranks - rotation) % world
    units_at = reader if readers else ranks
    return (reader < k) & ((reader < int(untouched.sum())) | (units_at < len(pooled)))


def _left_over(saved: EpochLayout) -> tuple[np.ndarray, list]:
    """A finite epoch's rest, pooled from its saved deal: the untouched shards (bool
    [num_shards]) and the filtered units, rank after rank."""
    untouched = np.zeros(saved.num_shards, dtype=bool)
    for q in range(saved.base_world):
        untouched[saved.base[q][saved.base_position[q]:]] = True
    return untouched, [unit for q in range(saved.base_world) for unit in saved.units[q]]


def _saved_layout(progress: SourceProgress, *, seed: int, epoch: int, source_index: int,
                  endless: bool) -> EpochLayout:
    """Every rank's rest of the epoch (stream) at the world size it was saved at."""
    bits = None
    if progress.base_shards is not None:
        bits = np.unpackbits(np.frombuffer(progress.base_shards, np.uint8),
                             count=progress.num_shards).astype(bool)
    saved = fresh_layout(progress.num_shards, seed=seed,
                         epoch=progress.first_pass if endless else epoch,
                         source_index=source_index, world=progress.base_world, base_shards=bits,
                         endless=endless, rotation=progress.rotation,
                         readers=progress.readers)
    saved.base_position = list(progress.base_position)
    saved.units = list(progress.units)   # tuples: never mutated
    if endless:
        saved.passes = list(progress.passes) or [progress.first_pass] * progress.base_world
        for q, pass_index in enumerate(saved.passes):
            if pass_index != progress.first_pass:
                saved.base[q] = saved.pass_shards(q, pass_index)
    return saved


@dataclass
class RankProgress:
    frontier_unit: int = -1                       # index into rank_units; -1: nothing offered
    frontier: tuple[int, int] = (-1, -1)          # (record, chunk) of the furthest offered item
    pending: np.ndarray = field(default_factory=lambda: _NO_PENDING)
    # rows: shard, record, chunk, age (as it will be when offered again); never mutated


_NO_PENDING = np.zeros((0, 4), np.int64)
_NO_PENDING.setflags(write=False)
_NOT_STARTED = RankProgress()
COMPACT_LAG = 64    # steps of states an endless tracker keeps what they need for, at the least
COMPACT_MIN = 256   # units dropped at once, at the least


class SourceTracker:
    """Follows one source's epoch on every rank, from the windows and the plans. For an endless
    source it extends each rank's unit list pass by pass as the windows reach them, and drops the
    units that no state can need any more (see `_compact`), so a long run's tracker stays small.
    Unit indices are absolute: `unit_lists[q][0]` is unit `offsets[q]` of rank q."""

    def __init__(self, layout: EpochLayout, states_in_flight: int = 0):
        """`states_in_flight`: how many steps old a state that is still asked for can be (the
        batches queued ahead of the trainer, and the one it holds)."""
        self.layout = layout
        # A rank that is dealt nothing, and never will be (finite, or not a reader), shares one
        # empty tuple: at thousands of ranks and few readers per source, allocating a list for
        # each costs more in garbage collection than everything else here.
        self.unit_lists = [layout.rank_units(q) if layout.has_units(q)
                           or (layout.endless and layout.reads(q)) else ()
                           for q in range(layout.base_world)]
        self.offsets = [0] * layout.base_world
        # Per rank, the lowest unit each of the last `lag` states still needs.
        self.lag = max(COMPACT_LAG, 2 * states_in_flight)
        # (made when a rank is first compacted: an endless source's readers only)
        self.needed: dict[int, deque] = {}
        # Per rank: (first unit index, pass, base position there) of each stretch of base units.
        # (The first stretch of every rank as arrays; a rank's list once it changes.)
        world = layout.base_world
        self._first_stretch = (
            np.fromiter(map(len, layout.units), np.int64, world),
            np.asarray(layout.passes if layout.endless else [0] * world, np.int64),
            np.asarray(layout.base_position, np.int64))
        self._stretches: dict[int, list] = {}
        # Per rank, its later passes (endless), made when the rank first reaches one.
        self.later: dict[int, Iterator[tuple[int, list[ReadUnit]]]] = {}
        self.unit_index = {}
        for q in range(layout.base_world):
            if self.unit_lists[q]:
                self._index(q, 0)
        # Progress objects are replaced, never mutated, so the ranks start sharing one.
        self.ranks = [_NOT_STARTED] * layout.base_world

    def stretches(self, rank: int) -> list[tuple[int, int, int]]:
        """(first unit index, pass, base position there) of each stretch of `rank`'s base
        units (an endless rank has one per pass it reached)."""
        mine = self._stretches.get(rank)
        if mine is not None:
            return mine
        units, passes, positions = self._first_stretch
        return [(int(units[rank]), int(passes[rank]), int(positions[rank]))]

    def _own_stretches(self, rank: int) -> list[tuple[int, int, int]]:
        if rank not in self._stretches:
            self._stretches[rank] = self.stretches(rank)
        return self._stretches[rank]

    def _index(self, rank: int, start: int) -> None:
        offset = self.offsets[rank]
        for i, unit in enumerate(self.unit_lists[rank][start - offset:], start):
            self.unit_index[unit.shard] = (rank, i)

    def _locate(self, rank: int, shard: int) -> tuple[int, int]:
        while shard not in self.unit_index:   # an endless rank reached its next pass
            if rank not in self.later:
                self.later[rank] = self.layout.later_passes(rank)
            pass_index, units = next(self.later[rank])
            start = self.offsets[rank] + len(self.unit_lists[rank])
            self._own_stretches(rank).append((start, pass_index, 0))
            self.unit_lists[rank].extend(units)
            self._index(rank, start)
        return self.unit_index[shard]

    def _compact(self, rank: int, progress: "RankProgress") -> None:
        """Drop an endless rank's units below what any recent state needs. A state needs the
        units from the lowest one holding a pending item (or its frontier) on; the states still
        in flight (batches queued or held, each with its snapshot) are the last few, so units
        below what the last `lag` states needed are dropped, in runs of COMPACT_MIN."""
        pending = [self.unit_index[s][1] for s in set(progress.pending[:, 0].tolist())]
        needed = self.needed.get(rank)
        if needed is None:
            needed = self.needed[rank] = deque(maxlen=self.lag)
        needed.append(min(pending + [progress.frontier_unit]))
        floor = min(needed)
        if len(needed) < self.lag or floor - self.offsets[rank] < COMPACT_MIN:
            return
        cut = floor - self.offsets[rank]
        for unit in self.unit_lists[rank][:cut]:
            del self.unit_index[unit.shard]
        del self.unit_lists[rank][:cut]
        self.offsets[rank] = floor
        stretches = self._own_stretches(rank)
        first = max((k for k, stretch in enumerate(stretches) if stretch[0] <= floor), default=0)
        del stretches[:first]

    def observe(self, rank: int, ids: np.ndarray, ages: np.ndarray, taken: np.ndarray) -> None:
        """Rank `rank` offered window `ids` (n x 3, in order); `taken` marks what the plan took."""
        if ids.shape[0] == 0:
            return
        shard, record, chunk = (int(v) for v in ids[-1])
        q, unit = self._locate(rank, shard)
        assert q == rank, "a window item outside its rank's units"
        # The frontier only moves forward: a window can end before an item an earlier window
        # offered (and the plan took), when only untaken items are left before the marker.
        previous = self.ranks[rank]
        frontier = max((unit, (record, chunk)), (previous.frontier_unit, previous.frontier))
        left = ~taken
        pending = np.concatenate([ids[left], (ages[left] + 1)[:, None]], axis=1).astype(np.int64)
        end = (unit, (record, chunk))
        if previous.pending.shape[0] and (previous.frontier_unit, previous.frontier) > end:
            # Windows are prefixes of the buffer. An item an earlier, deeper window offered
            # and the plans left, that this window (shrunk: a schedule lowered the share) no
            # longer reaches, lies after this window's last item and is still pending, its age
            # unchanged; else it would count as delivered (it lies before the frontier) and a
            # resume would lose it. (Rows before that end are this window's business: taken,
            # or offered again, or the rest of a cut item under its new offset.) Pending items
            # lie before the last frontier, so only a window ending before it (the shrunk one)
            # can have any beyond it: on other steps this costs one comparison.
            beyond = [row for row in previous.pending.tolist()
                      if (self._locate(rank, row[0])[1], (row[1], row[2])) > end]
            if beyond:
                pending = np.concatenate([pending, np.asarray(beyond, np.int64)])
        self.ranks[rank] = RankProgress(frontier[0], frontier[1], pending)
        if self.layout.endless:
            self._compact(rank, self.ranks[rank])

    def snapshot(self) -> tuple["SourceTracker", tuple[RankProgress, ...]]:
        """Cheap, per step: the progress objects are replaced, never mutated."""
        return self, tuple(self.ranks)

    def progress(self, ranks: tuple[RankProgress, ...], name: str, listing_crc: int,
                 num_shards: int) -> tuple[SourceProgress, list]:
        """The remaining epoch as SourceProgress, and the pending items' ages."""
        layout = self.layout
        positions, passes, all_units, ages = [], [], [], []
        for q, p in enumerate(ranks):
            units, offset = self.unit_lists[q], self.offsets[q]
            filtered = len(layout.units[q])
            _, pass_index, position = self.stretches(q)[0]
            if p.frontier_unit < 0:
                positions.append(position)
                passes.append(pass_index)
                all_units.append(tuple(layout.units[q]))
                continue
            pending_by_shard: dict[int, list[tuple[int, int]]] = {}
            for shard, record, chunk, age in p.pending.tolist():
                pending_by_shard.setdefault(shard, []).append((record, chunk))
                ages.append((shard, record, chunk, age))
            remaining = []
            assert p.frontier_unit >= offset, "a state older than the tracker keeps"
            for i, unit in enumerate(units[:p.frontier_unit + 1 - offset], offset):
                extras = pending_by_shard.get(unit.shard, [])
                if i < p.frontier_unit:
                    if extras:
                        remaining.append(ReadUnit(unit.shard, _END, tuple(sorted(extras))))
                    continue
                skip = p.frontier if unit.skip_through is None else max(tuple(unit.skip_through), p.frontier)
                later = [tuple(e) for e in unit.extras if tuple(e) > p.frontier]
                remaining.append(ReadUnit(unit.shard, skip, tuple(sorted(set(extras + later)))))
            remaining += units[p.frontier_unit + 1 - offset:max(filtered - offset, 0)]
            if p.frontier_unit >= filtered:   # the frontier is inside the base (or a later pass)
                start, pass_index, position = next(
                    stretch for stretch in reversed(self.stretches(q))
                    if stretch[0] <= p.frontier_unit)
                position += p.frontier_unit - start + 1
            positions.append(position)
            passes.append(pass_index)
            all_units.append(tuple(remaining))
        bits = None if layout.base_shards is None else np.packbits(layout.base_shards).tobytes()
        endless = ({"first_pass": layout.first_pass, "passes": tuple(passes)}
                   if layout.endless else {})
        return SourceProgress(name, num_shards, listing_crc, layout.base_world, bits,
                              tuple(positions), tuple(all_units), **endless,
                              rotation=layout.rotation, readers=layout.readers), ages
