"""A source's catalog: the shards it holds, and the objects beside them that no format reads.

`await catalog(source, store)` lists the source once and sorts what it finds into

* `shards`: every object a format reads, sorted by URI (a shard's position is its stable id);
* `left_out`: objects of no known format, with what to do about each kind (`LeftOut.hint`), so
  that a directory source does not quietly deliver a quarter of its files. The loader logs them
  as one WARNING at start (`Catalog.warning`); `streamload inspect` lists them.

Companion files (an index beside its shards: `index.json`, Megatron's `.idx`, a token shard's
`.offsets.npy`) and hidden ones (`.x`, `_SUCCESS`) are neither.

Formats whose shards share a directory's index (MDS, LitData: a `load_index` method) get their
indexes from the catalog: each shard's `format` is an `Indexed`, the shared format with this
catalog's indexes, read once per directory at listing time (every directory concurrently) and
passed to the format's `open` and `document_lengths`. The format objects, shared by every
Loader of the process, keep no state.

A `.json` name (optionally `.gz` / `.zst`) is ambiguous: Hugging Face dumps write JSON Lines
under it, but a directory may also hold a single JSON document (a dataset card, a config).
When the source does not name its format, the catalog reads the first bytes of each such object
(one ranged read of at most `SNIFF_BYTES`) and reads it as JSON Lines when its first record is
an object holding the text field; any other `.json` is left out with the hint
`format="jsonl"`.
"""
from __future__ import annotations

import asyncio
import re
import zlib
from dataclasses import dataclass, field

import msgspec
import zstandard

from ..config import Source
from ..errors import ConfigError, StorageError
from ..storage import ObjectInfo, ObjectStore, relative_name
from . import format_for
from .base import BadShard, DocumentLengths, ShardFormat, ShardStream

# A shard's compression suffix: x.jsonl and x.jsonl.zst are one shard in two encodings.
_COMPRESSION = re.compile(r"\.(gz|zst|zstd|bz2|xz)$", re.IGNORECASE)
# Compressions no format decompresses: a file under one is left out with a hint.
_UNSUPPORTED = re.compile(r"\.(bz2|xz|lzma|lz4|br|zip|7z|rar|z)$", re.IGNORECASE)
_JSON = re.compile(r"\.json(\.gz|\.zst|\.zstd)?$", re.IGNORECASE)
# Files that belong beside shards: indexes that a format reads with its shard.
_COMPANIONS = re.compile(r"(^|/)index\.json$|\.idx$|\.offsets\.npy$", re.IGNORECASE)
SNIFF_BYTES = 64 << 10   # read from a `.json` object to tell JSON Lines from a JSON document
NAMES_SHOWN = 3          # names per kind in the warning


@dataclass(frozen=True)
class Shard:
    index: int            # position in the sorted listing: the stable shard id
    name: str             # name relative to the source URI, used in sample ids
    info: ObjectInfo
    format: ShardFormat


