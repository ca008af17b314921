"""Reading one LitData chunk: the plan `open` makes from its header (items, token blocks,
frames, or the whole chunk: `plan_chunk`), the stream that decodes the planned ranges
(`LitdataStream`), and lengths from the offsets alone (`index_lengths`).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import zstandard

from ...storage.base import ObjectInfo, ObjectStore
from ...tokenizer import TextTokenizer
from ..base import (BadShard, MissingField, PlannedStream, Problems, RawRecord, Records,
                    column_dtype, field_hint, read_exact)
from ..tokens import plan_groups
from .index import Chunk
from .layouts import BadRecord, Decoder, Layout, Truncated, inflate


_ARROW_MAGIC = b"LDARW01\0"


_FRAMED_MAGIC = b"LDFZ01\0\0"


_FRAMED_PREFIX = struct.Struct("<8sHHIII")   # magic, version, flags, items, frame rows, frames


_FRAME_ENTRY = struct.Struct("<IIQII")       # first item, items, file offset, length, raw length


@dataclass
class _Plan:
    """What `open` learned about one chunk: its ranges and how each decodes."""
    mode: str                      # "items", "blocks", "frames", "whole", "arrow"
    ranges: list[tuple[int, int]] = field(default_factory=list)
    groups: list[tuple[int, int]] = field(default_factory=list)   # per range: [first, end)
    offsets: Optional[np.ndarray] = None    # item file offsets ("items"), logical ("frames")
    frames: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    items: int = 0                 # records of the chunk
    empty_items: bool = False      # TokensLoader items, all empty: records without ranges


class LitdataStream(PlannedStream):
    """Decodes one chunk's planned ranges, in order."""

    def __init__(self, plan: _Plan, layout: Layout, *, problems: Problems, expected_items: int,
                 dim: Optional[int]):
        super().__init__(problems)
        self._plan, self._layout = plan, layout
        self._ranges = plan.ranges
        self._decoder = Decoder(layout)
        self._expected_items, self._dim = expected_items, dim
        self._finished = False

    def _record_spans(self) -> Optional[list[tuple[int, int]]]:
        # Item and block ranges decode on their own; frames and whole chunks are kept.
        return self._plan.groups if self._plan.mode in ("items", "blocks") else None

    def decode(self, chunk: bytes) -> list[RawRecord]:
        return self.decode_columns(chunk).widened(self._decoder.out_dtype).to_list()

    def decode_columns(self, chunk: bytes) -> Records:
        """Token blocks as offsets over the range's buffer (a view when the dtype is the one
        batches carry); uncompressed PyTree items (`_item_columns`) and an Arrow footer's
        texts without nulls (`_arrow_rows`) as columns too; the other records (frames,
        compressed or TokensLoader items, Arrow token lists) gathered (`Records.of`)."""
        if self._failed:
            return Records.empty()
        plan = self._plan
        k = self._next_range()
        start, end = plan.ranges[k]
        first, stop = plan.groups[k]
        if len(chunk) != end - start:
            self._shard_error(f"expected {end - start} bytes at {start}..{end}, got "
                              f"{len(chunk)}; the chunk is truncated")
            return Records.empty()
        view = memoryview(chunk)
        try:
            if plan.mode == "items":
                return self._item_columns(first, chunk,
                                          plan.offsets[first:stop + 1] - plan.offsets[first])
            if plan.mode == "blocks":
                return self._blocks(first, stop, chunk)
            if plan.mode == "frames":
                return Records.of(self._frames(first, stop, view, start))
            if plan.mode == "whole":
                return self._whole(chunk)
            return self._arrow(chunk)
        except BadShard as exc:
            self._shard_error(str(exc), skippable=not isinstance(exc, MissingField))
            return Records.empty()

    def finish(self) -> list[RawRecord]:
        if self._finished or self._failed:
            return []
        self._finished = True
        if self._plan.empty_items:   # no token bytes at all: every written item is empty
            empty = np.empty(0, self._decoder.out_dtype)
            return [RawRecord(i, empty) for i in range(self._plan.items)]
        return []

    # -- the layouts

    def _items(self, first: int, data: bytes, bounds: np.ndarray) -> list[RawRecord]:
        """Records first.. from `data`, item k being data[bounds[k]:bounds[k + 1]]."""
        decoder = self._decoder
        if decoder.inflate is None and not self._layout.tokens_loader:
            data = data if isinstance(data, bytes) else bytes(data)
            return self._payloads(first, data, *decoder.spans(data, bounds))
        records = []
        view = memoryview(data)
        edges = bounds.tolist()
        for k in range(len(edges) - 1):
            try:
                records.append(RawRecord(first + k, decoder.item(view[edges[k]:edges[k + 1]])))
            except BadRecord as exc:
                self._record_error(first + k, str(exc))
        return records

    def _item_columns(self, first: int, data: bytes, bounds: np.ndarray) -> Records:
        """`_items` as columns: uncompressed PyTree items read at once (`Decoder.columns`)
        when none is bad, else item by item."""
        decoder = self._decoder
        if decoder.inflate is not None or self._layout.tokens_loader:
            return Records.of(self._items(first, data, bounds))
        data = data if isinstance(data, bytes) else bytes(data)
        begin, end, errors = decoder.spans(data, bounds)
        records = None if errors else decoder.columns(data, begin, end, first)
        if records is None:
            records = Records.of(self._payloads(first, data, begin, end, errors))
        return records

    def _payloads(self, first: int, data: bytes, begin: np.ndarray, end: np.ndarray,
                  errors: dict) -> list[RawRecord]:
        """Records first.. from the leaves data[begin[k]:end[k]] (`Decoder.spans`), item by
        item: the items in `errors` and those whose leaf is not valid UTF-8 or ids are
        reported and left out."""
        records = []
        tokens = self._decoder.tokens if self._layout.want_tokens else None
        name = self._layout.field_name
        for k, (lo, hi) in enumerate(zip(begin.tolist(), end.tolist())):
            if k in errors:
                self._record_error(first + k, errors[k])
                continue
            try:
                if tokens is not None:
                    payload = tokens(data[lo:hi])
                else:
                    try:
                        payload = data[lo:hi].decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise BadRecord(f"field {name!r} is not valid UTF-8: {exc}") from None
            except BadRecord as exc:
                self._record_error(first + k, str(exc))
                continue
            records.append(RawRecord(first + k, payload))
        return records

    def _blocks(self, first: int, stop: int, chunk: bytes) -> Records:
        size = self._layout.block_size
        tokens = np.frombuffer(chunk, self._layout.dtype).astype(
            column_dtype(self._layout.dtype, self._decoder.out_dtype), copy=False)
        blocks = tokens.reshape(stop - first, size)
        negative = (np.flatnonzero(blocks.min(axis=1) < 0).tolist()
                    if self._layout.dtype.kind == "i" and blocks.size else [])
        for b in negative:
            self._record_error(first + b, "negative token id")
        records = Records(np.arange(first, stop, dtype=np.int64), tokens=tokens,
                          offsets=np.arange(stop - first + 1, dtype=np.int64) * size)
        if negative:
            keep = np.ones(stop - first, bool)
            keep[negative] = False
            records = records.select(keep)
        return records

    def _frames(self, first: int, stop: int, view: memoryview, start: int) -> list[RawRecord]:
        records = []
        offsets = self._plan.offsets
        dctx = zstandard.ZstdDecompressor()
        for f in range(first, stop):
            item0, n_items, offset, length, raw_length = self._plan.frames[f]
            data = view[offset - start:offset - start + length]
            try:
                raw = inflate(dctx, data)
            except (zstandard.ZstdError, Truncated) as exc:
                raise BadShard(f"corrupt zstd frame {f}: {exc}") from None
            if len(raw) != raw_length:
                raise BadShard(f"zstd frame {f} inflated to {len(raw)} bytes, its table "
                                f"says {raw_length}")
            base = int(offsets[item0])
            if int(offsets[item0 + n_items]) - base != raw_length:
                raise BadShard(f"zstd frame {f} holds {raw_length} bytes but its items' "
                                f"offsets span {int(offsets[item0 + n_items]) - base}")
            records += self._items(item0, raw, offsets[item0:item0 + n_items + 1] - base)
        return records

    def _whole(self, chunk: bytes) -> Records:
        """A whole-file compressed chunk: inflate, then read it as an uncompressed one."""
        try:
            data = inflate(zstandard.ZstdDecompressor(), chunk)
        except (zstandard.ZstdError, Truncated) as exc:
            raise BadShard(f"corrupt zstd chunk: {exc}") from None
        n, offsets = _parse_header(data, len(data), self._expected_items)
        if self._layout.tokens_loader:
            _check_token_bytes(offsets, self._layout.dtype, self._dim)
            if self._layout.block_size:
                size = self._layout.block_size
                n_blocks = (int(offsets[-1] - offsets[0]) // self._layout.dtype.itemsize) // size
                end = int(offsets[0]) + n_blocks * size * self._layout.dtype.itemsize
                return self._blocks(0, n_blocks, data[int(offsets[0]):end])
        elif n and offsets[-1] == offsets[0] and len(data) > offsets[-1]:
            return self._arrow_rows(memoryview(data)[:], n)
        return self._item_columns(0, data, offsets)

    def _arrow(self, chunk: bytes) -> Records:
        return self._arrow_rows(memoryview(chunk), self._plan.items, footer=False)

    def _arrow_rows(self, view: memoryview, n: int, footer: bool = True) -> Records:
        """Rows from an Arrow IPC footer: `view` ends with it (footer=True) or is its IPC;
        texts without nulls as one list, other rows one by one (nulls and negative ids
        reported)."""
        if footer:
            view = view[_footer_span(view, len(view))[0]:len(view) - 12]
        try:
            import pyarrow as pa
        except ImportError:
            raise BadShard("this chunk keeps its rows in an Arrow IPC footer; reading it "
                            "needs pyarrow") from None
        try:
            buffer = pa.py_buffer(view)
            reader = (pa.ipc.open_file(buffer) if bytes(view[:6]) == b"ARROW1"
                      else pa.ipc.open_stream(buffer))
            table = reader.read_all()
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise BadShard(f"unreadable Arrow footer: {exc}") from None
        if table.num_rows != n:
            raise BadShard(f"its Arrow footer holds {table.num_rows} rows, the chunk "
                            f"{n} items")
        name = self._layout.field_name
        if name not in table.column_names:
            fields = ", ".join(f"{f.name} ({f.type})" for f in table.schema)
            option = "tokens_field" if self._layout.want_tokens else "text_field"
            raise MissingField(f"field {name!r} is not in the chunk's Arrow rows; they have: "
                               f"{fields}{field_hint(option, name, table.column_names)}")
        column = table.column(name).combine_chunks()
        kind = column.type
        records = []
        if not self._layout.want_tokens:
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise BadShard(f"field {name!r} holds {kind}, not text")
            texts = column.to_pylist()
            if not column.null_count:
                return Records(np.arange(n, dtype=np.int64), texts=texts)
            for i, text in enumerate(texts):
                if text is None:
                    self._record_error(i, f"field {name!r} is null")
                else:
                    records.append(RawRecord(i, text))
            return Records.of(records)
        # list<null>: Arrow's type for a chunk whose lists are all empty
        if not ((pa.types.is_list(kind) or pa.types.is_large_list(kind))
                and (pa.types.is_integer(kind.value_type) or pa.types.is_null(kind.value_type))):
            raise BadShard(f"field {name!r} holds {kind}, not a list of integer token ids")
        offsets = column.offsets.to_numpy()
        values = (column.values.to_numpy(zero_copy_only=False)
                  if pa.types.is_integer(kind.value_type) else np.zeros(0, np.int64))
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        for i in range(n):
            if not valid[i]:
                self._record_error(i, f"field {name!r} is null")
                continue
            if offsets[i + 1] > offsets[i] and not values.size:
                self._record_error(i, f"field {name!r} holds null token ids")
                continue
            ids = values[offsets[i]:offsets[i + 1]].copy()
            if ids.size and ids.min() < 0:
                self._record_error(i, "negative token id")
                continue
            records.append(RawRecord(i, ids))
        return Records.of(records)


    # -- errors


def _parse_header(data, size: int, expected: int) -> tuple[int, np.ndarray]:
    """(items, item offsets) from a chunk's first bytes; checks them against the index."""
    if len(data) < 4:
        raise BadShard(f"the chunk holds {len(data)} bytes, too few for its header")
    n = struct.unpack_from("<I", data, 0)[0]
    if bytes(data[:8]) == _FRAMED_MAGIC:
        raise BadShard("the chunk is framed zstd (LDFZ01) but index.json does not say "
                        "compression_level='batch'")
    if n != expected:
        raise BadShard(f"the chunk's header counts {n} items, index.json {expected}")
    header = 4 + 4 * (n + 1)
    if len(data) < header:
        raise BadShard(f"the chunk is truncated inside its offsets table ({len(data)} of "
                        f"{header} bytes)")
    offsets = np.frombuffer(data, "<u4", n + 1, 4).astype(np.int64)
    if offsets[0] != header or (n and np.diff(offsets).min() < 0) or offsets[-1] > size:
        raise BadShard(f"the chunk's item offsets are corrupt (first {int(offsets[0])}, "
                        f"expected {header}; last {int(offsets[-1])} of {size} bytes)")
    return n, offsets


def _check_token_bytes(offsets: np.ndarray, dtype: np.dtype, dim: Optional[int]) -> None:
    data_bytes = int(offsets[-1] - offsets[0])
    if dim is not None and data_bytes != dim * dtype.itemsize:
        raise BadShard(f"the chunk holds {data_bytes} bytes of tokens; index.json's dim "
                        f"says {dim} tokens of {dtype.itemsize} bytes")


def _footer_span(tail, size: int) -> tuple[int, int]:
    """(start, end) of the Arrow IPC bytes, from the object's last 12 bytes (`tail`)."""
    tail = bytes(tail[-12:])
    if len(tail) < 12 or tail[-8:] != _ARROW_MAGIC:
        raise BadShard("the chunk's items are empty and it has no Arrow row footer "
                        "(LDARW01); it is truncated or corrupt")
    length = struct.unpack_from("<I", tail, 0)[0]
    start = size - 12 - length
    if length <= 0 or start < 0:
        raise BadShard(f"the chunk's Arrow footer length {length} is corrupt")
    return start, size - 12


def _byte_groups(offsets: np.ndarray, chunk_bytes: int) -> list[tuple[int, int]]:
    """Runs [first, end) of consecutive items of about `chunk_bytes` (a longer item alone)."""
    return plan_groups(offsets - offsets[0], max(1, chunk_bytes))


async def _read_header(store: ObjectStore, shard: ObjectInfo, chunk: Chunk) -> np.ndarray:
    header = 4 + 4 * (chunk.items + 1)
    if shard.size < header:
        raise BadShard(f"the chunk holds {shard.size} bytes, fewer than its {header}-byte "
                        f"header for {chunk.items} items")
    data = await read_exact(store, shard.uri, 0, header, "the chunk")
    return _parse_header(data, shard.size, chunk.items)[1]


async def _read_frames(store: ObjectStore, shard: ObjectInfo, layout: Layout,
                       chunk: Chunk) -> tuple[np.ndarray, list]:
    """The framed-zstd directory: logical item offsets and the frame table."""
    n = chunk.items
    rows = layout.frame_rows
    for _ in range(2):   # the frame size from the config; read again if the chunk says other
        n_frames = -(-n // rows)
        end = _FRAMED_PREFIX.size + 4 * (n + 1) + _FRAME_ENTRY.size * n_frames
        data = await read_exact(store, shard.uri, 0, min(end, shard.size), "the chunk")
        if len(data) < _FRAMED_PREFIX.size or data[:8] != _FRAMED_MAGIC:
            raise BadShard("index.json says compression_level='batch' but the chunk has no "
                            "LDFZ01 framed-zstd header")
        _magic, version, _flags, items, frame_rows, frames = _FRAMED_PREFIX.unpack_from(data)
        if version != 1:
            raise BadShard(f"framed zstd version {version} is not supported")
        if items != n:
            raise BadShard(f"the chunk's header counts {items} items, index.json {n}")
        if frame_rows != rows and frame_rows > 0:
            rows = frame_rows
            continue
        if frames != n_frames or len(data) < end:
            raise BadShard(f"the framed zstd header is corrupt ({frames} frames for {n} items "
                            f"of {frame_rows} per frame, {len(data)} header bytes)")
        offsets = np.frombuffer(data, "<u4", n + 1, _FRAMED_PREFIX.size).astype(np.int64)
        table = [_FRAME_ENTRY.unpack_from(data, _FRAMED_PREFIX.size + 4 * (n + 1)
                                          + _FRAME_ENTRY.size * f) for f in range(frames)]
        position, covered = end, 0
        for f, (first, count, offset, length, raw) in enumerate(table):
            if first != covered or count < 1 or offset != position or length < 1 \
                    or offset + length > shard.size \
                    or offsets[first + count] - offsets[first] != raw:
                raise BadShard(f"the framed zstd frame table is corrupt at frame {f}")
            position, covered = offset + length, first + count
        if covered != n or offsets[0] != 0 or (n and np.diff(offsets).min() < 0):
            raise BadShard("the framed zstd offsets are corrupt")
        return offsets, table
    raise BadShard("the framed zstd header is corrupt")


async def plan_chunk(store: ObjectStore, shard: ObjectInfo, layout: Layout, chunk: Chunk,
                      chunk_bytes: int) -> _Plan:
    """Read what the chunk needs to plan its reads (header, frame table, footer length)."""
    if chunk.items == 0:
        return _Plan("items", items=0)
    if layout.whole_file:
        return _Plan("whole", [(0, shard.size)], [(0, chunk.items)], items=chunk.items)
    if layout.level == "batch":
        offsets, frames = await _read_frames(store, shard, layout, chunk)
        groups, first, size = [], 0, 0
        for f, frame in enumerate(frames):
            if f > first and size + frame[3] > chunk_bytes:
                groups.append((first, f))
                first, size = f, 0
            size += frame[3]
        groups.append((first, len(frames)))
        ranges = [(frames[a][2], frames[b - 1][2] + frames[b - 1][3]) for a, b in groups]
        return _Plan("frames", ranges, groups, offsets, frames, items=chunk.items)
    offsets = await _read_header(store, shard, chunk)
    n = chunk.items
    if layout.tokens_loader:
        _check_token_bytes(offsets, layout.dtype, chunk.dim)
        itemsize = layout.dtype.itemsize
        if layout.block_size:
            n_tokens = int(offsets[-1] - offsets[0]) // itemsize
            n_blocks = n_tokens // layout.block_size
            block_bytes = layout.block_size * itemsize
            per_range = max(1, chunk_bytes // block_bytes)
            groups = [(b, min(b + per_range, n_blocks)) for b in range(0, n_blocks, per_range)]
            base = int(offsets[0])
            return _Plan("blocks", [(base + a * block_bytes, base + b * block_bytes)
                                    for a, b in groups], groups, items=n_blocks)
        if offsets[-1] == offsets[0]:
            return _Plan("items", items=n, empty_items=True)
    elif offsets[-1] == offsets[0]:
        # Every item empty: the rows live in an Arrow IPC footer at the end of the chunk.
        tail = await read_exact(store, shard.uri, shard.size - 12, shard.size, "the chunk") \
            if shard.size >= int(offsets[-1]) + 12 else b""
        start, end = _footer_span(tail, shard.size)
        if start < offsets[-1]:
            raise BadShard("the chunk's Arrow footer overlaps its header")
        return _Plan("arrow", [(start, end)], [(0, n)], items=n)
    groups = _byte_groups(offsets, chunk_bytes)
    ranges = [(int(offsets[a]), int(offsets[b])) for a, b in groups]
    return _Plan("items", ranges, groups, offsets, items=n)


async def index_lengths(store: ObjectStore, shard: ObjectInfo, layout: Layout, chunk: Chunk,
                         tokenizer: TextTokenizer | None) -> Optional[np.ndarray]:
    """The chunk's record lengths from index.json and its offsets, or None: scan instead."""
    if layout.tokens_loader and layout.block_size and chunk.dim is not None:
        return np.full(chunk.dim // layout.block_size, layout.block_size, np.int64)
    if layout.whole_file or layout.level == "sample" or chunk.items == 0:
        return None
    if layout.dtype is None and (tokenizer is not None or layout.want_tokens):
        return None   # texts measured by a tokenizer; token lists in Arrow rows
    if layout.tokens_loader:
        if layout.level == "batch":
            return None
        offsets = await _read_header(store, shard, chunk)
        _check_token_bytes(offsets, layout.dtype, chunk.dim)
        sizes = np.diff(offsets)
        if (sizes % layout.dtype.itemsize).any():
            return None
        return sizes // layout.dtype.itemsize
    others = layout.fixed_other_bytes
    if others is None:
        return None
    if layout.level == "batch":
        offsets, _frames = await _read_frames(store, shard, layout, chunk)
    else:
        offsets = await _read_header(store, shard, chunk)
        if offsets[-1] == offsets[0]:   # an Arrow-footer chunk: the rows must be read
            return None
    payload = np.diff(offsets) - 4 * len(layout.leaf_formats) - others
    itemsize = layout.dtype.itemsize if layout.dtype is not None else 1
    if payload.size and (payload.min() < 0 or (payload % itemsize).any()):
        return None
    return payload // itemsize
