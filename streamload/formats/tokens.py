"""Pre-tokenized shards: a `.npy` token array plus a `.npy` array of document offsets.

`<stem>.tokens.npy` holds one 1-D little-endian array of token ids (uint16, uint32, int32 or
int64): every document of the shard, back to back. `<stem>.offsets.npy` is its companion: a 1-D
int64 array of n_docs + 1 non-decreasing offsets into the token array, with offsets[0] == 0 and
offsets[-1] == len(tokens). Document d is tokens[offsets[d]:offsets[d + 1]]; d is its record index.

`open` reads the token header and the whole offsets file (small), then plans byte ranges of the
token array that each hold whole consecutive documents, about `chunk_bytes` each.
`document_lengths` reads the offsets file alone (np.diff(offsets)); the token file is not read.
"""
from __future__ import annotations

import ast
import asyncio

from typing import Optional

import numpy as np

from ..errors import ConfigError
from ..storage.base import ObjectInfo, ObjectStore
from ..tokenizer import TextTokenizer
from .base import (LENGTHS_CHUNK_BYTES, BadShard, DocumentLengths, EmptyStream, PlannedStream,
                   Problems, RawRecord, Records, column_dtype, read_exact)

TOKENS_SUFFIX = ".tokens.npy"
OFFSETS_SUFFIX = ".offsets.npy"

_MAGIC = b"\x93NUMPY"
_HEADER_PROBE = 1024       # bytes read to find the token header; numpy writes 128 for 1-D arrays
_MIN_NPY = 64              # numpy pads every header to a multiple of 64 bytes
# Token dtype on disk -> dtype of the arrays handed out (int32 when every value fits).
_TOKEN_DTYPES = {
    np.dtype("<u2"): np.dtype(np.int32),
    np.dtype("<i4"): np.dtype(np.int32),
    np.dtype("<u4"): np.dtype(np.int64),
    np.dtype("<i8"): np.dtype(np.int64),
}
_OFFSET_DTYPE = np.dtype("<i8")



def offsets_uri(tokens_uri: str) -> str:
    return tokens_uri[: -len(TOKENS_SUFFIX)] + OFFSETS_SUFFIX


def _header_length(prefix: bytes, what: str) -> int:
    """Total bytes of a .npy header (magic, version, length field, dict), from its first bytes."""
    if len(prefix) < 10 or not prefix.startswith(_MAGIC):
        raise BadShard(f"{what} is not a .npy file (bad magic bytes)")
    major = prefix[6]
    if major == 1:
        return 10 + int.from_bytes(prefix[8:10], "little")
    if major in (2, 3) and len(prefix) >= 12:
        return 12 + int.from_bytes(prefix[8:12], "little")
    raise BadShard(f"{what} has unsupported .npy format version {major}")


def _parse_header(header: bytes, what: str) -> tuple[np.dtype, int]:
    """(dtype, length) of the 1-D array that a complete .npy header describes."""
    major = header[6]
    text = header[10 if major == 1 else 12:].decode("utf-8" if major == 3 else "latin-1")
    try:
        fields = ast.literal_eval(text)
        dtype = np.dtype(fields["descr"])
        shape = tuple(fields["shape"])
    except (ValueError, SyntaxError, TypeError, KeyError) as exc:
        raise BadShard(f"{what} has an unreadable .npy header: {exc}") from None
    if len(shape) != 1:
        raise BadShard(f"{what} must hold a 1-D array, found shape {shape}")
    return dtype, int(shape[0])


async def _read_token_header(store: ObjectStore, shard: ObjectInfo) -> tuple[np.dtype, int, int]:
    """(dtype, n_tokens, data_start) of the token array; checks the object's size against them."""
    what = "token file"
    head = await read_exact(store, shard.uri, 0, min(shard.size, _HEADER_PROBE), what)
    total = _header_length(head, what)
    if total > len(head):
        head += await read_exact(store, shard.uri, len(head), total, what)
    dtype, n_tokens = _parse_header(head[:total], what)
    if dtype not in _TOKEN_DTYPES:
        raise BadShard(f"token dtype {dtype.str!r} is not supported "
                        "(use little-endian uint16, uint32, int32 or int64)")
    expected = total + n_tokens * dtype.itemsize
    if expected != shard.size:
        raise BadShard(f"token file holds {shard.size} bytes but its header describes "
                        f"{n_tokens} tokens ({expected} bytes); it is truncated or corrupt")
    return dtype, n_tokens, total


