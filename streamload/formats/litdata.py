"""LitData optimized datasets (Lightning AI's `litdata.optimize` output).

A dataset is a directory: `index.json` plus chunk files `chunk-{rank}-{index}.bin` (with
whole-file compression `chunk-{rank}-{index}.{compression}.bin`). The chunk files are the
shards; `index.json` is their companion, read once per directory (and listed with the
directory, so that chunks it names but that are missing show) and cached on the format.

`index.json` holds `"chunks"` (per chunk: `filename`, `chunk_size` = items, `chunk_bytes`, `dim`
= tokens for TokensLoader chunks) and `"config"` (`data_format`: one serializer name per pytree
leaf, `data_spec`: the items' pytree spec as JSON, `item_loader`, `compression`,
`compression_level`, `compression_batch_size`, `encryption`).

A chunk starts with its item count (uint32) and n + 1 uint32 file offsets of its items; then the
items. Item layouts read here:

* PyTreeLoader items: one uint32 byte size per leaf, then the leaves' bytes. Leaves named by
  `data_spec` (dict keys; nested keys joined with "."). A text field is a "str" / "text" leaf
  (UTF-8); a tokens field a 1-D "no_header_numpy:<dtype>" / "no_header_tensor:<dtype>" leaf.
* TokensLoader chunks: the items are bare token arrays, back to back. litdata's reader cuts a
  chunk's tokens into blocks of `block_size` tokens (dim // block_size per chunk), but litdata
  does not store block_size: with one (the `block_size` argument, or a "block_size" key in the
  index's config) each block is a record; without, each written item (a document as it was given
  to `optimize`, exact from the offsets) is one.
* Items stored only in an Arrow IPC footer (litdata >= 0.2.7x with pyarrow writes flat rows of
  strings and numbers so: the items are empty, then the IPC bytes, a uint32 length and
  b"LDARW01\\0"); read with pyarrow.

Reads: uncompressed chunks are read by ranges of whole items (`open` reads the header: count and
offsets), about `chunk_bytes` each; per-sample zstd (`compression_level="sample"`) likewise, each
item inflated alone; framed zstd (`"batch"`, magic b"LDFZ01") by ranges of whole frames from the
frame table `open` reads; TokensLoader blocks by ranges of whole blocks. Whole-file zstd
(`.zstd.bin`) chunks and Arrow-footer chunks are read whole (their format requires it).
A record's index is its item's (or block's) position in the chunk.

`document_lengths` comes from the offsets where they are exact: TokensLoader blocks (block_size
each, from index.json alone), TokensLoader items and token fields (bytes / itemsize), text
fields measured in UTF-8 bytes (no tokenizer) when every other leaf has a fixed size; otherwise
the chunk is decoded and measured (a scan).
"""
from __future__ import annotations

import asyncio
import json
import re
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import zstandard

from ..errors import ConfigError
from ..storage.base import ObjectInfo, ObjectStore
from ..tokenizer import TextTokenizer
from .base import (LENGTHS_CHUNK_BYTES, BadShard, DocumentLengths, EmptyStream, MissingField,
                   PlannedStream, RawRecord, SkipCallback, field_hint, read_exact, shard_failed)
from .lengths import stream_lengths
from .tokens import plan_groups

INDEX_NAME = "index.json"
CHUNK_NAME = re.compile(r"chunk-\d+-\d+(?:\.[A-Za-z0-9_:+-]+)?\.bin")
_ARROW_MAGIC = b"LDARW01\0"
_FRAMED_MAGIC = b"LDFZ01\0\0"
_FRAMED_PREFIX = struct.Struct("<8sHHIII")   # magic, version, flags, items, frame rows, frames
_FRAME_ENTRY = struct.Struct("<IIQII")       # first item, items, file offset, length, raw length
_DEFAULT_FRAME_ROWS = 256
_INDEX_READ = 1 << 20
_CACHED_DIRECTORIES = 256

