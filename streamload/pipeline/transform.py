"""Decoded records -> buffer items (an `ItemBlock` per range): tokenize, then split, truncate or
drop long documents.

Runs in a worker thread, off the event loop. Returns counts instead of touching shared
metrics, so the loop thread stays the only writer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from ..formats.base import Problems, RawRecord, Records
from ..tokenizer import TextTokenizer
from .. import pieces
from .buffer import ItemBlock

_INT32_MAX = int(np.iinfo(np.int32).max)


class TokenIdError(ValueError):
    """Token ids that batches cannot carry: not integers, negative, or past int32."""


def utf8_bytes(text: str) -> np.ndarray:
    """The default tokenizer: one token per UTF-8 byte (ids 0..255). The tokens stay uint8, a
    read-only view of the encoded bytes: a quarter of the memory of int32, and no copy. Packing
    widens them into its int64 rows."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


@dataclass
class TransformCounts:
    records: int = 0
    samples: int = 0
    tokens: int = 0
    empty: int = 0
    truncated: int = 0
    dropped: int = 0

    def add_to(self, metrics) -> None:
        metrics.records += self.records
        metrics.samples += self.samples
        metrics.tokens += self.tokens
        metrics.empty_documents += self.empty
        metrics.truncated_documents += self.truncated
        metrics.dropped_documents += self.dropped


_process_tokenizer: Optional[TextTokenizer] = None


def set_process_tokenizer(tokenizer: TextTokenizer) -> None:
    """Initializer of a tokenizer process: keep the tokenizer, so calls do not re-send it."""
    global _process_tokenizer
    _process_tokenizer = tokenizer


def tokenize_texts(texts: list[str]) -> list:
    """Runs in a tokenizer process (for tokenizers that hold the GIL)."""
    return _process_tokenizer.encode_texts(texts)


def to_tokens(payload) -> np.ndarray:
    """A record's tokens: UTF-8 bytes of a text (no tokenizer configured), or its ids, checked.
    With a tokenizer, texts are tokenized before (`SourceFetcher._tokenize`)."""
    if isinstance(payload, str):
        return utf8_bytes(payload)
    # A token shard's document (or a tokenizer's ids). The token format has already refused
    # negative ids, so an int32 document needs no check, and no scan per document.
    payload = np.asarray(payload)
    if payload.dtype == np.int32:
        return payload.reshape(-1)
    return token_ids(payload.reshape(-1))


def token_ids(ids: np.ndarray) -> np.ndarray:
    """`ids` as int32, the dtype batches carry between ranks; raises TokenIdError for ids it
    cannot hold (a cast would wrap them silently). An empty document is empty whatever its
    dtype (`np.asarray([])`, what a Python tokenizer gives for "", is float64)."""
    if ids.size == 0:
        return np.zeros(0, dtype=np.int32)
    if ids.dtype.kind not in "iu":
        raise TokenIdError(f"token ids must be integers, got an array of {ids.dtype}")
    if ids.size and not (ids.dtype.kind == "u" and ids.dtype.itemsize <= 2):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high > _INT32_MAX:
            raise TokenIdError(f"token id {low if low < 0 else high} is outside 0..2**31-1, "
                               f"the ids batches carry")
    return ids.astype(np.int32, copy=False)


