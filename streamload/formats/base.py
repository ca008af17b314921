"""The shard-format protocol.

A format turns one shard (an object in a store) into records. Reading is split in two so that
I/O stays on the event loop and CPU work stays off it:

* `await fmt.open(store, shard, problems=..., chunk_bytes=...)` (async, on the loop) reads
  whatever small index the shard needs and returns a `ShardStream`. `problems` (`Problems`) is
  the shard's context, its source and name and the error policy, made by the caller (the
  fetcher); every problem the open or the stream finds is reported to it.
* `stream.ranges()` lists the byte ranges to fetch, in order. The fetcher reads them with bounded
  concurrency and hands the bytes back **in the same order** to `stream.decode(chunk)`, which runs
  in a worker thread and may keep state between calls (decompressors, partial lines).
* `stream.finish()` flushes what is left after the last range.

`decode` and `finish` return `RawRecord`s: a record index (stable: the line number for JSONL, the
document number for token shards) and either text (to be tokenized) or a token array.

`await fmt.document_lengths(store, shard, ...)` measures a shard's documents without keeping
their tokens, as the loader would count them (the dry run and `streamload inspect` use it): a
token shard from its offsets index alone, a record shard by decoding it and measuring each text
with the tokenizer (UTF-8 bytes without one). It reports to its `problems` as `open` does. It
returns `DocumentLengths`: the lengths and how they were measured, per shard (a format object is
shared, so it keeps no result of its own).

A format whose shards share a directory's index (MDS, LitData) also has `await
fmt.load_index(store, directory)`, and `open` and `document_lengths` take its result as `index=`
(None: the format reads it for that call). The source's catalog keeps the indexes
(`catalog.Indexed`); format objects are shared by every Loader and keep nothing.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Protocol, Sequence, Union

import numpy as np

from ..errors import DataError, StorageError
from ..storage.base import ObjectInfo, ObjectStore
from ..tokenizer import TextTokenizer

# Bytes per ranged read when measuring documents (`ShardFormat.document_lengths`).
LENGTHS_CHUNK_BYTES = 4 << 20


class BadShard(Exception):
    """A shard-level problem (a bad header or index, a truncated file, a missing companion),
    raised inside a reader and reported where it is caught (`Problems.bad_shard`)."""


class MissingField(BadShard):
    """A shard without the field (column, member) the source names. That is a misconfigured
    source far more often than a bad shard, and skipping would skip every shard, so its
    DataError offers the field the shard does have (`field_hint`), not on_error="skip"."""


def field_hint(option: str, wanted: str, present: Sequence[str], prefix: str = "") -> str:
    """What to set `option` ("text_field", "tokens_field") to when the field `wanted` is not
    among the `present` ones: "; did you mean text_field='body'?" for the closest name, or the
    only one there is, else a request to name the right one. `prefix` goes before the name in
    the suggestion (WebDataset's "json." for a field of a JSON member)."""
    present = [str(p) for p in present]
    close = difflib.get_close_matches(wanted, present, n=1)
    pick = close[0] if close else (present[0] if len(present) == 1 else None)
    if pick is not None:
        return f"; did you mean {option}={prefix + pick!r}?"
    what = "token ids" if option == "tokens_field" else "text"
    return f"; set the source's {option} to the field that holds the {what}"


class Problems:
    """What a reader needs to say what is wrong with the shard it reads, and the one place where
    on_error is applied to it: the context (`source`, `shard_name`) and the policy (`on_error`,
    "raise" or "skip"). The fetcher makes one per shard and hands it to the format's `open` (or
    `document_lengths`), which passes it on to its stream; formats never look at the policy.

    A reader reports a record (`record`: it leaves the record out and goes on) or the rest of
    its shard (`shard`, `bad_shard`: it stops), says what is wrong, and decides nothing more.
    With on_error="raise" a report is a DataError naming the source, the shard and the record
    (with the 1-based `line` of a line-based format), saying that on_error="skip" would skip it
    unless `skippable` is False (a shard without the source's field: skipping would skip them
    all). With "skip" it is kept as data, (record or None for the rest of the shard, reason),
    in `skipped`, which the reader's caller takes (`take`) and counts (the fetcher's
    `SkipLedger` holds the source to its limit). `directory` is for what a shard's directory
    index says of other files (files it names that do not exist): every shard of the directory
    raises it, one counts it."""

    def __init__(self, source: str | None, shard_name: str | None, on_error: str = "raise"):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.source, self.shard_name, self.on_error = source, shard_name, on_error
        self.skipped: list[tuple[int | None, str]] = []
        self._counted: set[tuple[str | None, str]] = set()   # `directory` reports counted

    def take(self) -> list[tuple[int | None, str]]:
        """The skips reported since the last call (on_error="skip"), oldest first."""
        taken, self.skipped = self.skipped, []
        return taken

    def record(self, index: int, reason: str, *, line: int | None = None) -> None:
        if self.on_error == "raise":
            raise DataError(reason, source=self.source, shard=self.shard_name, record=index,
                            line=line)
        self.skipped.append((index, reason))

    def shard(self, reason: str, *, skippable: bool = True, shard: str | None = None) -> None:
        """The rest of the shard (`shard`: another one, that its index names) is lost."""
        if self.on_error == "raise":
            raise DataError(reason, source=self.source, shard=shard or self.shard_name,
                            skippable=skippable) from None
        self.skipped.append((None, reason))

    def directory(self, reason: str, *, counted_here: bool, shard: str | None = None) -> None:
        """A problem of the shard's directory that every shard of it sees (`shard`: the file it
        is about, else this shard): with "raise" each of them raises it (whichever is read
        first fails); with "skip" it is counted once, by the shard `counted_here`, and at most
        once per Problems however often the shard's reading comes across it."""
        if self.on_error == "skip" and (not counted_here or (shard, reason) in self._counted):
            return
        self._counted.add((shard, reason))
        self.shard(reason, shard=shard)

    def bad_shard(self, exc: BadShard) -> None:
        """A BadShard caught where the shard's reading ends (the caller then returns its empty
        result)."""
        self.shard(str(exc), skippable=not isinstance(exc, MissingField))


async def read_exact(store: ObjectStore, uri: str, start: int, end: int, what: str, *,
                     exact: bool = True, missing: str | None = None) -> bytes:
    """Bytes [start, end) of `uri` (`what` names it in errors). `exact`: fewer bytes is a
    BadShard (the file is truncated). `missing` (for a shard's companion, its index): a file
    that does not exist is a BadShard saying that, and `missing`, what belongs beside the
    shard."""
    try:
        data = await store.read_range(uri, start, end)
    except StorageError as exc:
        if missing is None or not exc.missing:
            raise
        raise BadShard(f"{what} is missing: {missing}") from None
    if exact and len(data) != end - start:
        raise BadShard(f"{what} is truncated (wanted bytes {start}-{end}, got {len(data)})")
    return data


class DocumentLengths(NamedTuple):
    """What `ShardFormat.document_lengths` measured of one shard."""
    lengths: np.ndarray   # int64 [documents]
    method: str           # "index" (from a length index, no record read) or "scan" (decoded)


@dataclass(frozen=True)
class RawRecord:
    index: int
    payload: Union[str, np.ndarray]   # str for text formats, 1-D integer array for token formats


class Records:
    """A range's records as columns: their indexes (int64 [n]) and their payloads, either
    `texts` (n str, to be tokenized) or one token buffer `tokens` (1-D integers) with `offsets`
    (int64 [n + 1]: record k is tokens[offsets[k]:offsets[k + 1]], a view). What a stream's
    `decode_columns` gives: no Python object per record for a token format, one list of
    str for a text format. `to_list` gives the `RawRecord`s for callers that want them."""
    __slots__ = ("index", "texts", "tokens", "offsets")

    def __init__(self, index: np.ndarray, texts: Optional[list] = None,
                 tokens: Optional[np.ndarray] = None, offsets: Optional[np.ndarray] = None):
        self.index = np.asarray(index, np.int64).reshape(-1)
        self.texts, self.tokens, self.offsets = texts, tokens, offsets

    @classmethod
    def of(cls, records: Sequence[RawRecord]) -> "Records":
        """Columns from RawRecords: all texts, or token arrays (copied into one buffer)."""
        index = np.fromiter((r.index for r in records), np.int64, len(records))
        if records and all(isinstance(r.payload, str) for r in records):
            return cls(index, texts=[r.payload for r in records])
        arrays = [np.asarray(r.payload).reshape(-1) for r in records]
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([a.shape[0] for a in arrays], out=offsets[1:])
        # (an empty document's dtype, float64 from np.asarray([]), must not widen the rest)
        tokens = np.concatenate([a for a in arrays if a.size] or [np.zeros(0, np.int32)])
        return cls(index, tokens=tokens, offsets=offsets)

    @classmethod
    def empty(cls) -> "Records":
        return cls(np.zeros(0, np.int64), tokens=np.zeros(0, np.int32),
                   offsets=np.zeros(1, np.int64))

    def __len__(self) -> int:
        return self.index.shape[0]

    def payloads(self) -> list:
        """Each record's payload: its text, or its tokens (a view of the buffer)."""
        if self.texts is not None:
            return self.texts
        tokens, bounds = self.tokens, self.offsets.tolist()
        return [tokens[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]

    def to_list(self) -> list[RawRecord]:
        return [RawRecord(i, p) for i, p in zip(self.index.tolist(), self.payloads())]

    def widened(self, dtype) -> "Records":
        """These records with their token ids as `dtype` (what a stream's `decode` hands out,
        when its `decode_columns` keeps the stored dtype: `column_dtype`)."""
        if dtype is None or self.tokens is None or self.tokens.dtype == dtype:
            return self
        return Records(self.index, tokens=self.tokens.astype(dtype), offsets=self.offsets)

    def select(self, keep: np.ndarray) -> "Records":
        """The records where `keep` (bool [n]) holds, in order (token records: the buffer
        gathered into one of their own)."""
        if keep.all():
            return self
        if self.texts is not None:
            return Records(self.index[keep],
                           texts=[t for t, k in zip(self.texts, keep.tolist()) if k])
        lengths = np.diff(self.offsets)[keep]
        offsets = np.zeros(lengths.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Records(self.index[keep], offsets=offsets,
                       tokens=self.tokens[gather_index(self.offsets[:-1][keep], lengths)])


def gather_index(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The positions of the runs [start[k], start[k] + length[k]) in order, as one index:
    `buffer[gather_index(start, length)]` is the runs back to back, one gather."""
    total = int(length.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    before = np.cumsum(length) - length   # each run's place in the output
    return np.arange(total, dtype=np.int64) + np.repeat(start - before, length)


def joined_spans(buf, starts: np.ndarray, ends: np.ndarray) -> bytes:
    """buf[starts[k]:ends[k]] for every k, back to back in one new buffer: one copy (a join
    of views), which keeps nothing else of `buf` alive."""
    view = memoryview(buf)
    return b"".join([view[a:b] for a, b in zip(starts.tolist(), ends.tolist())])


def utf8_spans(buf, starts: np.ndarray, ends: np.ndarray) -> Optional[list[str]]:
    """Each span buf[starts[k]:ends[k]] decoded as UTF-8 (no bytes copy in between); None
    when one is not valid UTF-8, which its reader's record-by-record path then names."""
    view = memoryview(buf)
    try:
        return [str(view[a:b], "utf-8") for a, b in zip(starts.tolist(), ends.tolist())]
    except UnicodeDecodeError:
        return None


def column_dtype(stored: np.dtype, out: np.dtype) -> np.dtype:
    """The dtype a stream's `decode_columns` hands token ids out in: the stored one for
    unsigned ids of at most 16 bits (a view of the bytes read: no conversion, and no check is
    needed; packing widens them), else `out`, the dtype its `decode` hands out."""
    return np.dtype(stored.str[1:]) if stored.kind == "u" and stored.itemsize <= 2 else out


def decode_columns(stream, chunk: bytes) -> Records:
    """`stream.decode(chunk)` as columns: the stream's own `decode_columns` when it has one
    (formats whose ranges decode to a buffer: JSONL, token shards, Megatron, ...), else its
    records gathered (`Records.of`)."""
    columns = getattr(stream, "decode_columns", None)
    return columns(chunk) if columns is not None else Records.of(stream.decode(chunk))


def finish_columns(stream) -> Records:
    """`stream.finish()` as columns (see `decode_columns`)."""
    columns = getattr(stream, "finish_columns", None)
    return columns() if columns is not None else Records.of(stream.finish())


class ShardStream(Protocol):
    """Optionally also `decode_columns(chunk) -> Records` and `finish_columns() -> Records`,
    the same records as columns (the loader's fetcher reads those; `decode_columns`)."""
    def ranges(self) -> Sequence[tuple[int, int]]: ...
    def decode(self, chunk: bytes) -> list[RawRecord]: ...
    def finish(self) -> list[RawRecord]: ...


class EmptyStream:
    """A shard that yields nothing: one that failed to open in skip mode, or a copy of a shard
    read elsewhere (MDS keeps a raw and a compressed copy)."""

    def ranges(self) -> list[tuple[int, int]]:
        return []

    def decode(self, chunk: bytes) -> list[RawRecord]:
        return []

    def finish(self) -> list[RawRecord]:
        return []


class PlannedStream:
    """What every stream over byte ranges planned when its shard opens shares: the ranges
    (`_ranges`, set by the stream), handed back in order (`_next_range`), and where it reports
    problems (`problems`, see `Problems`): `_record_error` for a record, `_shard_error` for the
    rest of the shard, which also marks the stream `_failed` (it yields nothing more)."""

    def __init__(self, problems: Problems):
        self.problems = problems
        self._source, self._shard_name = problems.source, problems.shard_name
        self._ranges: list[tuple[int, int]] = []
        self._next = 0
        self._failed = False
        self._read: list[int] | None = None   # the planned ranges still read (`keep_only`)
        self._runs: list[tuple[int, int]] | None = None   # per range, its records [first, end)

    def ranges(self) -> list[tuple[int, int]]:
        return self._ranges if self._read is None else [self._ranges[k] for k in self._read]

    def _next_range(self) -> int:
        """The index of the planned range the chunk being decoded is (they come in order)."""
        if self._next >= (len(self._ranges) if self._read is None else len(self._read)):
            raise DataError("more chunks than planned ranges", source=self._source,
                            shard=self._shard_name)
        self._next += 1
        return self._next - 1 if self._read is None else self._read[self._next - 1]

    def _record_spans(self) -> Sequence[tuple[int, int]] | None:
        """Per planned range, the records [first, end) it holds (a superset will do); None when
        the format's ranges are not runs of records (then `keep_only` keeps them all). A
        stream whose ranges are runs of consecutive records sets `_runs` to them."""
        return self._runs

    def _next_run(self, chunk: bytes, noun: str) -> tuple[int, int, int]:
        """For a stream of record runs (`_runs`): (first, end, start byte) of the run that
        `chunk` is, after checking that it is all there."""
        k = self._next_range()
        (first, end), (start, stop) = self._runs[k], self._ranges[k]
        if len(chunk) != stop - start:
            raise DataError(f"expected {stop - start} bytes for {noun} {first}..{end - 1}, "
                            f"got {len(chunk)}", source=self._source, shard=self._shard_name)
        return first, end, start

    def keep_only(self, wants_any: Callable[[int, int], bool]) -> None:
        """Read only the ranges holding a record in [first, end) that `wants_any(first, end)`:
        a resumed shard skips the bytes of what it delivered before the stop (a format without
        a record index, JSONL, still reads them). Call before `ranges()`."""
        spans = self._record_spans()
        if spans is not None:
            self._read = [k for k, (first, end) in enumerate(spans)
                          if wants_any(int(first), int(end))]

    def _record_error(self, index: int, reason: str, **where) -> None:
        self.problems.record(index, reason, **where)

    def _shard_error(self, reason: str, skippable: bool = True) -> None:
        self._failed = True
        self.problems.shard(reason, skippable=skippable)


class ShardFormat(Protocol):
    name: str

    def matches(self, uri: str) -> bool:
        """True when this format reads `uri` (by its name). Companion files (indexes) return False."""

    async def open(self, store: ObjectStore, shard: ObjectInfo, *, problems: Problems,
                   chunk_bytes: int) -> ShardStream: ...

    async def document_lengths(self, store: ObjectStore, shard: ObjectInfo, *,
                               problems: Problems, tokenizer: TextTokenizer | None = None,
                               limit: int | None = None,
                               chunk_bytes: int = LENGTHS_CHUNK_BYTES) -> DocumentLengths:
        """The length in tokens of each of the shard's documents (int64, in record order), and
        whether an index gave them or a scan of the records (`DocumentLengths`); as the loader
        would measure it (empty documents included, as 0; records that are skipped left out).
        `tokenizer` measures texts (None: UTF-8 bytes, the loader's default); `limit` stops
        after that many documents (at most `limit` come back). Problems are reported to
        `problems` as in `open` (a DataError, or with on_error="skip" kept in
        `problems.skipped` for the caller to count)."""