# Serializer dtype indexes (litdata.constants): numpy's and torch's integer types.
_NUMPY_INT_DTYPES = {0: "i1", 1: "<i2", 2: "<i4", 3: "<i8", 4: "u1", 5: "<u2", 6: "<u4", 7: "<u8"}
_TORCH_INT_DTYPES = {11: "u1", 12: "i1", 13: "<i2", 14: "<i2", 15: "<i4", 16: "<i4", 17: "<i8",
                     18: "<i8", 20: "<u2"}
# Leaves of a constant byte size (their size still sits in each item's header).
_FIXED_LEAF_BYTES = {"int": 8, "float": 8, "bool": 1}
_TEXT_LEAVES = ("str", "text")



def _token_dtype(data_format: str) -> Optional[np.dtype]:
    """The token dtype of a 1-D "no_header_numpy:<k>" / "no_header_tensor:<k>" leaf, else None."""
    kind, _, index = data_format.partition(":")
    table = {"no_header_numpy": _NUMPY_INT_DTYPES, "no_header_tensor": _TORCH_INT_DTYPES}.get(kind)
    if table is None or not index.isdigit() or int(index) not in table:
        return None
    return np.dtype(table[int(index)])


def _out_dtype(dtype: np.dtype) -> np.dtype:
    """Dtype of the arrays handed out: int32 where every value fits (signed ones are checked for
    negative ids here), else the stored one (`to_tokens` checks those)."""
    if dtype.itemsize <= 2 or dtype == np.dtype("<i4"):
        return np.dtype(np.int32)
    return dtype.newbyteorder("=")


def _leaf_names(data_spec) -> Optional[list[str]]:
    """The leaves' names, in leaf order, from the serialized pytree spec (None: unreadable)."""
    try:
        spec = json.loads(data_spec) if isinstance(data_spec, str) else data_spec
        _protocol, root = spec
        names: list[str] = []

        def walk(node, path: str) -> None:
            children = node.get("children_spec") or []
            if node.get("type") is None and not children:
                names.append(path)
                return
            context = node.get("context")
            if isinstance(context, str):
                try:
                    context = json.loads(context)
                except ValueError:
                    pass
            if isinstance(context, dict):   # defaultdict
                context = context.get("dict_context")
            keys = ([str(k) for k in context] if isinstance(context, list)
                    and len(context) == len(children) else [str(i) for i in range(len(children))])
            for key, child in zip(keys, children):
                walk(child, f"{path}.{key}" if path else key)

        walk(root, "")
        return names
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


@dataclass(frozen=True)
class _Layout:
    """How to read a dataset's items, from its index's config and the format's options."""
    tokens_loader: bool
    leaf_formats: tuple[str, ...]
    leaf_names: tuple[str, ...]
    leaf: int                       # the leaf delivered (PyTree), or 0 (TokensLoader)
    dtype: Optional[np.dtype]       # token dtype; None for text (or a "json" list leaf)
    want_tokens: bool               # tokens (TokensLoader, tokens_field) rather than text
    block_size: Optional[int]       # TokensLoader blocks; None: one record per written item
    whole_file: bool                # whole-file compression: read and inflate the chunk whole
    level: str                      # "none", "chunk", "batch" (framed) or "sample"
    frame_rows: int
    field_name: str                 # for messages

    @property
    def fixed_other_bytes(self) -> Optional[int]:
        """Bytes of the other leaves when they all have a fixed size, else None."""
        total = 0
        for k, name in enumerate(self.leaf_formats):
            if k != self.leaf:
                if name not in _FIXED_LEAF_BYTES:
                    return None
                total += _FIXED_LEAF_BYTES[name]
        return total


@dataclass(frozen=True)
class _Chunk:
    position: int          # in the index's "chunks" list
    filename: str
    items: int
    dim: Optional[int]


