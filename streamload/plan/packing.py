"""Pack planned samples into rows: tokens, cu_seqlens and position_ids. Pure NumPy."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PackedRow:
    tokens: np.ndarray        # int64 [n]
    cu_seqlens: np.ndarray    # int32 [docs + 1]
    position_ids: np.ndarray  # int64 [n], restarting at 0 for each document
    item_indices: np.ndarray  # which of the input items are in this row, in order


def pack_rows(token_arrays: list[np.ndarray], rows: np.ndarray, num_rows: int,
              capacity: int) -> list[PackedRow]:
    """Concatenate items into `num_rows` rows, keeping their order within each row. Items may
    hold any integer dtype that fits int64 (uint8 bytes, int32 ids, ...)."""
    rows = np.asarray(rows, dtype=np.int64)
    lengths = np.fromiter((a.shape[0] for a in token_arrays), dtype=np.int64,
                          count=len(token_arrays))
    by_row = np.argsort(rows, kind="stable")   # grouped by row, input order within a row
    bounds = np.searchsorted(rows[by_row], np.arange(num_rows + 1))
    # Each document's positions are a prefix of this: one concatenation of views per row is
    # cheaper than arange(total) - repeat(starts, lengths).
    counting = np.arange(lengths.max(initial=0), dtype=np.int64)
    empty = [np.zeros(0, dtype=np.int64)]
    out = []
    for row in range(num_rows):
        members = by_row[bounds[row]:bounds[row + 1]]
        row_lengths = lengths[members]
        total = int(row_lengths.sum())
        if total > capacity:
            raise AssertionError(f"row {row} holds {total} tokens > capacity {capacity}")
        tokens = np.concatenate([token_arrays[i] for i in members] or empty, dtype=np.int64)
        positions = np.concatenate([counting[:n] for n in row_lengths.tolist()] or empty)
        cu = np.zeros(members.size + 1, dtype=np.int32)
        np.cumsum(row_lengths, out=cu[1:])
        out.append(PackedRow(tokens, cu, positions, members))
    return out
