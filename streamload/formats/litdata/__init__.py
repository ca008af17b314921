"""LitData optimized datasets (Lightning AI's `litdata.optimize` output).

A dataset is a directory: `index.json` plus chunk files `chunk-{rank}-{index}.bin` (with
whole-file compression `chunk-{rank}-{index}.{compression}.bin`). The chunk files are the
shards; `index.json` is their companion, read once per directory (and listed with the
directory, so that chunks it names but that are missing show: `load_index`) and kept by the
source's catalog (`catalog.Indexed`), not by the format, which every Loader shares.

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
  b"LDARW01\0"); read with pyarrow.

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

The package keeps apart what LitData keeps apart: `index.py` reads `index.json` and the
directory, `layouts.py` the item layouts and their decoding, `stream.py` a chunk's header, plan
and bytes; this module is the format (detection, the index cache, open, lengths).
"""
from __future__ import annotations

import re

import numpy as np

from ...errors import ConfigError
from ...storage.base import ObjectInfo, ObjectStore
from ...tokenizer import TextTokenizer
from ..base import LENGTHS_CHUNK_BYTES, BadShard, DocumentLengths, EmptyStream, Problems
from ..lengths import stream_lengths
from .index import Chunk, Dataset, index_json_name, load_dataset
from .stream import LitdataStream, index_lengths, plan_chunk


CHUNK_NAME = re.compile(r"chunk-\d+-\d+(?:\.[A-Za-z0-9_:+-]+)?\.bin")


class LitdataFormat:
    """LitData chunks `chunk-*.bin` with their directory's `index.json` (see the module
    docstring). `text_field` (default "text") names the text leaf, `tokens_field` a 1-D integer
    leaf read instead; `block_size` cuts TokensLoader chunks into blocks as litdata's
    TokensLoader(block_size) does (else each written item is a record)."""

    name = "litdata"

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

    def matches(self, uri: str) -> bool:
        return CHUNK_NAME.fullmatch(uri.rsplit("/", 1)[-1]) is not None

    # -- the directory's index (the catalog's, `catalog.Indexed`)

    async def load_index(self, store: ObjectStore, directory: str) -> Dataset:
        """The directory's listing and parsed index.json, with this format's fields. The
        catalog keeps one per directory for its source and passes it to `open` and
        `document_lengths` as `index`; the format keeps none."""
        return await load_dataset(store, directory, text_field=self.text_field,
                                  tokens_field=self.tokens_field, block_size=self.block_size)

    async def _open_chunk(self, store: ObjectStore, shard: ObjectInfo, problems: Problems,
                          index: object) -> tuple[Dataset, Chunk]:
        """The dataset and the shard's index entry; BadShard for what makes the shard
        unreadable. A chunk the index names but that is missing is a problem of the directory
        (`Problems.directory`): every chunk raises it, the first of the index that exists counts
        it when it is skipped (once per pass).
        `index`: the directory's (`load_index`); None, or one that does not list the chunk as
        the catalog did (the dataset was rewritten): read here."""
        directory, name = shard.uri.rsplit("/", 1)
        dataset = index
        if dataset is None or name not in dataset.chunks \
                or dataset.present.get(name) != shard.size:
            dataset = await self.load_index(store, directory)
        if dataset.layout_error is not None:   # a fresh copy: the dataset is shared
            raise type(dataset.layout_error)(str(dataset.layout_error))
        index_name = index_json_name(problems.shard_name)
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
            problems.directory(reason, counted_here=name == dataset.first_present)
        return dataset, chunk

    # -- the protocol

    async def open(self, store: ObjectStore, shard: ObjectInfo, *, problems: Problems,
                   chunk_bytes: int, index: object = None):
        """`index`: the chunk's directory's (`load_index`; see `_open_chunk`)."""
        if chunk_bytes <= 0:
            raise ConfigError.at("chunk_bytes", f"must be positive, got {chunk_bytes}")
        try:
            dataset, chunk = await self._open_chunk(store, shard, problems, index)
            plan = await plan_chunk(store, shard, dataset.layout, chunk, chunk_bytes)
        except BadShard as exc:
            problems.bad_shard(exc)
            return EmptyStream()
        return LitdataStream(plan, dataset.layout, problems=problems, expected_items=chunk.items,
                             dim=chunk.dim)

    async def document_lengths(self, store: ObjectStore, shard: ObjectInfo, *,
                               problems: Problems, tokenizer: TextTokenizer | None = None,
                               limit: int | None = None, chunk_bytes: int = LENGTHS_CHUNK_BYTES,
                               index: object = None) -> DocumentLengths:
        """Each record's length in tokens (`ShardFormat.document_lengths`): from index.json
        alone for TokensLoader blocks; from the chunk's offsets for TokensLoader items, token
        fields, and texts without a tokenizer when the other leaves have fixed sizes (the
        records are not decoded, so a bad one is not noticed here); else by a scan."""
        if limit is not None and limit < 0:
            raise ConfigError.at("limit", f"must be >= 0, got {limit}")
        try:
            dataset, chunk = await self._open_chunk(store, shard, problems, index)
            lengths = await index_lengths(store, shard, dataset.layout, chunk, tokenizer)
        except BadShard as exc:
            problems.bad_shard(exc)
            return DocumentLengths(np.zeros(0, np.int64), "index")
        if lengths is None:   # a scan (its `open` sees a missing chunk again: counted once)
            return await stream_lengths(self, store, shard, problems=problems,
                                        tokenizer=tokenizer, limit=limit,
                                        chunk_bytes=chunk_bytes, index=index)
        return DocumentLengths(lengths if limit is None else lengths[:limit], "index")