@dataclass
class _Dataset:
    """One directory's index.json, parsed, and the chunk files listed next to it."""
    directory: str
    chunks: dict[str, _Chunk]
    present: dict[str, int]            # chunk file name -> size, from the listing
    missing: list[_Chunk]              # named by the index, not listed
    first_present: Optional[str]       # the first chunk (in index order) that exists
    layout: Optional[_Layout]
    layout_error: Optional[BadShard]   # why the dataset cannot be read (every chunk fails)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def _parse_config(config, *, text_field: str, tokens_field: Optional[str],
                  block_size: Optional[int]) -> _Layout:
    """The dataset's layout; raises BadShard for what this format cannot read."""
    if not isinstance(config, dict):
        raise BadShard("its 'config' is missing or not an object")
    if config.get("encryption"):
        raise BadShard("the dataset is encrypted, which this format does not read")
    if config.get("format") not in (None, "litdata"):
        raise BadShard(f"config format {config.get('format')!r} is not a litdata chunk format")
    loader = config.get("item_loader") or "PyTreeLoader"
    if loader not in ("PyTreeLoader", "TokensLoader"):
        raise BadShard(f"item_loader {loader!r} is not supported (PyTreeLoader and "
                        "TokensLoader chunks are)")
    formats = config.get("data_format")
    if not isinstance(formats, list) or not formats or not all(isinstance(f, str) for f in formats):
        raise BadShard(f"its config has no usable 'data_format' (found {formats!r})")
    compression = config.get("compression")
    level_name = config.get("compression_level")
    if compression:
        if not str(compression).startswith("zstd"):
            raise BadShard(f"compression {compression!r} is not supported (zstd is)")
        level = level_name or "chunk"
        if level not in ("chunk", "batch", "sample"):
            raise BadShard(f"compression_level {level_name!r} is not known")
    else:
        level = "none"
    frame_rows = config.get("compression_batch_size")
    if not isinstance(frame_rows, int) or frame_rows < 1:
        frame_rows = _DEFAULT_FRAME_ROWS   # a hint only: the chunk's own header says

    if loader == "TokensLoader":
        dtype = _token_dtype(formats[0])
        if len(formats) != 1 or dtype is None:
            raise BadShard(f"TokensLoader data_format {formats!r} is not one 1-D integer array")
        size = block_size if block_size is not None else config.get("block_size")
        if size is not None and (not isinstance(size, int) or size < 1):
            raise BadShard(f"block_size must be a positive integer, found {size!r}")
        return _Layout(True, tuple(formats), ("",), 0, dtype, True, size, level == "chunk",
                       level, frame_rows, "tokens")

    names = _leaf_names(config.get("data_spec"))
    if names is None or len(names) != len(formats):
        names = [str(k) for k in range(len(formats))]
    described = ", ".join(f"{n or '<item>'} ({f})" for n, f in zip(names, formats))
    wanted = tokens_field if tokens_field is not None else text_field
    if wanted in names:
        leaf = names.index(wanted)
    elif names == [""]:   # the items are bare leaves: no field names to choose from
        leaf = 0
    else:
        kind = "tokens_field" if tokens_field is not None else "text_field"
        raise MissingField(f"{kind} {wanted!r} is not a field of its items; they have: "
                           f"{described}{field_hint(kind, wanted, [n for n in names if n])}")
    leaf_format = formats[leaf]
    name = names[leaf] or "<item>"
    bare_tokens = names == [""] and _token_dtype(leaf_format) is not None
    if tokens_field is not None or bare_tokens:   # a bare token array needs no field name
        dtype = _token_dtype(leaf_format)
        if dtype is None and leaf_format not in ("json",):   # "json": Arrow-footer lists
            raise BadShard(f"field {name!r} holds {leaf_format!r}, not a 1-D integer array "
                            f"(no_header_numpy / no_header_tensor); fields: {described}")
    else:
        dtype = None
        if leaf_format not in _TEXT_LEAVES:
            raise BadShard(f"field {name!r} holds {leaf_format!r}, not text (str); use "
                            f"tokens_field for token arrays; fields: {described}")
    return _Layout(False, tuple(formats), tuple(names), leaf, dtype,
                   tokens_field is not None or bare_tokens, None, level == "chunk", level,
                   frame_rows, name)


