"""Pack planned samples into rows: tokens, cu_seqlens and position_ids. Pure NumPy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class PackedRow:
    tokens: np.ndarray        # int64 [n]
    cu_seqlens: np.ndarray    # int32 [docs + 1]
    position_ids: np.ndarray  # int64 [n], restarting at 0 for each document
    item_indices: np.ndarray  # which of the input items are in this row, in order


def pack_rows(token_arrays: list[np.ndarray], rows: np.ndarray, num_rows: int,
              capacity: int, out: Optional[tuple[np.ndarray, np.ndarray]] = None
              ) -> list[PackedRow]:
    """Concatenate items into `num_rows` rows, keeping their order within each row. Items may
    hold any integer dtype that fits int64 (uint8 bytes, int32 ids, ...).

    The rows are consecutive slices of one tokens array and one positions array: the two int64
    arrays `out` (at least as long as all the items together; see pipeline/recycle.py), or new
    ones."""
    rows = np.asarray(rows, dtype=np.int64)
    lengths = np.fromiter((a.shape[0] for a in token_arrays), dtype=np.int64,
                          count=len(token_arrays))
    by_row = np.argsort(rows, kind="stable")   # grouped by row, input order within a row
    bounds = np.searchsorted(rows[by_row], np.arange(num_rows + 1))
    starts = np.zeros(by_row.size + 1, dtype=np.int64)   # of each item, in row order
    np.cumsum(lengths[by_row], out=starts[1:])
    row_tokens = np.diff(starts[bounds])
    if row_tokens.size and row_tokens.max() > capacity:
        row = int(np.argmax(row_tokens > capacity))
        raise AssertionError(f"row {row} holds {row_tokens[row]} tokens > capacity {capacity}")
    n = int(starts[-1])
    tokens, positions = out if out is not None else (np.empty(n, np.int64), np.empty(n, np.int64))
    tokens, positions = tokens[:n], positions[:n]
    if n:
        ordered = by_row.tolist()
        np.concatenate([token_arrays[i] for i in ordered], out=tokens, casting="safe")
        # Each document's positions are a prefix of this: one concatenation of views is
        # cheaper than arange(total) - repeat(starts, lengths).
        counting = np.arange(lengths.max(), dtype=np.int64)
        np.concatenate([counting[:length] for length in lengths[by_row].tolist()], out=positions)
    packed = []
    for row in range(num_rows):
        a, b = int(bounds[row]), int(bounds[row + 1])
        begin, end = int(starts[a]), int(starts[b])
        packed.append(PackedRow(tokens[begin:end], (starts[a:b + 1] - begin).astype(np.int32),
                                positions[begin:end], by_row[a:b]))
    return packed
