"""Megatron-LM indexed datasets: `<prefix>.bin` (token ids) with its `<prefix>.idx` index.

The layout is Megatron-core's (`megatron/core/datasets/indexed_dataset.py`, `_IndexWriter`),
all little-endian:

    .idx  magic b"MMIDIDX\\x00\\x00" (9 bytes), version uint64 (1), dtype code uint8,
          sequence count S uint64, document-index count D uint64 (documents + 1),
          sequence lengths int32[S] (tokens), sequence pointers int64[S] (byte offsets into
          the .bin), document indices int64[D] (0, then the sequence index ending each document),
          and for multimodal datasets int8 modes [S] (not read).
    .bin  the token ids of every sequence, back to back, in the dtype of the code
          (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16).

One record per *sequence*, its index the sequence number. That is Megatron's own unit: its GPT
dataset splits and samples an indexed dataset by sequence (`GPTDataset.numel_low_level_dataset`)
and `IndexedDataset[i]` is sequence i. The document indices only group sequences into documents
(several sequences per document when the data was preprocessed with `--split-sentences`, one
per document otherwise, the common case, where sequences and documents coincide); they are
checked, not used to join sequences.

Only `<prefix>.bin` is a shard; `<prefix>.idx` is its companion. `open` reads the .idx (a header
read, then one read of the lengths, pointers and document indices) and plans byte ranges of the
.bin that each hold whole consecutive sequences, about `chunk_bytes` each (a longer sequence gets
a range of its own). `document_lengths` reads the .idx alone: the sequence lengths.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..errors import ConfigError, DataError
from ..storage.base import ObjectInfo, ObjectStore
from ..tokenizer import TextTokenizer
from .base import (LENGTHS_CHUNK_BYTES, BadShard, DocumentLengths, EmptyStream, PlannedStream,
                   Problems, RawRecord, Records, column_dtype, gather_index, read_exact)
from .litdata import CHUNK_NAME as LITDATA_CHUNK
from .tokens import plan_groups

BIN_SUFFIX = ".bin"
IDX_SUFFIX = ".idx"
MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8   # 34

# Megatron's DType codes.
DTYPE_CODES = {1: np.dtype("<u1"), 2: np.dtype("<i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
               5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2")}
CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
# Token dtype on disk -> dtype of the arrays handed out. int32 arrays are trusted downstream
# (`pipeline.transform.to_tokens`), so signed ones are checked for negative ids here first;
# int64 ones are checked downstream (ids past 2**31 - 1).
_OUT_DTYPES = {np.dtype("<u1"): np.dtype(np.int32), np.dtype("<i1"): np.dtype(np.int32),
               np.dtype("<i2"): np.dtype(np.int32), np.dtype("<i4"): np.dtype(np.int32),
               np.dtype("<u2"): np.dtype(np.int32), np.dtype("<i8"): np.dtype(np.int64)}

# LitData writes its chunks as `chunk-<rank>-<n>[.<compression>].bin`: auto-detection leaves
# those to the litdata format; format="megatron" reads every `.bin`.



MISSING_INDEX = ("a Megatron dataset is <prefix>.bin with <prefix>.idx beside it. If these .bin "
                 "files are not Megatron data, point the source's URI at the data files alone "
                 "(a glob such as 'dir/*.jsonl') or set Source(format=...)")


def idx_uri(bin_uri: str) -> str:
    return bin_uri[: -len(BIN_SUFFIX)] + IDX_SUFFIX


def _idx_what(uri: str) -> str:
    return f"index file {uri.rsplit('/', 1)[-1]!r}"


class MegatronIndex:
    """What a .idx holds: the token dtype, per sequence its length and byte pointer, and the
    document indices (None when only a prefix of the index was read)."""

    def __init__(self, dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray,
                 document_indices: Optional[np.ndarray]):
        self.dtype, self.lengths, self.pointers = dtype, lengths, pointers
        self.document_indices = document_indices


async def read_index(store: ObjectStore, uri: str,
                     max_sequences: Optional[int] = None) -> MegatronIndex:
    """The index at `uri`, checked: two reads (the header, then the arrays). With
    `max_sequences`, only the lengths and pointers of that many sequences are read (two
    ranges) and the document indices are not."""
    what = _idx_what(uri)
    head = await read_exact(store, uri, 0, HEADER_BYTES, what, exact=False,
                            missing=MISSING_INDEX)
    if not head.startswith(MAGIC):
        raise BadShard(f"{what} is not a Megatron index (bad magic bytes "
                        f"{head[:len(MAGIC)]!r}, expected {MAGIC!r})")
    if len(head) < HEADER_BYTES:
        raise BadShard(f"{what} is truncated ({len(head)} bytes, the header alone needs "
                        f"{HEADER_BYTES})")
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", head, len(MAGIC))
    if version != VERSION:
        raise BadShard(f"{what} has version {version}; only version {VERSION} is known")
    if code not in DTYPE_CODES:
        raise BadShard(f"{what} has an unknown dtype code {code}")
    dtype = DTYPE_CODES[code]
    if dtype not in _OUT_DTYPES:
        raise BadShard(f"{what} holds {dtype.name} values, not token ids (integer dtypes only)")
    if n_doc < 1:
        raise BadShard(f"{what} has no document indices (it needs documents + 1, from 0)")
    lengths_at = HEADER_BYTES
    pointers_at = lengths_at + 4 * n_seq
    documents_at = pointers_at + 8 * n_seq
    if max_sequences is None:
        body = await read_exact(store, uri, lengths_at, documents_at + 8 * n_doc, what)
        lengths = np.frombuffer(body, "<i4", n_seq, 0)
        pointers = np.frombuffer(body, "<i8", n_seq, 4 * n_seq)
        documents = np.frombuffer(body, "<i8", n_doc, 12 * n_seq)
    else:
        n = min(n_seq, max_sequences)
        lengths = np.frombuffer(await read_exact(store, uri, lengths_at, lengths_at + 4 * n,
                                                  what), "<i4")
        pointers = np.frombuffer(await read_exact(store, uri, pointers_at, pointers_at + 8 * n,
                                                   what), "<i8")
        documents = None
    _check_index(lengths, pointers, documents, n_seq, dtype, what)
    return MegatronIndex(dtype, lengths, pointers, documents)


def _check_index(lengths: np.ndarray, pointers: np.ndarray, documents: Optional[np.ndarray],
                 n_seq: int, dtype: np.dtype, what: str) -> None:
    if lengths.size and lengths.min() < 0:
        bad = int(np.argmax(lengths < 0))
        raise BadShard(f"{what} gives sequence {bad} a negative length {int(lengths[bad])}")
    wrong = (pointers < 0) | (pointers % dtype.itemsize != 0)
    if wrong.any():
        bad = int(np.argmax(wrong))
        raise BadShard(f"{what} gives sequence {bad} the byte pointer {int(pointers[bad])}, "
                        f"not a non-negative multiple of {dtype.itemsize} ({dtype.name})")
    if documents is not None:
        steps = np.diff(documents)
        if documents[0] != 0 or documents[-1] != n_seq or (steps.size and steps.min() < 0):
            raise BadShard(f"{what} has document indices that do not run from 0 up to the "
                            f"sequence count {n_seq} (found {int(documents[0])} .. "
                            f"{int(documents[-1])}" + (", decreasing" if steps.size
                                                       and steps.min() < 0 else "") + ")")


def _fitting(index: MegatronIndex, bin_size: int, problems: Problems) -> np.ndarray:
    """The sequences whose bytes lie inside the .bin (all of them unless it is truncated);
    each that does not is reported (the first with how many there are) and left out."""
    ends = index.pointers + index.lengths.astype(np.int64) * index.dtype.itemsize
    outside = (ends > bin_size) & (index.lengths > 0)
    if not outside.any():
        return np.arange(index.lengths.size)
    bad = np.flatnonzero(outside)
    first = int(bad[0])
    reason = (f"sequence {first} ends at byte {int(ends[first])} but the .bin holds {bin_size} "
              f"bytes: the .bin is truncated ({bad.size} sequence(s) do not fit)")
    problems.record(first, reason)
    for record in bad.tolist()[1:]:
        problems.record(record, f"sequence {record} ends at byte {int(ends[record])}, past the "
                                f"end of the .bin ({bin_size} bytes): the .bin is truncated")
    return np.flatnonzero(~outside)


def plan_ranges(index: MegatronIndex, keep: np.ndarray,
                chunk_bytes: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """Byte ranges of the .bin holding runs of whole consecutive sequences (of `keep`, the
    sequence numbers to read, in order), about `chunk_bytes` each.

    Returns (start, groups, ranges): each kept sequence's byte start (an empty sequence takes the
    end of the sequence before, so it never breaks a run), and per range the run [a, b) of
    positions in `keep`. Sequences that are not back to back in the .bin start a new range."""
    size = index.dtype.itemsize
    nbytes = index.lengths[keep].astype(np.int64) * size
    start = index.pointers[keep].astype(np.int64)
    nonempty = nbytes > 0
    if not nonempty.any():
        return start, np.zeros((0, 2), np.int64), []
    ends = start + nbytes
    last = np.maximum.accumulate(np.where(nonempty, np.arange(keep.size), -1))
    first_start = start[int(np.argmax(nonempty))]
    start = np.where(nonempty, start, np.where(last >= 0, ends[np.maximum(last, 0)], first_start))
    ends = start + nbytes
    breaks = np.flatnonzero(start[1:] != ends[:-1]) + 1
    groups: list[tuple[int, int]] = []
    for a, b in zip([0, *breaks.tolist()], [*breaks.tolist(), keep.size]):
        offsets = np.append(start[a:b], ends[b - 1])
        groups += [(a + g, a + h) for g, h in plan_groups(offsets, chunk_bytes)]
    ranges = [(int(start[a]), int(ends[b - 1])) for a, b in groups]
    return start, np.array(groups, np.int64).reshape(-1, 2), ranges


class MegatronStream(PlannedStream):
    def __init__(self, *, problems: Problems, index: MegatronIndex, keep: np.ndarray,
                 chunk_bytes: int):
        super().__init__(problems)
        self._dtype = index.dtype
        self._out_dtype = _OUT_DTYPES[index.dtype]
        self._column_dtype = column_dtype(index.dtype, self._out_dtype)
        self._signed = index.dtype.kind == "i" and self._out_dtype == np.int32
        self._keep = keep
        self._lengths = index.lengths[keep].astype(np.int64)
        self._start, self._groups, self._ranges = plan_ranges(index, keep, chunk_bytes)
        self._finished = False

    def _record_spans(self) -> list[tuple[int, int]]:
        return [(int(self._keep[a]), int(self._keep[b - 1]) + 1) for a, b in self._groups.tolist()]

    def decode(self, chunk: bytes) -> list[RawRecord]:
        return self.decode_columns(chunk).widened(self._out_dtype).to_list()

    def finish(self) -> list[RawRecord]:
        return self.finish_columns().widened(self._out_dtype).to_list()

    def decode_columns(self, chunk: bytes) -> Records:
        """The group's sequences as offsets over the range's tokens: a view of `chunk` for
        uint8, uint16 and int32 files (`column_dtype`), else one conversion."""
        k = self._next_range()
        a, b = self._groups[k].tolist()
        begin, end = self._ranges[k]
        if len(chunk) != end - begin:
            raise DataError(f"expected {end - begin} bytes for sequences {int(self._keep[a])}.."
                            f"{int(self._keep[b - 1])}, got {len(chunk)}", source=self._source,
                            shard=self._shard_name)
        tokens = np.frombuffer(chunk, self._dtype).astype(self._column_dtype, copy=False)
        lows = (self._start[a:b] - begin) // self._dtype.itemsize
        lengths = self._lengths[a:b]
        records = self._keep[a:b].astype(np.int64)
        if self._signed and tokens.size and tokens.min() < 0:
            return Records.of(self._without_negative(tokens, records.tolist(), lows.tolist(),
                                                     (lows + lengths).tolist()))
        offsets = np.zeros(lengths.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if not np.array_equal(offsets[:-1], lows):   # not back to back: gather them
            tokens = tokens[gather_index(lows, lengths)]
        return Records(records, tokens=tokens, offsets=offsets)

    def finish_columns(self) -> Records:
        if self._finished:
            return Records.empty()
        self._finished = True
        if not self._ranges:   # no bytes to read: every kept sequence is empty
            return Records(self._keep.astype(np.int64), tokens=np.empty(0, self._out_dtype),
                           offsets=np.zeros(self._keep.size + 1, np.int64))
        return Records.empty()

    def _without_negative(self, tokens: np.ndarray, records: list[int], lows: list[int],
                          highs: list[int]) -> list[RawRecord]:
        """The records of a range with negative ids in it: each sequence holding one is
        reported and left out."""
        out = []
        for record, lo, hi in zip(records, lows, highs):
            piece = tokens[lo:hi]
            if piece.size and piece.min() < 0:
                self._record_error(record, "negative token id")
            else:
                out.append(RawRecord(record, piece))
        return out



class MegatronFormat:
    """`<prefix>.bin` shards with their `<prefix>.idx` companions (Megatron-LM's
    `IndexedDataset`). Auto-detection leaves LitData chunk names (`chunk-0-3.bin`) alone;
    with format="megatron" every `.bin` is a shard."""

    name = "megatron"

    def __init__(self, text_field: str | None = None, tokens_field: str | None = None,
                 named: bool = False):
        self._named = named   # token ids already: no fields

    def matches(self, uri: str) -> bool:
        name = uri.rsplit("/", 1)[-1]
        if not name.endswith(BIN_SUFFIX) or len(name) == len(BIN_SUFFIX):
            return False
        return self._named or not LITDATA_CHUNK.fullmatch(name)

    async def _index(self, store: ObjectStore, shard: ObjectInfo, problems: Problems,
                     max_sequences: Optional[int] = None) -> Optional[MegatronIndex]:
        try:
            return await read_index(store, idx_uri(shard.uri), max_sequences)
        except BadShard as exc:
            problems.bad_shard(exc)
            return None

    async def open(self, store: ObjectStore, shard: ObjectInfo, *, problems: Problems,
                   chunk_bytes: int) -> MegatronStream | EmptyStream:
        if chunk_bytes <= 0:
            raise ConfigError.at("chunk_bytes", f"must be positive, got {chunk_bytes}")
        index = await self._index(store, shard, problems)
        if index is None:
            return EmptyStream()
        keep = _fitting(index, shard.size, problems)
        return MegatronStream(problems=problems, index=index, keep=keep, chunk_bytes=chunk_bytes)

    async def document_lengths(self, store: ObjectStore, shard: ObjectInfo, *,
                               problems: Problems, tokenizer: TextTokenizer | None = None,
                               limit: int | None = None,
                               chunk_bytes: int = LENGTHS_CHUNK_BYTES) -> DocumentLengths:
        """Each sequence's length in tokens (`ShardFormat.document_lengths`), from the .idx
        alone; the .bin is not read, only its size (from the listing) is compared with the
        pointers, so sequences a truncated .bin cuts off are handled as `open` handles them.
        Negative ids, which only the .bin can show, go unnoticed here. With `limit`, only the
        first `limit` lengths and pointers are read. `tokenizer` and `chunk_bytes` are not
        used: the documents are token ids already."""
        if limit is not None and limit < 0:
            raise ConfigError.at("limit", f"must be >= 0, got {limit}")
        index = await self._index(store, shard, problems, max_sequences=limit)
        if index is None:
            return DocumentLengths(np.zeros(0, np.int64), "index")
        keep = _fitting(index, shard.size, problems)
        return DocumentLengths(index.lengths[keep].astype(np.int64), "index")


def write_megatron_dataset(path_prefix: str | os.PathLike, sequences: Sequence[np.ndarray],
                           dtype=np.uint16,
                           document_ends: Optional[Sequence[int]] = None) -> Path:
    """Write `<prefix>.bin` and `<prefix>.idx` in Megatron-core's layout (see the module
    docstring): one sequence per array, back to back. `document_ends` lists the sequence count
    at the end of each document (default: one sequence per document). Returns the .bin path."""
    dtype = np.dtype(dtype).newbyteorder("<")
    if dtype not in CODE_OF or dtype not in _OUT_DTYPES:
        raise ConfigError.at("dtype", f"must be one of {sorted(d.name for d in _OUT_DTYPES)}, "
                                      f"got {dtype.name}")
    arrays = [np.asarray(s) for s in sequences]
    for k, array in enumerate(arrays):
        if array.ndim != 1:
            raise ConfigError.at(f"sequences[{k}]", f"is not 1-D (shape {array.shape})")
        if array.size and not np.array_equal(array.astype(dtype).astype(np.int64),
                                             array.astype(np.int64)):
            raise ConfigError.at(f"sequences[{k}]", f"holds values that {dtype.name} cannot hold")
    lengths = np.array([a.size for a in arrays], np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1]]) * dtype.itemsize \
        if arrays else np.zeros(0, np.int64)
    ends = range(1, len(arrays) + 1) if document_ends is None else document_ends
    documents = np.array([0, *ends], np.int64)
    prefix = Path(path_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    bin_path = prefix.with_name(prefix.name + BIN_SUFFIX)
    with open(bin_path, "wb") as f:
        for array in arrays:
            f.write(array.astype(dtype).tobytes())
    with open(prefix.with_name(prefix.name + IDX_SUFFIX), "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODE_OF[dtype], len(arrays),
                                    documents.size))
        f.write(lengths.tobytes() + pointers.astype("<i8").tobytes() + documents.tobytes())
    return bin_path
