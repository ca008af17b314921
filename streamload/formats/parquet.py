"""Parquet shards, read by row group with ranged reads of one column (pyarrow decodes).

Detection: `*.parquet` (any case), which covers Hugging Face's Parquet exports,
`{config}/{split}/NNNN.parquet` and `data/{split}-NNNNN-of-NNNNN.parquet`: a source URI of the
dataset root or of one split folder lists them, and the fetcher's sorted listing reads them in
path order (config, split, then file number, zero-padded so the order is numeric too). Names
starting with "." or "_" are left out, as pyarrow's dataset discovery leaves them out (hidden
files, `_metadata` summaries, Spark's `_temporary`/`_SUCCESS` companions).

The record is one row; its index is the row's position in the file (the rows of the row groups
before it, plus its row in its row group), so it is stable whatever is read. The payload is
either the text of the string column `text_field` (default "text"), or, with `tokens_field`,
the token ids of a list-of-integers column (list, large_list or fixed_size_list of any integer
type).

Reading: `open` reads the file's tail (one request of up to 64 KiB, which holds the footer of
most files; a longer footer costs a second request) and parses the footer with pyarrow. Then
`ranges()` is one byte range per row group: the needed column's chunk (from its dictionary page,
or its first data page, for `total_compressed_size` bytes), nothing of the other columns. A row
group's chunk is one range whatever `chunk_bytes` says (a Parquet page cannot be decoded
alone, and the memory gate learns its expansion from what each range decodes to). `decode`
hands pyarrow a sparse file that holds only the footer's metadata and that range, and reads the
row group's column from it.

`document_lengths` scans: each row group's column is read as above and every document measured
(`lengths.stream_lengths`); for a token column that is each list's length. Parquet keeps no
per-row lengths apart from the values' pages, so no cheaper index exists.

Bad input: a file that is no Parquet (no `PAR1` magic, a footer that does not parse, an
encrypted footer), a missing column (the message lists the columns present) or a column of the
wrong type is a shard error: a DataError naming source and shard, or with on_error="skip" a
counted skip of the whole shard. A null text, a null token list, a null or negative token id
is a record error naming the row (skipped and counted with on_error="skip"). A row group whose
column does not decode stops the shard (a shard error; the rows before it stay delivered).

pyarrow is imported when a Parquet shard is first opened, so the rest of streamload works
without it installed.
"""
from __future__ import annotations

import io
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..storage.base import ObjectInfo, ObjectStore
from ..tokenizer import TextTokenizer
from .base import (LENGTHS_CHUNK_BYTES, BadShard, DocumentLengths, EmptyStream, MissingField,
                   PlannedStream, Problems, RawRecord, Records, field_hint, read_exact)
from .lengths import stream_lengths

_SUFFIX = ".parquet"
_MAGIC = b"PAR1"
_ENCRYPTED_MAGIC = b"PARE"
_TAIL_PROBE = 64 << 10       # bytes of the file's tail read first (pyarrow reads as much)
# pyarrow pads a column chunk's range by up to this much for files of old parquet-mr writers
# (PARQUET-816: the dictionary page header left out of total_compressed_size); the ranges
# include the same padding so that such files read too.
_DICT_HEADER_PADDING = 100



def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ImportError("reading Parquet shards needs pyarrow: pip install pyarrow") from exc
    return pyarrow


class _SparseFile(io.RawIOBase):
    """A read-only file of `size` bytes of which only some ranges are held; reading any other
    byte fails, so pyarrow is never given bytes that were not fetched."""

    def __init__(self, size: int, parts: list[tuple[int, bytes]]):
        super().__init__()
        self._size = size
        self._parts = parts
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._size - self._pos)
        if n <= 0:
            return 0
        for start, data in self._parts:
            if start <= self._pos and self._pos + n <= start + len(data):
                at = self._pos - start
                buffer[:n] = data[at:at + n]
                self._pos += n
                return n
        raise OSError(f"bytes {self._pos}-{self._pos + n} were not fetched")


