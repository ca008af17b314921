"""MosaicML Streaming's MDS shards: `shard.NNNNN.mds`, or compressed `shard.NNNNN.mds.zstd`
(also `.gz`, `.bz2`), described by the `index.json` beside them.

`index.json` (version 2) lists the directory's shards in order; each entry gives the raw file
(`raw_data`: basename, bytes), the compressed one if any (`zip_data`, `compression`), the
sample count and the columns: `column_names`, `column_encodings` and `column_sizes` (a fixed
size in bytes, or null for variable-size columns), in the order their data is stored.

A raw shard holds the sample count (uint32), then n + 1 uint32 offsets (absolute byte
positions: sample i is bytes [offsets[i], offsets[i + 1])), then the writer's configuration as
JSON, then the samples. Each sample is one uint32 size per variable-size column, then every
column's bytes in column order. All integers are little-endian.

The shard files are the shards; `index.json` is their companion (`matches` is False for it),
read once per directory with a listing of the directory, and kept on the format instance.
Sub-directories with an `index.json` of their own (MDS "streams") are read the same way.

Records: text from a `str` column (`text_field`, default "text"), or token ids from an ndarray
column (`tokens_field`: encodings `ndarray`, `ndarray:<int dtype>` and
`ndarray:<int dtype>:<shape>`). Pickled columns (`pkl`) are refused, never unpickled. A
record's index is the sample's index in its shard.

Reads: a raw shard's header (count and offsets) is one small range read by `open`; the samples
are read by range, consecutive samples coalesced into ranges of about `chunk_bytes`. A
compressed shard is read whole (one range) and decompressed. When a raw copy and a compressed
copy of the same shard both exist (a StreamingDataset cache), the raw one is read and the
compressed one yields nothing.

`document_lengths`: a fixed-shape token column from the index alone (every sample holds the
same number of ids); anything else by decoding the samples (`lengths.stream_lengths`).
"""
from __future__ import annotations

import asyncio
import bz2
import gzip
import re
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import msgspec
import numpy as np
import zstandard

from ..errors import ConfigError, DataError
from ..storage.base import ObjectInfo, ObjectStore
from ..tokenizer import TextTokenizer
from .base import (LENGTHS_CHUNK_BYTES, BadShard, DocumentLengths, EmptyStream, MissingField,
                   PlannedStream, RawRecord, SkipCallback, field_hint, shard_failed)
from .lengths import stream_lengths

INDEX_NAME = "index.json"
_SHARD_NAME = re.compile(r"shard\.\d+\.mds(?:\.(zstd|gz|bz2|br|snappy))?")
_DECOMPRESSORS = ("zstd", "gz", "bz2")
_CACHED_DIRECTORIES = 1024

# MDS ndarray dtype codes (dynamic-dtype arrays store one of these bytes first).
_DTYPE_CODES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16",
                32: "uint32", 33: "int32", 34: "float32", 64: "uint64", 65: "int64",
                66: "float64"}
_INT_DTYPES = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"}
_SMALL_INTS = {"uint8", "int8", "uint16", "int16", "int32"}   # handed out as int32



class _BadSample(Exception):
    """One sample cannot be decoded: a DataError naming it, or a counted skip."""


