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
read once per directory with a listing of the directory (`load_index`) and kept by the
source's catalog (`catalog.Indexed`), not by the format, which every Loader shares.
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

The package keeps apart what LitData's and MosaicML's own readers keep apart: `index.py` reads
`index.json`, `layouts.py` finds the column in a sample and decodes it, `stream.py` reads a
shard's bytes; this module is the format (detection, the index cache, open, lengths).
"""
from __future__ import annotations

import re

import numpy as np

from ...errors import ConfigError, DataError
from ...storage.base import ObjectInfo, ObjectStore
from ...tokenizer import TextTokenizer
from ..base import LENGTHS_CHUNK_BYTES, BadShard, DocumentLengths, EmptyStream, Problems
from ..lengths import stream_lengths
from .index import Directory, Entry, load_directory
from .layouts import Decoder, Layout, check_header, layout_of
from .stream import DECOMPRESSORS, MdsCompressedStream, MdsRawStream


_SHARD_NAME = re.compile(r"shard\.\d+\.mds(?:\.(zstd|gz|bz2|br|snappy))?")


# ---------------------------------------------------------------- the format


class MdsFormat:
    """MDS shards (`shard.NNNNN.mds[.zstd|.gz|.bz2]`) with the `index.json` beside them."""

    name = "mds"

    def __init__(self, text_field: str | None = None, tokens_field: str | None = None,
                 named: bool = False):
        self.tokens = tokens_field is not None
        self.field = tokens_field if self.tokens else ("text" if text_field is None
                                                       else text_field)
        if not self.field:
            raise ConfigError.at("tokens_field" if self.tokens else "text_field",
                                 "must be a non-empty string (the MDS column to read)")

    def matches(self, uri: str) -> bool:
        return _SHARD_NAME.fullmatch(uri.rsplit("/", 1)[-1]) is not None

    # -- the index, once per directory (the catalog's, `catalog.Indexed`)

    async def load_index(self, store: ObjectStore, directory_uri: str) -> Directory:
        """The directory's listing and parsed index.json (BadShard when it is missing or
        unreadable). The catalog keeps one per directory for its source and passes it to
        `open` and `document_lengths` as `index`; the format keeps none."""
        return await load_directory(store, directory_uri)

    async def _resolve(self, store: ObjectStore, shard: ObjectInfo, problems: Problems, *,
                       index: object = None) -> tuple[Entry, str, Layout] | None:
        """(entry, kind, layout) for a shard: kind "raw", "zip" or "copy" (a compressed copy
        whose raw file is read instead). `index`: the directory's (`load_index`), or the
        BadShard loading it raised; None, or one that does not list the shard as the catalog
        did (the directory was rewritten): read here. Shard-level problems are reported and
        give None."""
        if "/" not in shard.uri:
            raise DataError(f"cannot find the directory of {shard.uri!r}",
                            source=problems.source, shard=problems.shard_name)
        directory_uri, name = shard.uri.rsplit("/", 1)
        try:
            if isinstance(index, BadShard):   # a fresh copy: the catalog's is shared
                raise type(index)(str(index))
            directory = index
            if directory is None or not directory.fits(name, shard.size) \
                    or name not in directory.entries:
                directory = await self.load_index(store, directory_uri)
            self._report_missing(directory, name, problems)
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
                if entry.compression not in DECOMPRESSORS:
                    raise BadShard(f"compression {entry.compression!r} is not supported "
                                    f"(zstd, gz and bz2 are)")
            if expected is not None and shard.size != expected:
                raise BadShard(f"the shard holds {shard.size} bytes but "
                                f"{directory.index_uri} says {expected}: it is truncated, or "
                                f"the index is not this shard's")
            return entry, kind, layout_of(entry, self.field, self.tokens)
        except BadShard as exc:
            problems.bad_shard(exc)
            return None

    @staticmethod
    def _report_missing(directory: Directory, name: str, problems: Problems) -> None:
        """Shards the index names that do not exist, each reported as that shard's problem, a
        problem of the directory (`Problems.directory`): every shard of it raises it, the
        directory's `reporter` counts it when it is skipped."""
        name_of = problems.shard_name
        folder = name_of.rsplit("/", 1)[0] + "/" if "/" in name_of else ""
        for missing, samples in directory.missing:
            problems.directory(f"{directory.index_uri} names shard {missing!r} ({samples} "
                               f"samples), which does not exist", shard=folder + missing,
                               counted_here=name == directory.reporter)

    # -- reading

    async def open(self, store: ObjectStore, shard: ObjectInfo, *, problems: Problems,
                   chunk_bytes: int, index: object = None
                   ) -> MdsRawStream | MdsCompressedStream | EmptyStream:
        """`index`: the shard's directory's (`load_index`; see `_resolve`)."""
        if chunk_bytes <= 0:
            raise ConfigError.at("chunk_bytes", f"must be positive, got {chunk_bytes}")
        resolved = await self._resolve(store, shard, problems, index=index)
        if resolved is None or resolved[1] == "copy":
            return EmptyStream()
        entry, kind, layout = resolved
        decoder = Decoder(layout, problems)
        if kind == "zip":
            return MdsCompressedStream(decoder, entry, shard.size, problems=problems)
        try:
            want = 4 * (entry.samples + 2)
            head = await store.read_range(shard.uri, 0, min(want, shard.size))
            offsets = check_header(head, entry.samples, shard.size, "the shard")
        except BadShard as exc:
            problems.bad_shard(exc)
            return EmptyStream()
        return MdsRawStream(decoder, offsets, chunk_bytes, problems=problems)

    async def document_lengths(self, store: ObjectStore, shard: ObjectInfo, *,
                               problems: Problems, tokenizer: TextTokenizer | None = None,
                               limit: int | None = None, chunk_bytes: int = LENGTHS_CHUNK_BYTES,
                               index: object = None) -> DocumentLengths:
        """Each document's length in tokens (`ShardFormat.document_lengths`). A token column
        of fixed shape: from the index alone (its sample count; the shard is not read).
        Otherwise the samples are decoded and measured (texts with `tokenizer`, UTF-8 bytes
        without one)."""
        if limit is not None and limit < 0:
            raise ConfigError.at("limit", f"must be >= 0, got {limit}")
        if self.tokens:
            resolved = await self._resolve(store, shard, problems, index=index)
            if resolved is None or resolved[1] == "copy":
                return DocumentLengths(np.zeros(0, np.int64), "index")
            entry, _, layout = resolved
            if layout.static_count is not None:
                n = entry.samples if limit is None else min(limit, entry.samples)
                return DocumentLengths(np.full(n, layout.static_count, np.int64), "index")
        # A token column resolved above reported the missing shards; `problems` counts them
        # once however often they are reported (`Problems.directory`).
        return await stream_lengths(self, store, shard, problems=problems, tokenizer=tokenizer,
                                    limit=limit, chunk_bytes=chunk_bytes, index=index)