async def _read_footer(store: ObjectStore, shard: ObjectInfo) -> tuple[Any, int]:
    """(pyarrow FileMetaData, where the footer starts): the tail read, the footer parsed."""
    pa = _pyarrow()
    size = shard.size
    if size < 12:
        raise BadShard(f"not a Parquet file ({size} bytes, too small)")
    probe = min(size, _TAIL_PROBE)
    tail = await read_exact(store, shard.uri, size - probe, size, "file")
    if tail[-4:] == _ENCRYPTED_MAGIC:
        raise BadShard("Parquet files with an encrypted footer are not supported")
    if tail[-4:] != _MAGIC:
        raise BadShard("not a Parquet file (no PAR1 magic at its end; truncated?)")
    length = int.from_bytes(tail[-8:-4], "little")
    footer_start = size - 8 - length
    if footer_start < 4:
        raise BadShard(f"footer length {length} does not fit in the file's {size} bytes")
    if 8 + length > len(tail):
        tail = await read_exact(store, shard.uri, footer_start, size - probe, "file") + tail
    footer = tail[len(tail) - 8 - length:]
    try:
        # A file of the footer alone parses as the same metadata (offsets stay the file's).
        metadata = pa.parquet.read_metadata(io.BytesIO(_MAGIC + footer))
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise BadShard(f"unreadable Parquet footer: {exc}") from None
    return metadata, footer_start


def _is_text(pa, type_) -> bool:
    if pa.types.is_dictionary(type_):
        type_ = type_.value_type
    return (pa.types.is_string(type_) or pa.types.is_large_string(type_)
            or getattr(pa.types, "is_string_view", lambda t: False)(type_))


def _is_token_list(pa, type_) -> bool:
    return ((pa.types.is_list(type_) or pa.types.is_large_list(type_)
             or pa.types.is_fixed_size_list(type_))
            and pa.types.is_integer(type_.value_type))


def _plan(metadata, field, footer_start: int, size: int
          ) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """(ranges, row groups, first row of each): one range per non-empty row group, covering the
    column chunk(s) of `field` (the leaves whose path is `field` or below it, as pyarrow
    selects a column by name; a tuple of names: all of theirs, one range spanning them)."""
    schema = metadata.schema
    names = (field,) if isinstance(field, str) else tuple(field)
    leaves = [i for i in range(metadata.num_columns) for name in names
              if schema.column(i).path == name or schema.column(i).path.startswith(name + ".")]
    ranges, groups, first_rows = [], [], []
    row = 0
    for k in range(metadata.num_row_groups):
        group = metadata.row_group(k)
        if group.num_rows:
            start, end = None, None
            for leaf in leaves:
                chunk = group.column(leaf)
                if chunk.file_path:
                    raise BadShard(f"row group {k}: column {field!r} lies in another file "
                                    f"({chunk.file_path!r}), which is not supported")
                begin = chunk.data_page_offset
                dictionary = chunk.dictionary_page_offset if chunk.has_dictionary_page else None
                if dictionary and 0 < dictionary < begin:
                    begin = dictionary
                stop = begin + chunk.total_compressed_size
                if begin < 4 or stop > footer_start:
                    raise BadShard(f"row group {k}: column {field!r} spans bytes {begin}-{stop}, "
                                    f"outside the data before the footer (0-{footer_start}); "
                                    "the file is corrupt")
                start = begin if start is None else min(start, begin)
                end = stop if end is None else max(end, stop)
            ranges.append((start, min(size, end + _DICT_HEADER_PADDING)))
            groups.append(k)
            first_rows.append(row)
        row += group.num_rows
    return ranges, groups, first_rows


