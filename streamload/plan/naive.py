"""The baseline planner: fill ranks in arrival order with about equal token counts.

This is what sample- or token-balanced loaders do. It stays as the baseline that cost-aware
balancing is measured against (`method="naive"`).
"""
from __future__ import annotations

import numpy as np

from .types import Assignment, Candidates, Geometry


def assign_naive(c: Candidates, selected: np.ndarray, geometry: Geometry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First-fit into the current rank's rows; move on once it holds its share of tokens.

    Returns (take, rank, row) for the items that fit; the rest stay in their buffers.
    """
    R, M, C = geometry.ranks, geometry.micro_batches, geometry.capacity
    lengths = c.length[selected]
    share = float(lengths.sum()) / R
    fill = np.zeros((R, M), dtype=np.int64)
    used = np.zeros(R, dtype=np.int64)          # tokens per rank (fill summed over rows)
    room = np.full(R, C, dtype=np.int64)        # largest free space of any row of each rank
    take, ranks, rows = [], [], []
    current = 0
    for idx, length in zip(selected.tolist(), lengths.tolist()):
        if current < R - 1 and used[current] >= share:
            current += 1
        # The current rank first, then later ranks: the first with a row that has room.
        # (Vectorized over ranks: with the step's tokens near capacity a rank rarely reaches
        # its share, so a loop over ranks made this O(items * ranks) in Python.)
        later = np.flatnonzero(room[current:] >= length)
        if later.size == 0:
            continue
        r = current + int(later[0])
        m = int(np.flatnonzero(fill[r] + length <= C)[0])
        fill[r, m] += length
        used[r] += length
        room[r] = C - int(fill[r].min())
        take.append(idx); ranks.append(r); rows.append(m)
    return (np.asarray(take, dtype=np.int64), np.asarray(ranks, dtype=np.int32),
            np.asarray(rows, dtype=np.int32))


def finish(c: Candidates, take, rank, row, geometry: Geometry, cost) -> Assignment:
    """Wrap (take, rank, row) into an Assignment with predicted per-rank costs."""
    R, M = geometry.ranks, geometry.micro_batches
    row_costs = cost.row_costs(c.length[take], rank.astype(np.int64) * M + row, R * M,
                               extra_cost=c.extra_cost[take])
    return Assignment(take=take, rank=rank, row=row,
                      rank_cost=row_costs.reshape(R, M).sum(axis=1))