class Indexed:
    """A format whose shards share their directory's index (`fmt.load_index(store,
    directory)`), with the indexes of one catalog: each read once, when the catalog lists the
    source (`load`), and shared by the directory's shards. A load that failed (a StorageError)
    is tried again by the next shard of the directory to open, which reports the error as it
    would one reading its own bytes; a BadShard is kept, and every shard of the directory
    reports it. One per format and catalog, used on one event loop."""

    def __init__(self, fmt: ShardFormat):
        self.format, self.name = fmt, fmt.name
        self._loads: dict[str, asyncio.Task] = {}   # directory URI -> its index (or BadShard)

    def matches(self, uri: str) -> bool:
        return self.format.matches(uri)

    async def index(self, store: ObjectStore, uri: str) -> object:
        """The index of the directory holding `uri`, or the BadShard reading it raised."""
        directory = uri.rsplit("/", 1)[0]
        task = self._loads.get(directory)
        if task is None:
            task = self._loads[directory] = asyncio.ensure_future(self._load(store, directory))
        try:
            return await asyncio.shield(task)   # one shard cancelled: the others still wait
        except Exception:
            if self._loads.get(directory) is task:
                del self._loads[directory]
            raise

    async def load(self, store: ObjectStore, uri: str) -> None:
        """Read the index of the directory holding `uri` now (the catalog, at listing time).
        A failure other than a BadShard is not kept: the directory's first shard to open meets
        it again and reports it (listing fails only for what listing itself finds)."""
        try:
            await self.index(store, uri)
        except Exception:
            pass

    async def _load(self, store: ObjectStore, directory: str) -> object:
        try:
            return await self.format.load_index(store, directory)
        except BadShard as exc:
            return exc

    async def open(self, store: ObjectStore, shard: ObjectInfo, **options) -> ShardStream:
        return await self.format.open(store, shard, index=await self.index(store, shard.uri),
                                      **options)

    async def document_lengths(self, store: ObjectStore, shard: ObjectInfo,
                               **options) -> DocumentLengths:
        return await self.format.document_lengths(
            store, shard, index=await self.index(store, shard.uri), **options)


@dataclass(frozen=True)
class LeftOut:
    name: str             # relative to the source URI
    hint: str             # what it is and what to do, the same for every object of its kind


@dataclass
class Catalog:
    source: Source
    shards: list[Shard]
    left_out: list[LeftOut] = field(default_factory=list)

    def warning(self) -> str | None:
        """One message for everything left out, by kind: the count, a few names, the hint."""
        if not self.left_out:
            return None
        kinds: dict[str, list[str]] = {}
        for item in self.left_out:
            kinds.setdefault(item.hint, []).append(item.name)
        parts = []
        for hint, names in kinds.items():
            shown = ", ".join(repr(n) for n in names[:NAMES_SHOWN])
            more = f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
            parts.append(f"{len(names)} {shown}{more}: {hint}")
        return (f"source {self.source.name!r} ({self.source.uri}): {len(self.left_out)} "
                f"object(s) of no format this source reads are left out: " + "; ".join(parts))


def _hint(name: str, source: Source) -> str:
    """Why `name` is left out, and what to do; `source.format` None: names were auto-detected."""
    unsupported = _UNSUPPORTED.search(name)
    if unsupported:
        return (f"{unsupported.group(0)} compression is not supported; recompress as .zst or "
                f".gz")
    if source.format is None and _JSON.search(name):
        return (f"JSON that is not JSON Lines with a {source.text_field or 'text'!r} field; "
                f"format=\"jsonl\" reads .json files as JSON Lines")
    if source.format is not None:
        other = format_for(name, text_field=source.text_field, tokens_field=source.tokens_field)
        if other is not None:
            return (f"{other.name} files; this source reads format={source.format!r} only "
                    f"(a source per format reads both)")
    return "no known format (see docs/formats.md)"


def _prefix_text(data: bytes, name: str) -> bytes:
    """The decompressed start of a `.json[.gz|.zst]` object (as much as `data` holds)."""
    lower = name.lower()
    if lower.endswith(".gz"):
        return zlib.decompressobj(wbits=31).decompress(data)
    if lower.endswith((".zst", ".zstd")):
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return data


def is_json_lines(start: bytes, text_field: str) -> bool:
    """True when `start` (the first bytes of an object) begins with a JSON Lines record: an
    object whose `text_field` is a string. A first line longer than `start` is judged by its
    opening: an object whose first key is `text_field`."""
    start = start.lstrip(b"\xef\xbb\xbf").lstrip()
    line, newline, _ = start.partition(b"\n")
    if newline or len(start) < SNIFF_BYTES:   # the whole first line is here
        try:
            record = msgspec.json.decode(line)
        except msgspec.MsgspecError:
            return False
        return isinstance(record, dict) and isinstance(record.get(text_field), str)
    key = msgspec.json.encode(text_field)
    return re.match(rb"\{\s*" + re.escape(key) + rb"\s*:\s*\"", line) is not None