class ParquetStream(PlannedStream):
    """State for reading one Parquet shard: the metadata, the planned row groups, the next one."""

    def __init__(self, shard: ObjectInfo, *, problems: Problems, metadata, footer_start: int,
                 field: str, tokens: bool):
        super().__init__(problems)
        self._pa = _pyarrow()
        self._size = shard.size
        self._metadata = metadata
        self._field, self._tokens = field, tokens
        self._ranges, self._groups, self._first_rows = _plan(metadata, field, footer_start,
                                                             shard.size)

    def _record_spans(self) -> list[tuple[int, int]]:
        return [(first, first + self._metadata.row_group(group).num_rows)
                for first, group in zip(self._first_rows, self._groups)]

    def decode(self, chunk: bytes) -> list[RawRecord]:
        group = self._read_group(chunk, [self._field])
        if group is None:
            return []
        first, table = group
        if self._tokens:
            return self._token_records(table.column(0), first)
        return self._text_records(table.column(0), first)

    def decode_columns(self, chunk: bytes) -> Records:
        """`decode` as columns: a row group's token ids as one buffer (Arrow's values, a view
        where Arrow allows) with its list offsets, or its texts as one list; no RawRecord
        per row."""
        group = self._read_group(chunk, [self._field])
        if group is None:
            return Records.empty()
        first, table = group
        column = table.column(0)
        if not self._tokens:
            column = self._plain(column)
            if column.null_count:
                return Records.of(self._text_records(column, first))
            texts = column.to_pylist()
            return Records(np.arange(first, first + len(texts), dtype=np.int64), texts=texts)
        ids, offsets, bad = self._token_lists(column, first)
        lo = int(offsets[0])
        records = Records(np.arange(first, first + offsets.shape[0] - 1, dtype=np.int64),
                          tokens=ids[lo:int(offsets[-1])],
                          offsets=offsets.astype(np.int64) - lo)
        if not bad:
            return records
        keep = np.ones(len(records), bool)
        keep[sorted(bad)] = False
        return records.select(keep)

    def _read_group(self, chunk: bytes, columns: list[str]):
        """The next range's row group as a table of `columns`, and its first row's index; None
        when the shard failed (now, with the error named, or before)."""
        k = self._next_range()
        if self._failed:
            return None
        start, end = self._ranges[k]
        group = self._groups[k]
        named = (f"column {columns[0]!r}" if len(columns) == 1
                 else "columns " + ", ".join(repr(c) for c in columns))
        if len(chunk) != end - start:
            self._shard_error(f"row group {group}: expected {end - start} bytes of {named}, got "
                              f"{len(chunk)} (did the file change?)")
            return None
        pa = self._pa
        try:
            file = pa.parquet.ParquetFile(_SparseFile(self._size, [(start, chunk)]),
                                          metadata=self._metadata)
            table = file.read_row_group(group, columns=columns, use_threads=False)
        except (OSError, ValueError, pa.ArrowException) as exc:
            self._shard_error(f"row group {group}: cannot decode {named}: {exc}")
            return None
        return self._first_rows[k], table

    def finish(self) -> list[RawRecord]:
        return []

    def _plain(self, column):
        """A text column without its dictionary encoding, if it has one."""
        if self._pa.types.is_dictionary(column.type):
            return column.cast(column.type.value_type)
        return column

    def _text_records(self, column, first: int) -> list[RawRecord]:
        column = self._plain(column)
        records = []
        for row, text in enumerate(column.to_pylist()):
            if text is None:
                self._record_error(first + row, f"null value in column {self._field!r}")
            else:
                records.append(RawRecord(first + row, text))
        return records

    def _token_records(self, column, first: int) -> list[RawRecord]:
        ids, offsets, bad = self._token_lists(column, first)
        starts, ends = offsets[:-1].tolist(), offsets[1:].tolist()
        return [RawRecord(first + row, ids[starts[row]:ends[row]])
                for row in range(len(starts)) if row not in bad]

    def _token_lists(self, column, first: int) -> tuple[np.ndarray, np.ndarray, set[int]]:
        """A row group's token-list column: every row's ids (values, nulls as 0), the rows'
        offsets into them, and the rows left out, reported (nulls, negative ids)."""
        pa = self._pa
        lists = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        if pa.types.is_fixed_size_list(lists.type):
            lists = lists.cast(pa.list_(lists.type.value_type))
        offsets = lists.offsets.to_numpy()            # positions in lists.values
        values = lists.values
        bad: dict[int, str] = {}
        if lists.null_count:
            for row in np.flatnonzero(lists.is_null().to_numpy(zero_copy_only=False)).tolist():
                bad[row] = f"null value in column {self._field!r}"
        if values.null_count:
            nulls = np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))
            for row in self._rows_at(offsets, nulls):
                bad.setdefault(row, f"null token id in column {self._field!r}")
            values = values.fill_null(0)
        ids = values.to_numpy(zero_copy_only=False)
        if ids.dtype.kind == "i":
            used = ids[offsets[0]:offsets[-1]]
            if used.size and used.min() < 0:
                negative = np.flatnonzero(used < 0) + offsets[0]
                for row in self._rows_at(offsets, negative):
                    bad.setdefault(row, f"negative token id in column {self._field!r}")
        for row in sorted(bad):
            self._record_error(first + row, bad[row])
        return ids, offsets, set(bad)

    @staticmethod
    def _rows_at(offsets: np.ndarray, positions: np.ndarray) -> list[int]:
        """The rows whose lists hold these positions of the values array."""
        rows = np.searchsorted(offsets, positions, side="right") - 1
        return sorted(set(r for r in rows.tolist() if 0 <= r < len(offsets) - 1))




