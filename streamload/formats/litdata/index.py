"""A LitData dataset's `index.json`: its chunks in order (`Chunk`) and what the directory holds of
them (`Dataset`), read with one listing of the directory (`load_dataset`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from ...storage.base import ObjectStore
from ..base import BadShard
from .layouts import Layout, parse_config


INDEX_NAME = "index.json"


@dataclass(frozen=True)
class Chunk:
    position: int          # in the index's "chunks" list
    filename: str
    items: int
    dim: Optional[int]


@dataclass
class Dataset:
    """One directory's index.json, parsed, and the chunk files listed next to it."""
    directory: str
    chunks: dict[str, Chunk]
    present: dict[str, int]            # chunk file name -> size, from the listing
    missing: list[Chunk]              # named by the index, not listed
    first_present: Optional[str]       # the first chunk (in index order) that exists
    layout: Optional[Layout]
    layout_error: Optional[BadShard]   # why the dataset cannot be read (every chunk fails)


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def index_json_name(shard_name: str) -> str:
    return shard_name.rsplit("/", 1)[0] + "/" + INDEX_NAME if "/" in shard_name else INDEX_NAME


async def load_dataset(store: ObjectStore, directory: str, *, text_field: str,
                       tokens_field: Optional[str], block_size: Optional[int]) -> Dataset:
    """`directory`'s dataset: its listing (the chunks that exist, their sizes) and its
    `index.json` parsed with the source's fields. What makes it unreadable is kept as the
    Dataset's `layout_error` (every chunk of it fails with that), not raised."""
    listing = await store.list(glob_escape(directory) + "/*")
    files = {info.uri.rsplit("/", 1)[-1]: info.size for info in listing
             if info.uri.rsplit("/", 1)[0] == directory}
    index_uri = f"{directory}/{INDEX_NAME}"
    if INDEX_NAME not in files:
        return Dataset(directory, {}, {}, [], None, None, BadShard(
            f"there is no {INDEX_NAME} next to it (a litdata dataset needs its index; was "
            f"litdata.optimize interrupted?)"))
    data = await store.read_range(index_uri, 0, files[INDEX_NAME])
    try:
        index = json.loads(data)
        entries = index["chunks"]
        if not isinstance(entries, list):
            raise TypeError("'chunks' is not a list")
        chunks: dict[str, Chunk] = {}
        for position, entry in enumerate(entries):
            filename, items = entry["filename"], entry["chunk_size"]
            dim = entry.get("dim")
            if not isinstance(filename, str) or not isinstance(items, int) or items < 0 \
                    or not (dim is None or isinstance(dim, int)):
                raise TypeError(f"chunk entry {position} is malformed: {entry!r}")
            chunks[filename] = Chunk(position, filename, items, dim)
    except (ValueError, TypeError, KeyError) as exc:
        return Dataset(directory, {}, {}, [], None, None, BadShard(
            f"its {INDEX_NAME} is unreadable: {type(exc).__name__}: {exc}"))
    try:
        layout, error = parse_config(index.get("config"), text_field=text_field,
                                      tokens_field=tokens_field,
                                      block_size=block_size), None
    except BadShard as exc:   # kept as an exception: a MissingField offers no skip
        layout, error = None, type(exc)(f"{INDEX_NAME}: {exc}")
    present = {name: size for name, size in files.items() if name in chunks}
    ordered = sorted(chunks.values(), key=lambda c: c.position)
    missing = [c for c in ordered if c.filename not in present]
    first = next((c.filename for c in ordered if c.filename in present), None)
    return Dataset(directory, chunks, present, missing, first, layout, error)