async def _reads_as_jsonl(store: ObjectStore, info: ObjectInfo, text_field: str) -> bool:
    try:
        data = await store.read_range(info.uri, 0, min(info.size, SNIFF_BYTES))
        return is_json_lines(_prefix_text(data, info.uri)[:SNIFF_BYTES], text_field)
    except (zlib.error, zstandard.ZstdError):
        return False


async def catalog(source: Source, store: ObjectStore) -> Catalog:
    """Every shard of `source`, sorted, and what is left out (see the module docstring). A
    source with no shard is a StorageError; one shard in two encodings a ConfigError."""
    objects = sorted(await store.list(source.uri))
    formats: list[ShardFormat | None] = []
    undecided = []   # `.json` objects to sniff (auto-detection only)
    for k, info in enumerate(objects):
        fmt = format_for(info.uri, format_name=source.format, text_field=source.text_field,
                         tokens_field=source.tokens_field, images=source.images)
        formats.append(fmt)
        if fmt is None and source.format is None and _JSON.search(info.uri) \
                and not _COMPANIONS.search(info.uri):
            undecided.append(k)
    if undecided:
        text_field = source.text_field or "text"
        found = await asyncio.gather(*(_reads_as_jsonl(store, objects[k], text_field)
                                       for k in undecided))
        jsonl = format_for(".jsonl", format_name="jsonl", text_field=source.text_field)
        for k, yes in zip(undecided, found):
            if yes:
                formats[k] = jsonl
    shards, left_out = [], []
    indexed: dict[int, Indexed] = {}   # id(format) -> the format with this catalog's indexes
    for info, fmt in zip(objects, formats):
        name = relative_name(source.uri, info.uri)
        if fmt is not None:
            if hasattr(fmt, "load_index"):
                fmt = indexed.setdefault(id(fmt), Indexed(fmt))
            shards.append(Shard(len(shards), name, info, fmt))
        elif not (_COMPANIONS.search(name) or name.rsplit("/", 1)[-1].startswith((".", "_"))):
            left_out.append(LeftOut(name, _hint(name, source)))
    _check_encodings(source, shards)
    directories = {(id(s.format), s.info.uri.rsplit("/", 1)[0]): s for s in shards
                   if isinstance(s.format, Indexed)}   # a shard per indexed directory
    await asyncio.gather(*(s.format.load(store, s.info.uri) for s in directories.values()))
    if not shards:
        seen = ", ".join(o.uri.rsplit("/", 1)[-1] for o in objects[:5])
        raise StorageError(
            f"source {source.name!r}: no shards match {source.uri}"
            + (f" ({len(objects)} object(s) found but none in a known format, e.g. {seen})"
               if objects else ""), uri=source.uri)
    return Catalog(source, shards, left_out)


def _check_encodings(source: Source, shards: list[Shard]) -> None:
    """The same shard in two encodings would be delivered twice. A format with a directory index
    (`Indexed`: MDS keeps a raw and a compressed copy side by side) picks one copy itself."""
    encodings: dict[str, list[str]] = {}
    for shard in shards:
        if not isinstance(shard.format, Indexed):
            encodings.setdefault(_COMPRESSION.sub("", shard.name), []).append(shard.name)
    twice = [names for names in encodings.values() if len(names) > 1]
    if twice:
        raise ConfigError.at(
            "uri", f"{twice[0][0]!r} and {twice[0][1]!r} hold the same shard in two encodings "
            f"({len(twice)} such pair(s)); every document would come twice. Point the source at "
            f"one of them with a glob (e.g. {source.uri.rstrip('/')}/*.zst) or remove the copies",
            where=f"source {source.name!r} ({source.uri}): ")


async def list_shards(source: Source, store: ObjectStore) -> list[Shard]:
    """Every shard of a source, sorted (`catalog(...).shards`)."""
    return (await catalog(source, store)).shards
