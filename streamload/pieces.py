"""The `chunk` field of an item's id (shard, record, chunk), and which items documents become
(`cut_documents`), in one place.

-1: a whole document. Otherwise the item is a piece of a document longer than C: piece k (the
document's tokens from k·C), or what is left of piece k after the planner delivered its first
`offset` tokens to fill a row (`plan/fill.py`). Both live in one int, `k << 32 | offset`, so
ids still sort in stream order ((record, chunk) tuples, as the state's filters compare them)
and the state keeps its shape: a remainder is a pending item like any other.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WHOLE = -1
SHIFT = 32
OFFSET_MASK = (1 << SHIFT) - 1


def piece(k: int, offset: int = 0) -> int:
    return (k << SHIFT) | offset


def split(chunk: int) -> tuple[int, int]:
    """(k, offset) of a piece's chunk field."""
    return chunk >> SHIFT, chunk & OFFSET_MASK


def suffix(chunk: int) -> str:
    """The sample id's suffix: "" (whole), ":k", or ":k+offset" for a remainder."""
    if chunk < 0:
        return ""
    k, offset = split(chunk)
    return f":{k}" if offset == 0 else f":{k}+{offset}"


def parse(sample_id: str) -> tuple[str, int, int]:
    """A sample id, "source/shard/record" with `suffix`, as (document id, k, offset); k is -1
    for a whole document."""
    head, sep, tail = sample_id.rpartition("/")
    record, _, piece_part = tail.partition(":")
    if not piece_part:
        return sample_id, WHOLE, 0
    k, _, offset = piece_part.partition("+")
    return f"{head}{sep}{record}", int(k), int(offset or 0)


# -- long documents: which items a run of documents becomes ------------------------------------

LONG_DOCUMENTS = ("split", "truncate", "drop")


@dataclass(frozen=True)
class Cuts:
    """The items that a run of documents becomes (`cut_documents`), in order: per item, the
    document it comes from, where it starts in that document, how long it is and which piece it
    is. The loader slices its token buffers by these (`pipeline.transform.records_to_block`); the
    dry run uses the lengths alone."""
    lengths: np.ndarray    # int64 [items]: tokens in the item
    document: np.ndarray   # int64 [items]: the item's document (position in the input)
    start: np.ndarray      # int64 [items]: the item's first token within its document
    piece: np.ndarray      # int64 [items]: k for piece k of a split document, else WHOLE (-1)
    empty: int = 0         # empty documents (left out)
    split: int = 0         # documents longer than C split into pieces
    truncated: int = 0     # documents longer than C cut to their first C tokens
    dropped: int = 0       # documents longer than C left out

    @property
    def divisible(self) -> np.ndarray:
        """bool [items]: a piece of a split document (the planner may cut those to fill a row,
        `plan/fill.py`)."""
        return self.piece >= 0

    def chunks(self) -> np.ndarray:
        """int64 [items]: the chunk field of each item's id: WHOLE, or `piece(k)`."""
        return np.where(self.piece >= 0, self.piece << SHIFT, WHOLE)

    def counts(self) -> dict[str, int]:
        return {"empty": self.empty, "split": self.split, "truncated": self.truncated,
                "dropped": self.dropped}


def cut_documents(lengths, capacity: int, long_documents: str) -> Cuts:
    """Document lengths -> items, the loader's rule for long documents (C = `capacity`).

    Empty documents are left out (and counted). A document of at most C tokens is one whole
    item. A longer one, by `long_documents`: "split" into pieces k = 0, 1, ... of C tokens (the
    last one shorter), each an item with chunk field `piece(k)`; "truncate" to its first C
    tokens, a whole item; "drop": left out. Pure NumPy, no per-document Python."""
    if long_documents not in LONG_DOCUMENTS:
        raise ValueError(f"long_documents must be one of {', '.join(LONG_DOCUMENTS)}, "
                         f"got {long_documents!r}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    docs = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if docs.size and docs.min() < 0:
        raise ValueError(f"document lengths must be >= 0, got {int(docs.min())}")
    empty = int(np.count_nonzero(docs == 0))
    long = docs > capacity
    n_long = int(np.count_nonzero(long))
    if n_long == 0 or long_documents != "split":
        keep = docs > 0
        if n_long and long_documents == "drop":
            keep &= ~long
        document = np.flatnonzero(keep).astype(np.int64, copy=False)
        zeros = np.zeros(document.size, dtype=np.int64)
        return Cuts(lengths=np.minimum(docs[document], capacity), document=document, start=zeros,
                    piece=np.full(document.size, WHOLE, dtype=np.int64), empty=empty,
                    truncated=n_long if long_documents == "truncate" else 0,
                    dropped=n_long if long_documents == "drop" else 0)
    per_document = -(-docs // capacity)                 # items per document; 0 when empty
    document = np.repeat(np.arange(docs.size, dtype=np.int64), per_document)
    first = np.cumsum(per_document) - per_document      # each document's first item
    k = np.arange(document.size, dtype=np.int64) - first[document]
    start = k * capacity
    return Cuts(lengths=np.minimum(docs[document] - start, capacity), document=document,
                start=start, piece=np.where(long[document], k, WHOLE), empty=empty, split=n_long)