def records_to_block(records: Union[Records, list[RawRecord]], shard: int, capacity: int,
                     long_documents: str, keep=None, ages: Optional[dict] = None,
                     problems: Optional[Problems] = None) -> tuple[ItemBlock, TransformCounts]:
    """A range's records -> one `ItemBlock` of items, in columns: the records' tokens in one buffer
    (`record_tokens`), cut by the rule for long documents (`pieces.cut_documents`), each item
    a (start, length) over that buffer. No Python object per item, except on a resumed shard:
    `keep(record, chunk)` filters its items (the offset to start an item at, 0: whole, a
    remainder of a piece that was cut; None: leave it out) and `ages` restores deferral ages.
    A record whose token ids batches cannot carry is reported to `problems` and left out
    (None: a DataError naming the record)."""
    problems = problems or Problems(None, None)
    raw = None
    if not isinstance(records, Records):
        raw, records = records, Records.of(records)
    counts = TransformCounts(records=len(records))
    index, tokens, offsets = record_tokens(records, problems, counts, raw)
    # Which items, cut where: the rule the dry run applies to lengths (pieces.cut_documents).
    cuts = pieces.cut_documents(np.diff(offsets), capacity, long_documents)
    counts.empty, counts.truncated, counts.dropped = cuts.empty, cuts.truncated, cuts.dropped
    start = offsets[cuts.document] + cuts.start
    length, record, chunk = cuts.lengths, index[cuts.document], cuts.chunks()
    if keep is not None:
        offset = [keep(r, c) for r, c in zip(record.tolist(), chunk.tolist())]
        kept = np.fromiter((o is not None for o in offset), bool, len(offset))
        offset = np.fromiter((o or 0 for o in offset), np.int64, len(offset))[kept]
        start, length, record, chunk = start[kept], length[kept], record[kept], chunk[kept]
        # the rest of a piece the planner cut: its chunk field names the offset (`pieces`)
        chunk = np.where(offset > 0, chunk | offset, chunk)
        start, length = start + offset, length - offset
    age = None
    if ages:
        age = np.fromiter((ages.get((shard, r, c), 0) for r, c in
                           zip(record.tolist(), chunk.tolist())), np.int64, record.shape[0])
    block = ItemBlock(shard, tokens, start, length, record, chunk, age)
    counts.samples, counts.tokens = len(block), block.total
    return block, counts


def record_tokens(records: Records, problems: Problems, counts: TransformCounts,
                  raw: Optional[list[RawRecord]] = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(index, tokens, offsets) of `records`' tokens in one buffer: texts as their UTF-8
    bytes (uint8, `utf8_bytes`), token ids checked as `token_ids` does (int32 ones trusted:
    a token format has refused negative ids; uint8 and uint16 ones kept as they are, a view
    of the bytes read). A record whose ids fail is reported to
    `problems`, left out and uncounted (`counts.records`). `raw`: the RawRecords `records`
    were gathered from, if so (their own arrays are checked when the buffer fails)."""
    if records.texts is not None:
        texts = records.texts
        if all(map(str.isascii, texts)):   # (a flag of each str) one byte per character
            data = "".join(texts).encode("ascii")
            lengths = np.fromiter(map(len, texts), np.int64, len(texts))
        else:
            encoded = [t.encode("utf-8") for t in texts]
            data = b"".join(encoded)
            lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        offsets = np.zeros(len(texts) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return records.index, np.frombuffer(data, np.uint8), offsets
    tokens = records.tokens
    if tokens.dtype == np.int32 or (tokens.dtype.kind == "u" and tokens.dtype.itemsize <= 2):
        return records.index, tokens, records.offsets   # kept as they are: packing widens
    try:
        return records.index, token_ids(tokens), records.offsets
    except TokenIdError:   # find the records to name, check the others one by one
        pass
    good = []
    for record in (raw if raw is not None else records.to_list()):
        try:
            good.append(RawRecord(record.index, to_tokens(record.payload)))
        except TokenIdError as exc:   # from the tokenizer, or a uint32 / int64 token shard
            problems.record(record.index, str(exc))
            counts.records -= 1   # counted as skipped instead
    checked = Records.of(good)
    return checked.index, checked.tokens.astype(np.int32, copy=False), checked.offsets


def tokenizer_pool(config, tokenizer):
    """A process pool for tokenizers that hold the GIL (`tokenize_in="processes"`), each process
    holding a copy of `tokenizer`; None otherwise."""
    if config.tokenize_in != "processes" or tokenizer is None:
        return None
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    return ProcessPoolExecutor(config.tokenizer_processes,
                               mp_context=multiprocessing.get_context("spawn"),
                               initializer=set_process_tokenizer, initargs=(tokenizer,))