class ParquetFormat:
    """`*.parquet` files: the text of column `text_field` (default "text"), or with
    `tokens_field` the token ids of a list-of-integers column."""

    name = "parquet"

    def __init__(self, text_field: str | None = None, tokens_field: str | None = None,
                 named: bool = False, images=None):
        self.images = images   # vision.Images: rows of text and an image column
        if images is not None and tokens_field is not None:
            raise ConfigError.at("images", "an image source reads text (text_field), not "
                                           "token ids (tokens_field)")
        if tokens_field is not None:
            if not tokens_field:
                raise ConfigError.at("tokens_field", "must be a non-empty string")
            self.field, self.tokens = tokens_field, True
        else:
            text_field = "text" if text_field is None else text_field
            if not text_field:
                raise ConfigError.at("text_field", "must be a non-empty string")
            self.field, self.tokens = text_field, False

    def matches(self, uri: str) -> bool:
        name = uri.rstrip("/").rsplit("/", 1)[-1]
        return (name.lower().endswith(_SUFFIX) and len(name) > len(_SUFFIX)
                and not name.startswith((".", "_")))

    async def open(self, store: ObjectStore, shard: ObjectInfo, *, problems: Problems,
                   chunk_bytes: int) -> ParquetStream | EmptyStream:
        """Reads the footer; `chunk_bytes` is not used (a range is a row group's column chunk)."""
        if chunk_bytes <= 0:
            raise ConfigError.at("chunk_bytes", f"must be positive, got {chunk_bytes}")
        pa = _pyarrow()
        try:
            metadata, footer_start = await _read_footer(store, shard)
            if self.images is not None:
                from .parquet_images import image_stream
                return image_stream(pa, shard, problems, metadata, footer_start, self.field,
                                    self.images)
            self._check_column(pa, metadata)
            return ParquetStream(shard, problems=problems, metadata=metadata,
                                 footer_start=footer_start, field=self.field, tokens=self.tokens)
        except BadShard as exc:
            problems.bad_shard(exc)
            return EmptyStream()

    def _check_column(self, pa, metadata) -> None:
        try:
            schema = metadata.schema.to_arrow_schema()
        except (ValueError, pa.ArrowException) as exc:
            raise BadShard(f"unreadable Parquet schema: {exc}") from None
        what = "tokens_field" if self.tokens else "text_field"
        if self.field not in schema.names:
            present = ", ".join(repr(n) for n in schema.names) or "none"
            raise MissingField(f"no column {self.field!r} ({what}); the file's columns are "
                               f"{present}{field_hint(what, self.field, schema.names)}")
        if schema.names.count(self.field) > 1:
            raise BadShard(f"column {self.field!r} ({what}) appears more than once")
        type_ = schema.field(self.field).type
        if self.tokens and not _is_token_list(pa, type_):
            raise BadShard(f"column {self.field!r} ({what}) must be a list of integers, "
                            f"found {type_}")
        if not self.tokens and not _is_text(pa, type_):
            hint = ("; a column of token ids is read with tokens_field"
                    if _is_token_list(pa, type_) else "")
            raise BadShard(f"column {self.field!r} ({what}) must hold strings, "
                            f"found {type_}{hint}")

    async def document_lengths(self, store: ObjectStore, shard: ObjectInfo, *,
                               problems: Problems, tokenizer: TextTokenizer | None = None,
                               limit: int | None = None,
                               chunk_bytes: int = LENGTHS_CHUNK_BYTES) -> DocumentLengths:
        """Each document's length in tokens (`ShardFormat.document_lengths`): the row groups'
        column read as the fetcher reads it (only as many row groups as `limit` needs) and each
        document measured: a token list's length, a text with `tokenizer` (UTF-8 bytes
        without one)."""
        return await stream_lengths(self, store, shard, problems=problems, tokenizer=tokenizer,
                                    limit=limit, chunk_bytes=chunk_bytes)
