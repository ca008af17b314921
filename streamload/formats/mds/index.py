"""An MDS directory's `index.json`: its shards in order, each with its files, sample count and
columns (`Entry`), read with one listing of the directory (`load_directory`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import msgspec

from ...storage.base import ObjectStore
from ..base import BadShard


INDEX_NAME = "index.json"


def _escape_glob(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


# ---------------------------------------------------------------- the index


@dataclass(frozen=True)
class Entry:
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
class Directory:
    """A directory's listing (direct children: name -> size) and its parsed index.json."""
    uri: str
    files: dict
    entries: dict                 # basename (raw and zip) -> Entry
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


def _parse_index(data: bytes, index_uri: str) -> list[Entry]:
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
        entries.append(Entry(position, raw, raw_bytes, zip_name, zip_bytes,
                              compression if zip_name is not None else None, samples,
                              tuple(names), tuple(encodings), sizes))
    return entries


async def load_directory(store: ObjectStore, uri: str) -> Directory:
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
    return Directory(uri, files, entries, tuple(order), tuple(missing), reporter)