class _Decoder:
    """Turns one item's (or block's) bytes into a record payload, or raises _BadRecord."""

    def __init__(self, layout: _Layout):
        self.layout = layout
        self.n_leaves = len(layout.leaf_formats)
        self.sizes = struct.Struct("<" + "I" * self.n_leaves)
        self.out_dtype = _out_dtype(layout.dtype) if layout.dtype is not None else None
        self.inflate = zstandard.ZstdDecompressor() if layout.level == "sample" else None

    def tokens(self, data) -> np.ndarray:
        dtype = self.layout.dtype
        if dtype is None:   # a "json" leaf: only its Arrow-footer rows are read
            raise BadShard(f"field {self.layout.field_name!r} is a JSON-encoded leaf, read "
                            "only from chunks whose rows sit in an Arrow footer")
        if len(data) % dtype.itemsize:
            raise _BadRecord(f"{len(data)} bytes of tokens is not a multiple of "
                             f"{dtype.itemsize} ({dtype})")
        ids = np.frombuffer(data, dtype).astype(self.out_dtype)
        if dtype.kind == "i" and ids.size and ids.min() < 0:
            raise _BadRecord("negative token id")
        return ids

    def spans(self, data: bytes, bounds: np.ndarray) -> tuple[list, dict]:
        """PyTree items data[bounds[k]:bounds[k + 1]], their headers read at once: the
        (start, end) in `data` of each item's wanted leaf, and {k: reason} for bad items."""
        n, width = len(bounds) - 1, 4 * self.n_leaves
        starts, lengths = bounds[:-1], np.diff(bounds)
        errors = {}
        short = np.flatnonzero(lengths < width)
        for k in short.tolist():
            errors[k] = (f"item of {int(lengths[k])} bytes is shorter than its "
                         f"{self.n_leaves}-leaf header")
        heads = np.where(lengths < width, 0, starts) if short.size else starts
        raw = np.frombuffer(data, np.uint8, count=int(bounds[-1]))
        if raw.size < width:   # only short items: read zeros in place of their headers
            raw = np.concatenate([raw, np.zeros(width, np.uint8)])
        sizes = raw[heads[:, None] + np.arange(width)].view("<u4").astype(np.int64)
        sizes = sizes.reshape(n, self.n_leaves)
        begin = starts + width + sizes[:, :self.layout.leaf].sum(axis=1)
        end = begin + sizes[:, self.layout.leaf]
        bad = np.flatnonzero(sizes.sum(axis=1) + width != lengths)
        for k in bad.tolist():
            errors.setdefault(k, f"item header sizes {sizes[k].tolist()} do not add up to the "
                                 f"item's {int(lengths[k])} bytes")
        return list(zip(begin.tolist(), end.tolist())), errors

    def item(self, data):
        if self.inflate is not None:
            try:
                data = _inflate(self.inflate, data)
            except (zstandard.ZstdError, _Truncated) as exc:
                raise _BadRecord(f"corrupt zstd item: {exc}") from None
        if self.layout.tokens_loader:
            return self.tokens(data)
        header = 4 * self.n_leaves
        if len(data) < header:
            raise _BadRecord(f"item of {len(data)} bytes is shorter than its "
                             f"{self.n_leaves}-leaf header")
        sizes = self.sizes.unpack_from(data, 0)
        if header + sum(sizes) != len(data):
            raise _BadRecord(f"item header sizes {list(sizes)} do not add up to the item's "
                             f"{len(data)} bytes")
        start = header + sum(sizes[:self.layout.leaf])
        payload = data[start:start + sizes[self.layout.leaf]]
        if self.layout.want_tokens:
            return self.tokens(payload)
        try:
            return str(payload, "utf-8")
        except UnicodeDecodeError as exc:
            raise _BadRecord(f"field {self.layout.field_name!r} is not valid UTF-8: {exc}") from None


