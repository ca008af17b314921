"""Decoded records -> buffer items: tokenize, then split, truncate or drop long documents.

Runs in a worker thread, off the event loop. Returns counts instead of touching shared
metrics, so the loop thread stays the only writer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..formats.base import Problems, RawRecord
from ..tokenizer import TextTokenizer
from .. import pieces
from .buffer import Item

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


def records_to_items(records: list[RawRecord], shard: int, capacity: int, long_documents: str,
                     keep=None,
                     ages: Optional[dict] = None, problems: Optional[Problems] = None
                     ) -> tuple[list[Item], TransformCounts]:
    """`keep(record, chunk)` filters items of a resumed shard: it gives the offset to start an
    item at (0: whole; a remainder of a piece that was cut) or None to leave it out. `ages`
    restores deferral ages.
    A record whose token ids batches cannot carry is reported to `problems` and left out
    (None: a DataError naming the record)."""
    problems = problems or Problems(None, None)
    counts = TransformCounts(records=len(records))
    indexes: list[int] = []
    arrays: list[np.ndarray] = []
    for record in records:
        try:
            tokens = to_tokens(record.payload)
        except TokenIdError as exc:   # from the tokenizer, or a uint32 / int64 token shard
            problems.record(record.index, str(exc))
            counts.records -= 1   # counted as skipped instead
            continue
        indexes.append(record.index)
        arrays.append(tokens)
    # Which items, cut where: the rule the dry run applies to lengths (pieces.cut_documents).
    cuts = pieces.cut_documents([t.shape[0] for t in arrays], capacity, long_documents)
    counts.empty, counts.truncated, counts.dropped = cuts.empty, cuts.truncated, cuts.dropped
    items: list[Item] = []
    if not (cuts.split or cuts.truncated):   # every item a whole document
        items = [Item(shard, indexes[d], -1, arrays[d]) for d in cuts.document.tolist()]
    else:
        for d, chunk, start, n in zip(cuts.document.tolist(), cuts.chunks().tolist(),
                                      cuts.start.tolist(), cuts.lengths.tolist()):
            tokens = arrays[d]
            items.append(Item(shard, indexes[d], chunk,
                              tokens if n == tokens.shape[0] else tokens[start:start + n]))
    if keep is not None:
        kept = []
        for item in items:
            start = keep(item.record, item.chunk)
            if start == 0:
                kept.append(item)
            elif start is not None:   # the rest of a piece the planner cut
                kept.append(Item(shard, item.record, item.chunk | start, item.tokens[start:]))
        items = kept
    if ages:
        for item in items:
            item.age = ages.get((shard, item.record, item.chunk), 0)
    counts.samples = len(items)
    counts.tokens = int(cuts.lengths.sum()) if keep is None else \
        sum([item.tokens.shape[0] for item in items])
    return items, counts


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
