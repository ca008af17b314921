"""JSON Lines shards, plain or compressed (gzip, zstd), decoded with msgspec.

One JSON object per line; only `text_field` is read (other fields are ignored). The record
index is the 0-based line number in the decompressed shard, blank lines included, so record ids
stay stable whatever the chunk size. Decoding is streaming: compressed bytes go through an
incremental decompressor and the partial last line waits for the next chunk.
"""
from __future__ import annotations

import re
import zlib
from functools import lru_cache
from operator import attrgetter
from typing import Callable

import msgspec
import numpy as np
import zstandard

from ..errors import ConfigError
from ..storage.base import ObjectInfo, ObjectStore
from ..tokenizer import TextTokenizer
from .base import (LENGTHS_CHUNK_BYTES, DocumentLengths, PlannedStream, Problems, RawRecord,
                   Records, field_hint)
from .lengths import stream_lengths

_BOM = b"\xef\xbb\xbf"
# A blank line (nothing but JSON whitespace) inside a body, or at its start or end: msgspec's
# decode_lines skips those, so such a body is read line by line (`JsonlStream._columns`).
_BLANK_LINE = re.compile(rb"\n[ \t\r]*\n")
_TEXT = attrgetter("text")

_NO_RECORDS = Records(np.zeros(0, np.int64), texts=[])


def _blank(line: bytes) -> bool:
    return not line.strip(b" \t\r")


_COUNT_BLOCK = 1 << 16   # bytes compared at a time by `_newlines`: a small temporary


def _newlines(data, start: int, end: int) -> int:
    """The newlines in data[start:end], counted by NumPy over a view, a block at a time:
    `mmap` (a range read into a mapped buffer, `storage.buffers`) has no `count`. About
    0.08 ms a MiB whatever the lines' length; `find` in a Python loop took 1.3 ms a MiB of
    100-byte lines (0.04 ms of 4 KB ones), `bytes.count` 0.3 ms."""
    if end <= start:
        return 0
    view = np.frombuffer(data, np.uint8, end - start, start)
    return sum(int(np.count_nonzero(view[k:k + _COUNT_BLOCK] == 10))
               for k in range(0, end - start, _COUNT_BLOCK))