class _BadRecord(Exception):
    pass


class _Truncated(Exception):
    pass


def _inflate(dctx: zstandard.ZstdDecompressor, data) -> bytes:
    """One whole zstd frame (its content size may be unknown); _Truncated if it is cut."""
    inflater = dctx.decompressobj()
    out = inflater.decompress(bytes(data))
    if not inflater.eof:
        raise _Truncated("the zstd frame is truncated")
    return out


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

    def __init__(self, plan: _Plan, layout: _Layout, *, source: str, shard_name: str,
                 on_skip: SkipCallback | None, expected_items: int, dim: Optional[int]):
        super().__init__(source=source, shard_name=shard_name, on_skip=on_skip)
        self._plan, self._layout = plan, layout
        self._ranges = plan.ranges
        self._decoder = _Decoder(layout)
        self._expected_items, self._dim = expected_items, dim
        self._finished = False

    def _record_spans(self) -> Optional[list[tuple[int, int]]]:
        # Item and block ranges decode on their own; frames and whole chunks are kept.
        return self._plan.groups if self._plan.mode in ("items", "blocks") else None

    def decode(self, chunk: bytes) -> list[RawRecord]:
        if self._failed:
            return []
        plan = self._plan
        k = self._next_range()
        start, end = plan.ranges[k]
        first, stop = plan.groups[k]
        if len(chunk) != end - start:
            self._shard_error(f"expected {end - start} bytes at {start}..{end}, got "
                              f"{len(chunk)}; the chunk is truncated")
            return []
        view = memoryview(chunk)
        try:
            if plan.mode == "items":
                return self._items(first, chunk,
                                   plan.offsets[first:stop + 1] - plan.offsets[first])
            if plan.mode == "blocks":
                return self._blocks(first, stop, chunk)
            if plan.mode == "frames":
                return self._frames(first, stop, view, start)
            if plan.mode == "whole":
                return self._whole(chunk)
            return self._arrow(chunk)
        except BadShard as exc:
            self._shard_error(str(exc), skippable=not isinstance(exc, MissingField))
            return []

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
            spans, errors = decoder.spans(data, bounds)
            return self._payloads(first, data, spans, errors)
        records = []
        view = memoryview(data)
        edges = bounds.tolist()
        for k in range(len(edges) - 1):
            try:
                records.append(RawRecord(first + k, decoder.item(view[edges[k]:edges[k + 1]])))
            except _BadRecord as exc:
                self._record_error(first + k, str(exc))
        return records

    def _payloads(self, first: int, data: bytes, spans: list, errors: dict) -> list[RawRecord]:
        records = []
        tokens = self._decoder.tokens if self._layout.want_tokens else None
        name = self._layout.field_name
        for k, (start, end) in enumerate(spans):
            if k in errors:
                self._record_error(first + k, errors[k])
                continue
            try:
                if tokens is not None:
                    payload = tokens(data[start:end])
                else:
                    try:
                        payload = data[start:end].decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise _BadRecord(f"field {name!r} is not valid UTF-8: {exc}") from None
            except _BadRecord as exc:
                self._record_error(first + k, str(exc))
                continue
            records.append(RawRecord(first + k, payload))
        return records

    def _blocks(self, first: int, stop: int, chunk: bytes) -> list[RawRecord]:
        size = self._layout.block_size
        tokens = np.frombuffer(chunk, self._layout.dtype).astype(self._decoder.out_dtype)
        blocks = tokens.reshape(stop - first, size)
        negative = (np.flatnonzero(blocks.min(axis=1) < 0).tolist()
                    if self._layout.dtype.kind == "i" and blocks.size else [])
        for b in negative:
            self._record_error(first + b, "negative token id")
        skip = set(negative)
        return [RawRecord(first + b, blocks[b]) for b in range(stop - first) if b not in skip]

    def _frames(self, first: int, stop: int, view: memoryview, start: int) -> list[RawRecord]:
        records = []
        offsets = self._plan.offsets
        dctx = zstandard.ZstdDecompressor()
        for f in range(first, stop):
            item0, n_items, offset, length, raw_length = self._plan.frames[f]
            data = view[offset - start:offset - start + length]
            try:
                raw = _inflate(dctx, data)
            except (zstandard.ZstdError, _Truncated) as exc:
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

    def _whole(self, chunk: bytes) -> list[RawRecord]:
        """A whole-file compressed chunk: inflate, then read it as an uncompressed one."""
        try:
            data = _inflate(zstandard.ZstdDecompressor(), chunk)
        except (zstandard.ZstdError, _Truncated) as exc:
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
        return self._items(0, data, offsets)

    def _arrow(self, chunk: bytes) -> list[RawRecord]:
        return self._arrow_rows(memoryview(chunk), self._plan.items, footer=False)

    def _arrow_rows(self, view: memoryview, n: int, footer: bool = True) -> list[RawRecord]:
        """Rows from an Arrow IPC footer: `view` ends with it (footer=True) or is its IPC."""
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
            for i, text in enumerate(column.to_pylist()):
                if text is None:
                    self._record_error(i, f"field {name!r} is null")
                else:
                    records.append(RawRecord(i, text))
            return records
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
        return records

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