def _escape_glob(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


# ---------------------------------------------------------------- the index


@dataclass(frozen=True)
class _Entry:
    """One shard of an index.json."""
    position: int                 # in the index
    raw: str                      # basename of the raw file
    raw_bytes: Optional[int]
    zip: Optional[str]            # basename of the compressed file, if any
    zip_bytes: Optional[int]
    compression: Optional[str]    # "zstd", "gz", ... (the level dropped)
    samples: int
    names: tuple[str, ...]
    encodings: tuple[str, ...]
    sizes: tuple[Optional[int], ...]


@dataclass(frozen=True)
class _Directory:
    """A directory's listing (direct children: name -> size) and its parsed index.json."""
    uri: str
    files: dict
    entries: dict                 # basename (raw and zip) -> _Entry
    order: tuple                  # entries in index order
    missing: tuple                # (basename, samples) of entries with no file at all
    reporter: Optional[str]       # the file whose `open` reports the missing ones (skip mode)

    @property
    def index_uri(self) -> str:
        return f"{self.uri}/{INDEX_NAME}"

    def fits(self, name: str, size: int) -> bool:
        """Whether this listing saw the shard as the fetcher did (else it is reloaded)."""
        return self.files.get(name) == size


def _int_or_none(value, what: str) -> Optional[int]:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise BadShard(f"{what} must be a non-negative integer, found {value!r}")
    return value


def _file_info(value, what: str) -> tuple[Optional[str], Optional[int]]:
    if value is None:
        return None, None
    if not isinstance(value, dict) or not isinstance(value.get("basename"), str):
        raise BadShard(f"{what} must be an object with a 'basename', found {value!r}")
    return value["basename"], _int_or_none(value.get("bytes"), f"{what}.bytes")


def _parse_index(data: bytes, index_uri: str) -> list[_Entry]:
    what = f"index {index_uri}"
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise BadShard(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("shards"), list):
        raise BadShard(f"{what} is not an MDS index (no 'shards' list)")
    if obj.get("version") != 2:
        raise BadShard(f"{what} has version {obj.get('version')!r}; only version 2 is read")
    entries = []
    for position, shard in enumerate(obj["shards"]):
        where = f"{what}, shard entry {position}"
        if not isinstance(shard, dict):
            raise BadShard(f"{where} is not an object")
        if shard.get("format") != "mds":
            continue   # another format's shards (json, csv, ...): not ours
        raw, raw_bytes = _file_info(shard.get("raw_data"), f"{where}: raw_data")
        zip_name, zip_bytes = _file_info(shard.get("zip_data"), f"{where}: zip_data")
        if raw is None:
            raise BadShard(f"{where} has no raw_data")
        compression = shard.get("compression")
        if zip_name is not None:
            if not isinstance(compression, str) or not compression:
                compression = zip_name.rsplit(".", 1)[-1]
            compression = compression.split(":", 1)[0]
        samples = _int_or_none(shard.get("samples"), f"{where}: samples")
        if samples is None:
            raise BadShard(f"{where} has no sample count")
        names, encodings = shard.get("column_names"), shard.get("column_encodings")
        sizes = shard.get("column_sizes")
        if not (isinstance(names, list) and isinstance(encodings, list)
                and isinstance(sizes, list) and len(names) == len(encodings) == len(sizes)
                and all(isinstance(x, str) for x in names + encodings)):
            raise BadShard(f"{where}: column_names, column_encodings and column_sizes must "
                            f"be lists of one length")
        sizes = tuple(_int_or_none(s, f"{where}: column size") for s in sizes)
        entries.append(_Entry(position, raw, raw_bytes, zip_name, zip_bytes,
                              compression if zip_name is not None else None, samples,
                              tuple(names), tuple(encodings), sizes))
    return entries


async def _load_directory(store: ObjectStore, uri: str) -> _Directory:
    """List `uri` (its direct children) and read its index.json. Raises BadShard when the
    index is missing or unreadable."""
    prefix = uri + "/"
    files = {}
    for info in await store.list(_escape_glob(prefix) + "*"):
        name = info.uri[len(prefix):] if info.uri.startswith(prefix) else ""
        if name and "/" not in name:
            files[name] = info.size
    index_uri = prefix + INDEX_NAME
    if INDEX_NAME not in files:
        raise BadShard(f"no {INDEX_NAME} next to the shard (looked for {index_uri})")
    data = await store.read_range(index_uri, 0, files[INDEX_NAME])
    entries = {}
    order = _parse_index(data, index_uri)
    for entry in order:
        for name in (entry.raw, entry.zip):
            if name is None:
                continue
            if name in entries:
                raise BadShard(f"index {index_uri} names shard {name!r} twice")
            entries[name] = entry
    missing, reporter = [], None
    for entry in order:
        if "/" in entry.raw:   # a merged index naming another directory's shards
            continue
        present = [n for n in (entry.raw, entry.zip) if n is not None and n in files]
        if not present:
            missing.append((entry.zip or entry.raw, entry.samples))
        elif reporter is None:
            reporter = present[0]
    return _Directory(uri, files, entries, tuple(order), tuple(missing), reporter)


# ---------------------------------------------------------------- columns


@dataclass(frozen=True)
class _Layout:
    """Where the read column lies in a sample, and how to decode it."""
    field: str
    tokens: bool
    n_var: int                    # uint32 sizes at the start of every sample
    var_before: int               # variable-size columns before the field
    fixed_before: int             # bytes of fixed-size columns before the field
    fixed_total: int              # bytes of every fixed-size column
    size: Optional[int]           # the field's fixed size, None when variable
    dtype: Optional[str]          # ndarray: the static dtype, None when stored per sample
    shape: Optional[tuple]        # ndarray: the static shape, None when stored per sample

    @property
    def static_count(self) -> Optional[int]:
        """Token ids per sample when every sample holds the same number (a fixed shape)."""
        if self.tokens and self.dtype is not None and self.shape is not None:
            return int(np.prod(self.shape))
        return None


def _columns_text(entry: _Entry) -> str:
    return ", ".join(f"{n!r} ({e})" for n, e in zip(entry.names, entry.encodings))


def _parse_ndarray(encoding: str, field: str) -> tuple[Optional[str], Optional[tuple]]:
    args = encoding.split(":")[1:]
    if len(args) > 2:
        raise BadShard(f"column {field!r} has an unknown ndarray encoding {encoding!r}")
    dtype = args[0] if args and args[0] else None
    shape = None
    if dtype is not None and dtype not in _DTYPE_CODES.values():
        raise BadShard(f"column {field!r} has an unknown ndarray dtype {dtype!r}")
    if dtype is not None and dtype not in _INT_DTYPES:
        raise BadShard(f"column {field!r} holds {dtype} arrays, not integer token ids")
    if len(args) == 2:
        try:
            shape = tuple(int(d) for d in args[1].split(","))
        except ValueError:
            raise BadShard(f"column {field!r} has an unreadable shape in {encoding!r}") from None
        if not shape or min(shape) < 1:
            raise BadShard(f"column {field!r} has an invalid shape in {encoding!r}")
        if sum(d > 1 for d in shape) > 1:
            raise BadShard(f"column {field!r} holds arrays of shape {shape}, not one "
                            f"sequence of token ids per sample")
    return dtype, shape


def _layout(entry: _Entry, field: str, tokens: bool) -> _Layout:
    if field not in entry.names:
        option = "tokens_field" if tokens else "text_field"
        hint = "" if tokens else "; token ids are read with tokens_field=<ndarray column>"
        raise MissingField(f"no column {field!r} ({option}) in the shard; its columns are "
                           f"{_columns_text(entry)}{field_hint(option, field, entry.names)}"
                           f"{hint}")
    k = entry.names.index(field)
    encoding = entry.encodings[k]
    if encoding == "pkl":
        raise BadShard(f"column {field!r} is pickled (encoding 'pkl'); streamload does not "
                        f"unpickle data (unpickling runs arbitrary code)")
    dtype = shape = None
    if tokens:
        if encoding != "ndarray" and not encoding.startswith("ndarray:"):
            raise BadShard(f"column {field!r} has encoding {encoding!r}; token ids must be an "
                            f"ndarray column (ndarray, ndarray:<int dtype>[:<shape>])")
        dtype, shape = _parse_ndarray(encoding, field)
    elif encoding != "str":
        hint = (" (read ndarray columns with tokens_field)"
                if encoding.split(":")[0] == "ndarray" else "")
        raise BadShard(f"column {field!r} has encoding {encoding!r}; text must be a 'str' "
                        f"column{hint}")
    # As MDSReader does: a column without a (non-zero) fixed size has its size per sample.
    variable = [not s for s in entry.sizes]
    size = None if variable[k] else entry.sizes[k]
    if size is not None and dtype is not None and shape is not None:
        expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if size != expected:
            raise BadShard(f"column {field!r} ({encoding}) has size {size} in the index, "
                            f"but its arrays take {expected} bytes")
    return _Layout(field, tokens, sum(variable), sum(variable[:k]),
                   sum(s for s, v in zip(entry.sizes[:k], variable[:k]) if not v),
                   sum(s for s, v in zip(entry.sizes, variable) if not v), size, dtype, shape)


def _check_header(head: bytes, samples: int, size: int, what: str) -> np.ndarray:
    """The offsets of a raw shard's header (int64), checked against the index and the size."""
    want = 4 * (samples + 2)
    if len(head) < want:
        raise BadShard(f"{what} is truncated: {len(head)} bytes, too short for the header of "
                        f"{samples} samples")
    count = int.from_bytes(head[:4], "little")
    if count != samples:
        raise BadShard(f"{what} holds {count} samples but the index says {samples}")
    offsets = np.frombuffer(head, "<u4", samples + 1, 4).astype(np.int64)
    if offsets[0] < want or offsets[-1] != size:
        raise BadShard(f"{what} has a corrupt offsets table: samples span bytes "
                        f"{int(offsets[0])}..{int(offsets[-1])} of {size}")
    steps = np.diff(offsets)
    if steps.size and steps.min() < 0:
        bad = int(np.argmax(steps < 0))
        raise BadShard(f"{what} has a corrupt offsets table: it decreases at sample {bad}")
    return offsets


# ---------------------------------------------------------------- samples -> records


class _Decoder:
    """Turns samples (bytes of one buffer) into records of the layout's column."""

    def __init__(self, layout: _Layout, *, source: str, shard_name: str,
                 on_skip: SkipCallback | None):
        self._layout = layout
        self._source, self._shard_name, self._on_skip = source, shard_name, on_skip

    def records(self, buf: bytes, starts: np.ndarray, ends: np.ndarray,
                first: int) -> list[RawRecord]:
        lay = self._layout
        n = len(starts)
        if not n:
            return []
        lengths = ends - starts
        header = 4 * lay.n_var
        ok = lengths >= header
        col_start = starts + header + lay.fixed_before
        col_len = np.full(n, lay.size or 0, np.int64)
        total = np.full(n, header + lay.fixed_total, np.int64)
        if lay.n_var:
            rows = np.flatnonzero(ok)
            raw = np.frombuffer(buf, np.uint8)
            at = (starts[rows, None] + 4 * np.arange(lay.n_var))[..., None] + np.arange(4)
            var = raw[at].view("<u4").reshape(len(rows), lay.n_var).astype(np.int64)
            total[rows] += var.sum(axis=1)
            col_start[rows] += var[:, :lay.var_before].sum(axis=1)
            if lay.size is None:
                col_len[rows] = var[:, lay.var_before]
        ok &= total == lengths
        out = []
        decode = self._tokens if lay.tokens else self._text
        for k, (good, start, size) in enumerate(zip(ok.tolist(), col_start.tolist(),
                                                    col_len.tolist())):
            try:
                if not good:
                    raise _BadSample(f"corrupt sample: it holds {int(lengths[k])} bytes but "
                                     f"its column sizes add up to {int(total[k])}")
                out.append(RawRecord(first + k, decode(buf, start, size)))
            except _BadSample as exc:
                if self._on_skip is None:
                    raise DataError(str(exc), source=self._source, shard=self._shard_name,
                                    record=first + k) from None
                self._on_skip(first + k, str(exc))
        return out

    def _text(self, buf: bytes, start: int, size: int) -> str:
        try:
            return buf[start:start + size].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _BadSample(f"invalid UTF-8 in column {self._layout.field!r}: {exc}") from None

    def _tokens(self, buf: bytes, start: int, size: int) -> np.ndarray:
        lay = self._layout
        end = start + size
        at = start
        dtype = lay.dtype
        if dtype is None:   # the dtype's code, per sample
            if at >= end:
                raise _BadSample(f"corrupt ndarray in column {lay.field!r}: no dtype byte")
            dtype = _DTYPE_CODES.get(buf[at])
            at += 1
            if dtype is None:
                raise _BadSample(f"corrupt ndarray in column {lay.field!r}: unknown dtype "
                                 f"code {buf[at - 1]}")
            if dtype not in _INT_DTYPES:
                raise _BadSample(f"column {lay.field!r} holds a {dtype} array, not integer "
                                 f"token ids")
        shape = lay.shape
        if shape is None:   # [ndim << 2 | shape dtype code] [shape]
            if at >= end:
                raise _BadSample(f"corrupt ndarray in column {lay.field!r}: no shape")
            ndim, width = buf[at] >> 2, 1 << (buf[at] & 3)
            at += 1
            if not ndim or at + ndim * width > end:
                raise _BadSample(f"corrupt ndarray in column {lay.field!r}: bad shape header")
            shape = tuple(np.frombuffer(buf, f"<u{width}", ndim, at).tolist())
            at += ndim * width
            if sum(d > 1 for d in shape) > 1:
                raise _BadSample(f"column {lay.field!r} holds an array of shape {shape}, not "
                                 f"one sequence of token ids")
        count = int(np.prod(shape))
        itemsize = np.dtype(dtype).itemsize
        if at + count * itemsize != end:
            raise _BadSample(f"corrupt ndarray in column {lay.field!r}: shape {shape} of "
                             f"{dtype} needs {count * itemsize} bytes, {end - at} are stored")
        values = np.frombuffer(buf, "<" + np.dtype(dtype).str[1:], count, at)
        if dtype in _SMALL_INTS:
            if dtype[0] == "i" and count and values.min() < 0:
                raise _BadSample("negative token id")
            return values.astype(np.int32)
        return values.copy()   # not a view: a record must not keep the whole chunk alive


# ---------------------------------------------------------------- streams



class MdsRawStream(PlannedStream):
    """An uncompressed shard: samples read by range, consecutive ones coalesced."""

    def __init__(self, decoder: _Decoder, offsets: np.ndarray, chunk_bytes: int, *,
                 source: str, shard_name: str):
        super().__init__(source=source, shard_name=shard_name, on_skip=None)
        self._decoder = decoder
        self._offsets = offsets
        self._runs = []
        n, first = len(offsets) - 1, 0
        while first < n:
            end = int(np.searchsorted(offsets, offsets[first] + chunk_bytes, side="right")) - 1
            end = min(max(end, first + 1), n)
            self._runs.append((first, end))
            first = end
        self._ranges = [(int(offsets[a]), int(offsets[b])) for a, b in self._runs]

    def decode(self, chunk: bytes) -> list[RawRecord]:
        first, end, start = self._next_run(chunk, "samples")
        bounds = self._offsets[first:end + 1] - start
        return self._decoder.records(chunk, bounds[:-1], bounds[1:], first)

    def finish(self) -> list[RawRecord]:
        return []


class MdsCompressedStream(PlannedStream):
    """A compressed shard: read whole (one range), decompressed, then decoded."""

    def __init__(self, decoder: _Decoder, entry: _Entry, size: int, *, source: str,
                 shard_name: str, on_skip: SkipCallback | None):
        super().__init__(source=source, shard_name=shard_name, on_skip=on_skip)
        self._decoder, self._entry, self._size = decoder, entry, size
        self._ranges = [(0, size)]

    def decode(self, chunk: bytes) -> list[RawRecord]:
        self._next_range()
        try:
            if len(chunk) != self._size:
                raise BadShard(f"expected {self._size} bytes, got {len(chunk)}")
            data = self._decompress(chunk)
            entry = self._entry
            if entry.raw_bytes is not None and len(data) != entry.raw_bytes:
                raise BadShard(f"decompresses to {len(data)} bytes, the index says "
                                f"{entry.raw_bytes}")
            offsets = _check_header(data[:4 * (entry.samples + 2)], entry.samples, len(data),
                                    f"the decompressed shard ({entry.raw})")
        except BadShard as exc:
            self._shard_error(str(exc))   # says that on_error="skip" would skip it
            return []
        return self._decoder.records(data, offsets[:-1], offsets[1:], 0)

    def finish(self) -> list[RawRecord]:
        return []

    def _decompress(self, chunk: bytes) -> bytes:
        algo = self._entry.compression
        try:
            if algo == "zstd":
                inflater = zstandard.ZstdDecompressor().decompressobj()
                data = inflater.decompress(chunk)
                if not inflater.eof:
                    raise BadShard("corrupt zstd data: the stream is truncated")
                return data
            if algo == "gz":
                return gzip.decompress(chunk)
            return bz2.decompress(chunk)
        except (zstandard.ZstdError, zlib.error, OSError, EOFError, ValueError) as exc:
            raise BadShard(f"corrupt {algo} data: {exc}") from None


# ---------------------------------------------------------------- the format


class MdsFormat:
    """MDS shards (`shard.NNNNN.mds[.zstd|.gz|.bz2]`) with the `index.json` beside them."""

    name = "mds"
    # "scan" (decoded records) but for fixed-shape token columns, measured from the index:
    # `document_lengths` sets it to what it used last.

    def __init__(self, text_field: str | None = None, tokens_field: str | None = None,
                 named: bool = False):
        self.tokens = tokens_field is not None
        self.field = tokens_field if self.tokens else ("text" if text_field is None
                                                       else text_field)
        if not self.field:
            raise ConfigError.at("tokens_field" if self.tokens else "text_field",
                                 "must be a non-empty string (the MDS column to read)")
        # Directory URI -> _Directory, the least recently used dropped past a bound. A format
        # instance is shared by every loader of the process (each its own event loop), so the
        # cache is guarded by a lock, and loads in flight are shared per event loop.
        self._lock = threading.Lock()
        self._directories: OrderedDict[str, _Directory] = OrderedDict()
        self._loading: dict[tuple[int, str], asyncio.Task] = {}

    def matches(self, uri: str) -> bool:
        return _SHARD_NAME.fullmatch(uri.rsplit("/", 1)[-1]) is not None

    # -- the index, once per directory

    async def _directory(self, store: ObjectStore, uri: str, refresh: bool) -> _Directory:
        if not refresh:
            with self._lock:
                found = self._directories.get(uri)
                if found is not None:
                    self._directories.move_to_end(uri)
                    return found
        loop = asyncio.get_running_loop()
        key = (id(loop), uri)
        with self._lock:
            task = self._loading.get(key)
            if task is None:
                task = loop.create_task(_load_directory(store, uri))
                self._loading[key] = task
                task.add_done_callback(lambda t: self._loaded(key, uri, t))
        return await asyncio.shield(task)

    def _loaded(self, key: tuple[int, str], uri: str, task: asyncio.Task) -> None:
        with self._lock:
            if self._loading.get(key) is task:
                del self._loading[key]
            if task.cancelled() or task.exception() is not None:
                return   # errors are not kept: the next open tries again
            self._directories[uri] = task.result()
            self._directories.move_to_end(uri)
            while len(self._directories) > _CACHED_DIRECTORIES:
                self._directories.popitem(last=False)

    async def _resolve(self, store: ObjectStore, shard: ObjectInfo, *, source: str,
                       shard_name: str, on_skip: SkipCallback | None,
                       report_missing: bool = True) -> tuple[_Entry, str, _Layout] | None:
        """(entry, kind, layout) for a shard: kind "raw", "zip" or "copy" (a compressed copy
        whose raw file is read instead). Shard-level problems raise DataError, or with
        `on_skip` are reported and give None."""
        if "/" not in shard.uri:
            raise DataError(f"cannot find the directory of {shard.uri!r}", source=source,
                            shard=shard_name)
        directory_uri, name = shard.uri.rsplit("/", 1)
        try:
            directory = await self._directory(store, directory_uri, refresh=False)
            if not directory.fits(name, shard.size) or name not in directory.entries:
                directory = await self._directory(store, directory_uri, refresh=True)
            if report_missing:
                self._report_missing(directory, name, source=source, shard_name=shard_name,
                                     on_skip=on_skip)
            entry = directory.entries.get(name)
            if entry is None:
                listed = [e.raw for e in directory.order]
                raise BadShard(f"the shard is not named in {directory.index_uri} (it names "
                                f"{len(listed)} shard(s): {', '.join(listed[:5])}"
                                f"{', ...' if len(listed) > 5 else ''})")
            if name == entry.raw:
                kind, expected = "raw", entry.raw_bytes
            elif entry.raw in directory.files:
                kind, expected = "copy", None
            else:
                kind, expected = "zip", entry.zip_bytes
                if entry.compression not in _DECOMPRESSORS:
                    raise BadShard(f"compression {entry.compression!r} is not supported "
                                    f"(zstd, gz and bz2 are)")
            if expected is not None and shard.size != expected:
                raise BadShard(f"the shard holds {shard.size} bytes but "
                                f"{directory.index_uri} says {expected}: it is truncated, or "
                                f"the index is not this shard's")
            return entry, kind, _layout(entry, self.field, self.tokens)
        except BadShard as exc:
            shard_failed(exc, source, shard_name, on_skip)
            return None

    @staticmethod
    def _report_missing(directory: _Directory, name: str, *, source: str, shard_name: str,
                        on_skip: SkipCallback | None) -> None:
        """Shards the index names that do not exist: an error from every shard of the
        directory, or in skip mode one counted skip each, reported by one shard."""
        if not directory.missing or (on_skip is not None and name != directory.reporter):
            return
        folder = shard_name.rsplit("/", 1)[0] + "/" if "/" in shard_name else ""
        for missing, samples in directory.missing:
            reason = (f"{directory.index_uri} names shard {missing!r} ({samples} samples), "
                      f"which does not exist")
            if on_skip is None:
                raise DataError(reason, source=source, shard=folder + missing, skippable=True)
            on_skip(None, reason)

    # -- reading

    async def open(self, store: ObjectStore, shard: ObjectInfo, *, source: str, shard_name: str,
                   on_skip: SkipCallback | None, chunk_bytes: int
                   ) -> MdsRawStream | MdsCompressedStream | EmptyStream:
        return await self._open(store, shard, source=source, shard_name=shard_name,
                                on_skip=on_skip, chunk_bytes=chunk_bytes, report_missing=True)

    async def _open(self, store: ObjectStore, shard: ObjectInfo, *, source: str,
                    shard_name: str, on_skip: SkipCallback | None, chunk_bytes: int,
                    report_missing: bool) -> MdsRawStream | MdsCompressedStream | EmptyStream:
        if chunk_bytes <= 0:
            raise ConfigError.at("chunk_bytes", f"must be positive, got {chunk_bytes}")
        resolved = await self._resolve(store, shard, source=source, shard_name=shard_name,
                                       on_skip=on_skip, report_missing=report_missing)
        if resolved is None or resolved[1] == "copy":
            return EmptyStream()
        entry, kind, layout = resolved
        decoder = _Decoder(layout, source=source, shard_name=shard_name, on_skip=on_skip)
        if kind == "zip":
            return MdsCompressedStream(decoder, entry, shard.size, source=source,
                                       shard_name=shard_name, on_skip=on_skip)
        try:
            want = 4 * (entry.samples + 2)
            head = await store.read_range(shard.uri, 0, min(want, shard.size))
            offsets = _check_header(head, entry.samples, shard.size, "the shard")
        except BadShard as exc:
            shard_failed(exc, source, shard_name, on_skip)
            return EmptyStream()
        return MdsRawStream(decoder, offsets, chunk_bytes, source=source, shard_name=shard_name)

    async def document_lengths(self, store: ObjectStore, shard: ObjectInfo, *, source: str,
                               shard_name: str, on_skip: SkipCallback | None,
                               tokenizer: TextTokenizer | None = None, limit: int | None = None,
                               chunk_bytes: int = LENGTHS_CHUNK_BYTES) -> DocumentLengths:
        """Each document's length in tokens (`ShardFormat.document_lengths`). A token column
        of fixed shape: from the index alone (its sample count; the shard is not read).
        Otherwise the samples are decoded and measured (texts with `tokenizer`, UTF-8 bytes
        without one)."""
        if limit is not None and limit < 0:
            raise ConfigError.at("limit", f"must be >= 0, got {limit}")
        if self.tokens:
            resolved = await self._resolve(store, shard, source=source, shard_name=shard_name,
                                           on_skip=on_skip)
            if resolved is None or resolved[1] == "copy":
                return DocumentLengths(np.zeros(0, np.int64), "index")
            entry, _, layout = resolved
            if layout.static_count is not None:
                n = entry.samples if limit is None else min(limit, entry.samples)
                return DocumentLengths(np.full(n, layout.static_count, np.int64), "index")
        # Token columns were resolved above, missing shards reported: not a second time.
        reader = _Reader(self, report_missing=not self.tokens)
        return await stream_lengths(reader, store, shard, source=source, shard_name=shard_name,
                                    on_skip=on_skip, tokenizer=tokenizer, limit=limit,
                                    chunk_bytes=chunk_bytes)


class _Reader:
    """`MdsFormat.open` for `lengths.stream_lengths`, with or without the missing-shard report."""

    def __init__(self, fmt: MdsFormat, report_missing: bool):
        self._fmt, self._report_missing = fmt, report_missing

    async def open(self, store: ObjectStore, shard: ObjectInfo, **options):
        return await self._fmt._open(store, shard, report_missing=self._report_missing,
                                     **options)