async def _read_offsets(store: ObjectStore, uri: str,
                        max_documents: Optional[int] = None) -> np.ndarray:
    """The offsets array, unchecked. Up to three small reads: its size comes from its header.
    With `max_documents`, only the offsets of the first that many documents are read."""
    what = _offsets_what(uri)
    head = await read_exact(store, uri, 0, _MIN_NPY, what, missing=MISSING_OFFSETS)
    total = _header_length(head, what)
    if total > len(head):
        head += await read_exact(store, uri, len(head), total, what)
    dtype, n = _parse_header(head[:total], what)
    if dtype != _OFFSET_DTYPE:
        raise BadShard(f"{what} must hold little-endian int64, found {dtype.str!r}")
    if n < 1:
        raise BadShard(f"{what} is empty; it needs n_docs + 1 entries starting with 0")
    if max_documents is not None:
        n = min(n, max_documents + 1)
    return np.frombuffer(await read_exact(store, uri, total, total + 8 * n, what), _OFFSET_DTYPE)


MISSING_OFFSETS = ("a token shard is <stem>.tokens.npy with <stem>.offsets.npy beside it "
                   "(streamload.formats.write_token_shard writes both)")


def _offsets_what(uri: str) -> str:
    return f"offsets file {uri.rsplit('/', 1)[-1]!r}"


def _check_offsets(offsets: np.ndarray, n_tokens: Optional[int], what: str) -> None:
    """Offsets start at 0, never decrease and (when the token count is known) end at it."""
    if n_tokens is None and offsets[0] != 0:
        raise BadShard(f"{what} must start at 0, found {int(offsets[0])}")
    if n_tokens is not None and (offsets[0] != 0 or offsets[-1] != n_tokens):
        raise BadShard(f"{what} must start at 0 and end at the token count {n_tokens}, "
                        f"found {int(offsets[0])} .. {int(offsets[-1])}")
    steps = np.diff(offsets)
    if steps.size and steps.min() < 0:
        bad = int(np.argmax(steps < 0))
        raise BadShard(f"{what} decreases at document {bad} "
                        f"({int(offsets[bad])} -> {int(offsets[bad + 1])})")


async def _read_index(store: ObjectStore, shard: ObjectInfo) -> tuple[np.dtype, int, np.ndarray]:
    """(token dtype, data start, offsets): the token header and the offsets, read concurrently."""
    companion = offsets_uri(shard.uri)
    header, offsets = await asyncio.gather(_read_token_header(store, shard),
                                           _read_offsets(store, companion),
                                           return_exceptions=True)
    for result in (header, offsets):
        if isinstance(result, BaseException):
            raise result
    dtype, n_tokens, data_start = header
    _check_offsets(offsets, n_tokens, _offsets_what(companion))
    return dtype, data_start, offsets


def plan_groups(offsets: np.ndarray, capacity_tokens: int) -> list[tuple[int, int]]:
    """Split documents into runs [first, end) of consecutive documents of at most
    `capacity_tokens` tokens in all; a longer document gets a run of its own. Every run holds at
    least one token, and empty documents join the run before (or after, at the start)."""
    groups = []
    n_docs = len(offsets) - 1
    first = 0
    while first < n_docs:
        start = offsets[first]
        end = int(np.searchsorted(offsets, start + capacity_tokens, side="right")) - 1
        if offsets[end] == start:   # the next non-empty document alone exceeds the capacity
            end = int(np.searchsorted(offsets, start, side="right"))
            end = int(np.searchsorted(offsets, offsets[end], side="right")) - 1
        groups.append((first, end))
        first = end
    return groups


