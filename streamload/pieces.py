"""The `chunk` field of an item's id (shard, record, chunk), in one place.

-1: a whole document. Otherwise the item is a piece of a document longer than C: piece k (the
document's tokens from k·C), or what is left of piece k after the planner delivered its first
`offset` tokens to fill a row (`plan/fill.py`). Both live in one int, `k << 32 | offset`, so
ids still sort in stream order ((record, chunk) tuples, as the state's filters compare them)
and the state keeps its shape: a remainder is a pending item like any other.
"""
from __future__ import annotations

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