_STEMS = (".jsonl", ".ndjson")
_NAMED_STEMS = _STEMS + (".json",)   # `.json` only when the format is named explicitly
_COMPRESSIONS = {"": None, ".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}


def compression_of(uri: str, stems: tuple[str, ...] = _STEMS) -> str | None | bool:
    """"gzip", "zstd" or None (plain) for a JSONL name; False when `uri` is not JSONL."""
    name = uri.rsplit("/", 1)[-1].lower()
    for suffix, compression in _COMPRESSIONS.items():
        if suffix and not name.endswith(suffix):
            continue
        base = name[: len(name) - len(suffix)] if suffix else name
        if base.endswith(stems):
            return compression
    return False


class _Inflater:
    """Incremental decompression of concatenated gzip members or zstd frames."""

    def __init__(self, new_object: Callable[[], object], errors: tuple[type[Exception], ...]):
        self._new_object = new_object
        self.errors = errors
        self._current = None   # the member/frame being read; None between members

    def feed(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._current is None:
                self._current = self._new_object()
            out.append(self._current.decompress(data))
            if self._current.eof:    # member done; what follows starts the next one
                data = self._current.unused_data
                self._current = None
            else:
                data = b""
        return b"".join(out)

    @property
    def complete(self) -> bool:
        return self._current is None


def _inflater(compression: str | None) -> _Inflater | None:
    if compression == "gzip":
        return _Inflater(lambda: zlib.decompressobj(wbits=31), (zlib.error,))
    if compression == "zstd":
        dctx = zstandard.ZstdDecompressor()
        # One object per frame (not read_across_frames) so that a truncated last frame shows.
        return _Inflater(dctx.decompressobj, (zstandard.ZstdError,))
    return None


@lru_cache(maxsize=None)
def _decoder(text_field: str) -> msgspec.json.Decoder:
    record = msgspec.defstruct("JsonlRecord", [("text", str)], rename={"text": text_field})
    return msgspec.json.Decoder(record)


def _describe(error: msgspec.MsgspecError, text_field: str, line: bytes) -> str:
    message = str(error)
    if isinstance(error, msgspec.ValidationError):
        if message.startswith("Object missing required field"):
            return f"missing field {text_field!r}; {_fields_present(line, text_field)}"
        if message.startswith("Expected `str`, got `"):
            got = message[len("Expected `str`, got `"):].split("`", 1)[0]
            return f"field {text_field!r} is not a string (got {got})"
        if message.startswith("Expected `object`, got `"):
            got = message[len("Expected `object`, got `"):].split("`", 1)[0]
            return f"line is not a JSON object (got {got})"
        return f"invalid record: {message}"
    if "UTF-8" in message:
        return "invalid UTF-8"
    return f"invalid JSON: {message}"


_MAX_FIELDS_LISTED = 12


def _fields_present(line: bytes, text_field: str) -> str:
    """'fields present: 'body', 'id'' for a record that lacks `text_field` (its keys, not its
    values), with the likely field to name in `text_field` when one is close."""
    try:
        fields = [str(k) for k in msgspec.json.decode(line)]
    except (msgspec.MsgspecError, TypeError):   # not expected: it just decoded as an object
        return "the record has other fields"
    if not fields:
        return "the record has no fields"
    listed = ", ".join(repr(f[:64]) for f in fields[:_MAX_FIELDS_LISTED])
    if len(fields) > _MAX_FIELDS_LISTED:
        listed += f", ... ({len(fields) - _MAX_FIELDS_LISTED} more)"
    return f"fields present: {listed}{field_hint('text_field', text_field, fields)}"


class JsonlStream(PlannedStream):
    """State for reading one JSONL shard: the decompressor, the partial line, the line number.
    Its ranges are fixed-size slices of the file (`ranges`). A range's chunk may be `bytes` or
    a buffer a store filled (`takes_buffers`); a chunk is kept only while a line that begins in
    it is unfinished, and what is decoded from it is copied out."""

    # The fetcher may read this stream's ranges into mapped buffers (`storage.buffers`): the
    # decoder only finds, slices and views a chunk, and copies what it keeps.
    takes_buffers = True

    def __init__(self, shard: ObjectInfo, *, problems: Problems, chunk_bytes: int,
                 compression: str | None, text_field: str):
        super().__init__(problems)
        self._size = shard.size
        self._chunk_bytes = chunk_bytes
        self._compression = compression
        self._inflater = _inflater(compression)
        self._text_field = text_field
        self._decode_line = _decoder(text_field).decode
        self._decode_lines = _decoder(text_field).decode_lines
        self._pending: list[bytes] = []   # pieces of the line not yet ended by a newline
        self._next_index = 0       # line number of the first line in `_pending`

    def ranges(self) -> list[tuple[int, int]]:
        step, size = self._chunk_bytes, self._size
        return [(start, min(start + step, size)) for start in range(0, size, step)]

    def decode(self, chunk: bytes) -> list[RawRecord]:
        return self.decode_columns(chunk).to_list()

    def finish(self) -> list[RawRecord]:
        return self.finish_columns().to_list()

    def decode_columns(self, chunk: bytes) -> Records:
        """The records whose lines end in `chunk` (`Records`: line numbers and texts)."""
        if self._failed:
            return _NO_RECORDS
        data = self._inflate(chunk)
        if data is None:
            return _NO_RECORDS
        cut = data.rfind(b"\n")
        if cut < 0:                  # no line ends here; joining later keeps long lines linear
            self._pending.append(data)
            return _NO_RECORDS
        pending, self._pending = self._pending, [data[cut + 1:]]
        if not any(pending):   # the last chunk ended a line
            return self._columns(data, 0, cut)
        # The line begun in earlier chunks, joined on its own, then the rest over a view.
        end = data.find(b"\n")
        line = b"".join([*pending, data[:end]])
        first = self._columns(line, 0, len(line))
        if end == cut:
            return first
        rest = self._columns(data, end + 1, cut)
        return Records(np.concatenate([first.index, rest.index]),
                       texts=first.texts + rest.texts)

    def finish_columns(self) -> Records:
        if self._failed:
            return _NO_RECORDS
        if self._inflater is not None and not self._inflater.complete:
            self._shard_error(f"truncated {self._compression} stream")
            return _NO_RECORDS
        last, self._pending = b"".join(self._pending), []
        if not last:
            return _NO_RECORDS
        return self._columns(last, 0, len(last))

    def _inflate(self, chunk: bytes) -> bytes | None:
        if self._inflater is None:
            return chunk
        try:
            return self._inflater.feed(chunk)
        except self._inflater.errors as exc:
            self._shard_error(f"corrupt {self._compression} data: {exc}")
            return None

    def _columns(self, data: bytes, start: int, end: int) -> Records:
        """The records of data[start:end], whole lines (the newline after the last one left out),
        in one msgspec call (`decode_lines`, over a view: no copy). That call skips blank lines
        and would read two values on one line, so it stands only for lines that are none of
        them blank and as many as the values; anything else (a blank line, a bad record) is
        read line by line (`_records`), which numbers, reports and skips each line as before."""
        first = self._next_index
        if first == 0 and data[start:min(end, start + len(_BOM))] == _BOM:   # a UTF-8 BOM
            start += len(_BOM)
        lines = _newlines(data, start, end) + 1
        head = data.find(b"\n", start, end)
        tail = data.rfind(b"\n", start, end)
        if not _BLANK_LINE.search(data, start, end) and \
                not _blank(data[start:head if head >= 0 else end]) and \
                not _blank(data[tail + 1 if tail >= 0 else start:end]):
            try:
                values = self._decode_lines(memoryview(data)[start:end])
            except msgspec.MsgspecError:
                values = None
            if values is not None and len(values) == lines:
                self._next_index = first + lines
                return Records(np.arange(first, first + lines, dtype=np.int64),
                               texts=list(map(_TEXT, values)))
        records = self._records(data[start:end].split(b"\n"))
        return Records(np.fromiter((r.index for r in records), np.int64, len(records)),
                       texts=[r.payload for r in records])

    def _records(self, lines: list[bytes]) -> list[RawRecord]:
        records = []
        index = self._next_index
        decode_line = self._decode_line
        for line in lines:
            if line and not line.isspace():
                try:
                    records.append(RawRecord(index, decode_line(line).text))
                except msgspec.MsgspecError as exc:
                    self._record_error(index, _describe(exc, self._text_field, line))
            index += 1
        self._next_index = index
        return records

    def _record_error(self, index: int, reason: str, **where) -> None:
        super()._record_error(index, reason, line=index + 1)   # the index: the 0-based line

    def _shard_error(self, reason: str) -> None:
        self._pending = []
        super()._shard_error(reason)


class JsonlFormat:
    """`*.jsonl`, `*.ndjson`, each optionally `.gz`, `.zst` or `.zstd`. With `named=True` (the
    source names the format explicitly) `*.json[.gz|.zst|.zstd]` files are read as JSON Lines too,
    as in C4-style dumps."""

    name = "jsonl"

    def __init__(self, text_field: str | None = None, tokens_field: str | None = None,
                 named: bool = False):
        text_field = "text" if text_field is None else text_field
        if not text_field:
            raise ConfigError.at("text_field", "must be a non-empty string")
        self.text_field = text_field
        self._stems = _NAMED_STEMS if named else _STEMS
        _decoder(text_field)   # build the msgspec struct once, up front

    def matches(self, uri: str) -> bool:
        return compression_of(uri, self._stems) is not False

    async def open(self, store: ObjectStore, shard: ObjectInfo, *, problems: Problems,
                   chunk_bytes: int) -> JsonlStream:
        if chunk_bytes <= 0:
            raise ConfigError.at("chunk_bytes", f"must be positive, got {chunk_bytes}")
        compression = compression_of(shard.uri, _NAMED_STEMS)
        return JsonlStream(shard, problems=problems, chunk_bytes=chunk_bytes,
                           compression=compression if compression is not False else None,
                           text_field=self.text_field)

    async def document_lengths(self, store: ObjectStore, shard: ObjectInfo, *,
                               problems: Problems, tokenizer: TextTokenizer | None = None,
                               limit: int | None = None,
                               chunk_bytes: int = LENGTHS_CHUNK_BYTES) -> DocumentLengths:
        """Each document's length in tokens (`ShardFormat.document_lengths`): the records
        decoded and each text measured with `tokenizer`, UTF-8 bytes without one."""
        return await stream_lengths(self, store, shard, problems=problems, tokenizer=tokenizer,
                                    limit=limit, chunk_bytes=chunk_bytes)