class TokensStream(PlannedStream):
    def __init__(self, problems: Problems, *, dtype: np.dtype, data_start: int,
                 offsets: np.ndarray, chunk_bytes: int):
        super().__init__(problems)
        self._dtype = dtype
        self._out_dtype = _TOKEN_DTYPES[dtype]
        self._column_dtype = column_dtype(dtype, self._out_dtype)
        self._signed = dtype.kind == "i"
        self._offsets = offsets
        n_tokens = int(offsets[-1])
        capacity = max(1, chunk_bytes // dtype.itemsize)
        self._runs = plan_groups(offsets, capacity) if n_tokens else []
        size = dtype.itemsize
        self._ranges = [(data_start + int(offsets[a]) * size, data_start + int(offsets[b]) * size)
                        for a, b in self._runs]
        self._finished = False

    def decode(self, chunk: bytes) -> list[RawRecord]:
        return self.decode_columns(chunk).widened(self._out_dtype).to_list()

    def finish(self) -> list[RawRecord]:
        return self.finish_columns().widened(self._out_dtype).to_list()

    def decode_columns(self, chunk: bytes) -> Records:
        """The run's documents as offsets over the range's tokens: a view of `chunk` for
        uint16 and int32 shards (`column_dtype`), else one conversion."""
        first, end, _ = self._next_run(chunk, "documents")
        tokens = np.frombuffer(chunk, self._dtype).astype(self._column_dtype, copy=False)
        bounds = self._offsets[first:end + 1] - self._offsets[first]
        records = Records(np.arange(first, end, dtype=np.int64), tokens=tokens, offsets=bounds)
        bad = self._negative_documents(tokens, bounds, first) if self._signed else ()
        if bad:
            records = records.select(~np.isin(records.index, list(bad)))
        return records

    def finish_columns(self) -> Records:
        if self._finished:
            return Records.empty()
        self._finished = True
        if not self._runs:   # no tokens at all, so no ranges: the documents are all empty
            n = len(self._offsets) - 1
            return Records(np.arange(n, dtype=np.int64), tokens=np.empty(0, self._out_dtype),
                           offsets=np.zeros(n + 1, np.int64))
        return Records.empty()

    def _negative_documents(self, tokens: np.ndarray, bounds: np.ndarray, first: int) -> set[int]:
        if not tokens.size or tokens.min() >= 0:
            return set()
        positions = np.flatnonzero(tokens < 0)
        docs = sorted(set((np.searchsorted(bounds, positions, side="right") - 1 + first).tolist()))
        for doc in docs:
            self._record_error(doc, "negative token id")
        return set(docs)



class TokensFormat:
    """`*.tokens.npy` shards with their `*.offsets.npy` companions."""

    name = "tokens"

    def __init__(self, text_field: str | None = None, tokens_field: str | None = None,
                 named: bool = False):
        pass   # token shards have no fields

    def matches(self, uri: str) -> bool:
        return uri.endswith(TOKENS_SUFFIX) and len(uri.rsplit("/", 1)[-1]) > len(TOKENS_SUFFIX)

    async def open(self, store: ObjectStore, shard: ObjectInfo, *, problems: Problems,
                   chunk_bytes: int) -> TokensStream | EmptyStream:
        if chunk_bytes <= 0:
            raise ConfigError.at("chunk_bytes", f"must be positive, got {chunk_bytes}")
        try:
            dtype, data_start, offsets = await _read_index(store, shard)
        except BadShard as exc:
            problems.bad_shard(exc)
            return EmptyStream()
        return TokensStream(problems, dtype=dtype, data_start=data_start, offsets=offsets,
                            chunk_bytes=chunk_bytes)

    async def document_lengths(self, store: ObjectStore, shard: ObjectInfo, *,
                               problems: Problems, tokenizer: TextTokenizer | None = None,
                               limit: int | None = None,
                               chunk_bytes: int = LENGTHS_CHUNK_BYTES) -> DocumentLengths:
        """Each document's length in tokens (`ShardFormat.document_lengths`), from the shard's
        offsets index alone: np.diff(offsets). The token file is not read, so what only it can
        show (a truncated file, negative ids) goes unnoticed here; the offsets are checked (they
        start at 0 and never decrease). With `limit`, only the offsets needed are read.
        `tokenizer` and `chunk_bytes` are not used: the documents are token ids already."""
        if limit is not None and limit < 0:
            raise ConfigError.at("limit", f"must be >= 0, got {limit}")
        companion = offsets_uri(shard.uri)
        what = _offsets_what(companion)
        try:
            offsets = await _read_offsets(store, companion, limit)
            _check_offsets(offsets, None, what)   # the token count is in the unread token file
        except BadShard as exc:
            problems.bad_shard(exc)
            return DocumentLengths(np.zeros(0, np.int64), "index")
        return DocumentLengths(np.diff(offsets).astype(np.int64, copy=False), "index")