class LitdataFormat:
    """LitData chunks `chunk-*.bin` with their directory's `index.json` (see the module
    docstring). `text_field` (default "text") names the text leaf, `tokens_field` a 1-D integer
    leaf read instead; `block_size` cuts TokensLoader chunks into blocks as litdata's
    TokensLoader(block_size) does (else each written item is a record)."""

    name = "litdata"
    # "index" until a document_lengths call had to decode a chunk ("scan").

    def __init__(self, text_field: str | None = None, tokens_field: str | None = None,
                 named: bool = False, *, block_size: int | None = None):
        text_field = "text" if text_field is None else text_field
        if not text_field:
            raise ConfigError.at("text_field", "must be a non-empty string")
        if tokens_field is not None and not tokens_field:
            raise ConfigError.at("tokens_field", "must be a non-empty string")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ConfigError.at("block_size", f"must be a positive integer, got {block_size!r}")
        self.text_field, self.tokens_field, self.block_size = text_field, tokens_field, block_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, _Dataset] = OrderedDict()
        self._loading: dict[tuple[str, int], asyncio.Future] = {}

    def matches(self, uri: str) -> bool:
        return CHUNK_NAME.fullmatch(uri.rsplit("/", 1)[-1]) is not None

    # -- the directory's index

    async def _dataset(self, store: ObjectStore, shard: ObjectInfo) -> _Dataset:
        """The shard's directory, from the cache; read again when the shard does not fit it
        (not named by it, or of another size than listed: the dataset was rewritten)."""
        directory = shard.uri.rsplit("/", 1)[0]
        name = shard.uri.rsplit("/", 1)[-1]
        with self._lock:
            cached = self._cache.get(directory)
            if cached is not None:
                self._cache.move_to_end(directory)
        if cached is not None and name in cached.chunks \
                and cached.present.get(name) == shard.size:
            return cached
        loop = asyncio.get_running_loop()
        key = (directory, id(loop))
        while True:   # one read per directory at a time; the others wait for it
            with self._lock:
                pending = self._loading.get(key)
                owner = pending is None
                if owner:
                    pending = self._loading[key] = loop.create_future()
            if owner:
                break
            try:
                return await asyncio.shield(pending)
            except asyncio.CancelledError:
                if not pending.cancelled():   # this task itself was cancelled
                    raise
                # the reader was cancelled: read it here instead
        try:
            dataset = await self._load(store, directory)
        except Exception as exc:
            with self._lock:
                self._loading.pop(key, None)
            pending.set_exception(exc)
            pending.exception()   # retrieved: no "never retrieved" warning without waiters
            raise
        except BaseException:
            with self._lock:
                self._loading.pop(key, None)
            pending.cancel()
            raise
        with self._lock:
            self._loading.pop(key, None)
            self._cache[directory] = dataset
            while len(self._cache) > _CACHED_DIRECTORIES:
                self._cache.popitem(last=False)
        pending.set_result(dataset)
        return dataset

    async def _load(self, store: ObjectStore, directory: str) -> _Dataset:
        listing = await store.list(_glob_escape(directory) + "/*")
        files = {info.uri.rsplit("/", 1)[-1]: info.size for info in listing
                 if info.uri.rsplit("/", 1)[0] == directory}
        index_uri = f"{directory}/{INDEX_NAME}"
        if INDEX_NAME not in files:
            return _Dataset(directory, {}, {}, [], None, None, BadShard(
                f"there is no {INDEX_NAME} next to it (a litdata dataset needs its index; was "
                f"litdata.optimize interrupted?)"))
        data = await store.read_range(index_uri, 0, files[INDEX_NAME])
        try:
            index = json.loads(data)
            entries = index["chunks"]
            if not isinstance(entries, list):
                raise TypeError("'chunks' is not a list")
            chunks: dict[str, _Chunk] = {}
            for position, entry in enumerate(entries):
                filename, items = entry["filename"], entry["chunk_size"]
                dim = entry.get("dim")
                if not isinstance(filename, str) or not isinstance(items, int) or items < 0 \
                        or not (dim is None or isinstance(dim, int)):
                    raise TypeError(f"chunk entry {position} is malformed: {entry!r}")
                chunks[filename] = _Chunk(position, filename, items, dim)
        except (ValueError, TypeError, KeyError) as exc:
            return _Dataset(directory, {}, {}, [], None, None, BadShard(
                f"its {INDEX_NAME} is unreadable: {type(exc).__name__}: {exc}"))
        try:
            layout, error = _parse_config(index.get("config"), text_field=self.text_field,
                                          tokens_field=self.tokens_field,
                                          block_size=self.block_size), None
        except BadShard as exc:   # kept as an exception: a MissingField offers no skip
            layout, error = None, type(exc)(f"{INDEX_NAME}: {exc}")
        present = {name: size for name, size in files.items() if name in chunks}
        ordered = sorted(chunks.values(), key=lambda c: c.position)
        missing = [c for c in ordered if c.filename not in present]
        first = next((c.filename for c in ordered if c.filename in present), None)
        return _Dataset(directory, chunks, present, missing, first, layout, error)

    async def _open_chunk(self, store: ObjectStore, shard: ObjectInfo, shard_name: str,
                          on_skip: SkipCallback | None
                          ) -> tuple[_Dataset, _Chunk, Optional[str]]:
        """The dataset, the shard's index entry and, in skip mode, a missing chunk to report
        (once per pass: by the first chunk of the index that exists); BadShard for what makes
        the shard unreadable (in raise mode, any chunk the index names but that is missing)."""
        dataset = await self._dataset(store, shard)
        if dataset.layout_error is not None:   # a fresh copy: the dataset is shared
            raise type(dataset.layout_error)(str(dataset.layout_error))
        name = shard.uri.rsplit("/", 1)[-1]
        index_name = _index_name(shard_name)
        chunk = dataset.chunks.get(name)
        if chunk is None:
            raise BadShard(f"chunk {name!r} is not named in {index_name} (a leftover of "
                            "another run?)")
        if dataset.missing:
            lost = dataset.missing[0]
            reason = (f"{index_name} names chunk {lost.filename!r} (entry {lost.position} of "
                      f"its 'chunks'), which does not exist"
                      + (f", nor {len(dataset.missing) - 1} more" if len(dataset.missing) > 1
                         else ""))
            if on_skip is None:
                raise BadShard(reason)
            if name == dataset.first_present:
                return dataset, chunk, reason
        return dataset, chunk, None

    # -- the protocol

    async def open(self, store: ObjectStore, shard: ObjectInfo, *, source: str, shard_name: str,
                   on_skip: SkipCallback | None, chunk_bytes: int):
        if chunk_bytes <= 0:
            raise ConfigError.at("chunk_bytes", f"must be positive, got {chunk_bytes}")
        try:
            dataset, chunk, missing = await self._open_chunk(store, shard, shard_name, on_skip)
            if missing is not None:
                on_skip(None, missing)
            plan = await _plan_chunk(store, shard, dataset.layout, chunk, chunk_bytes)
        except BadShard as exc:
            shard_failed(exc, source, shard_name, on_skip)
            return EmptyStream()
        return LitdataStream(plan, dataset.layout, source=source, shard_name=shard_name,
                             on_skip=on_skip, expected_items=chunk.items, dim=chunk.dim)

    async def document_lengths(self, store: ObjectStore, shard: ObjectInfo, *, source: str,
                               shard_name: str, on_skip: SkipCallback | None,
                               tokenizer: TextTokenizer | None = None, limit: int | None = None,
                               chunk_bytes: int = LENGTHS_CHUNK_BYTES) -> DocumentLengths:
        """Each record's length in tokens (`ShardFormat.document_lengths`): from index.json
        alone for TokensLoader blocks; from the chunk's offsets for TokensLoader items, token
        fields, and texts without a tokenizer when the other leaves have fixed sizes (the
        records are not decoded, so a bad one is not noticed here); else by a scan."""
        if limit is not None and limit < 0:
            raise ConfigError.at("limit", f"must be >= 0, got {limit}")
        try:
            dataset, chunk, missing = await self._open_chunk(store, shard, shard_name, on_skip)
            lengths = await _index_lengths(store, shard, dataset.layout, chunk, tokenizer)
        except BadShard as exc:
            shard_failed(exc, source, shard_name, on_skip)
            return DocumentLengths(np.zeros(0, np.int64), "index")
        if lengths is not None and missing is not None:
            on_skip(None, missing)
        if lengths is None:   # `open` reports the missing chunk, if any
            return await stream_lengths(self, store, shard, source=source, shard_name=shard_name,
                                        on_skip=on_skip, tokenizer=tokenizer, limit=limit,
                                        chunk_bytes=chunk_bytes)
        return DocumentLengths(lengths if limit is None else lengths[:limit], "index")


def _index_name(shard_name: str) -> str:
    return shard_name.rsplit("/", 1)[0] + "/" + INDEX_NAME if "/" in shard_name else INDEX_NAME


async def _read_header(store: ObjectStore, shard: ObjectInfo, chunk: _Chunk) -> np.ndarray:
    header = 4 + 4 * (chunk.items + 1)
    if shard.size < header:
        raise BadShard(f"the chunk holds {shard.size} bytes, fewer than its {header}-byte "
                        f"header for {chunk.items} items")
    data = await read_exact(store, shard.uri, 0, header, "the chunk")
    return _parse_header(data, shard.size, chunk.items)[1]


async def _read_frames(store: ObjectStore, shard: ObjectInfo, layout: _Layout,
                       chunk: _Chunk) -> tuple[np.ndarray, list]:
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


async def _plan_chunk(store: ObjectStore, shard: ObjectInfo, layout: _Layout, chunk: _Chunk,
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


async def _index_lengths(store: ObjectStore, shard: ObjectInfo, layout: _Layout, chunk: _Chunk,
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
