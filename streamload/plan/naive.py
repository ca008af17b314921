"""The baseline planner: fill ranks in arrival order with about equal token counts.

This is what sample- or token-balanced loaders do. It stays as the baseline that cost-aware
balancing is measured against (`method="naive"`).
"""
from __future__ import annotations

import numpy as np

from .cost import pipeline_time
from .types import Assignment, Candidates, Geometry


def assign_naive(c: Candidates, selected: np.ndarray, geometry: Geometry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First-fit into the current rank's rows; move on once it holds its share of tokens.

    Returns (take, rank, row) for the items that fit; the rest stay in their buffers.
    """
    R, M, C = geometry.ranks, geometry.micro_batches, geometry.capacity
    lengths = c.length[selected]
    share = float(lengths.sum()) / R
    # Python lists for the per-item bookkeeping (NumPy calls on tiny arrays cost more than the
    # work); `room` is mirrored in an array for the rare scan over later ranks, kept up to date
    # for the ranks after the current one only (the scan starts after it).
    fill = [[0] * M for _ in range(R)]
    used = [0] * R                              # tokens per rank (fill summed over rows)
    room = [C] * R                              # largest free space of any row of each rank
    room_array = np.full(R, C, dtype=np.int64)
    take, ranks, rows = [], [], []
    add_take, add_rank, add_row = take.append, ranks.append, rows.append
    current, last = 0, R - 1
    for idx, length in zip(selected.tolist(), lengths.tolist()):
        if current < last and used[current] >= share:
            current += 1
        # The current rank first, then later ranks: the first with a row that has room.
        # (Vectorized over ranks: with the step's tokens near capacity a rank rarely reaches
        # its share, so a loop over ranks made this O(items * ranks) in Python.)
        if room[current] >= length:
            r = current
        else:
            later = np.flatnonzero(room_array[current + 1:] >= length)
            if later.size == 0:
                continue
            r = current + 1 + int(later[0])
        used[r] += length
        if M == 1:
            m = 0
            room[r] -= length
        else:
            row = fill[r]
            m = 0
            while row[m] + length > C:
                m += 1
            if C - row[m] == room[r]:           # the emptiest row fills: the room may shrink
                row[m] += length
                room[r] = C - min(row)
            else:
                row[m] += length
        if r != current:
            room_array[r] = room[r]
        add_take(idx)
        add_rank(r)
        add_row(m)
    return (np.asarray(take, dtype=np.int64), np.asarray(ranks, dtype=np.int32),
            np.asarray(rows, dtype=np.int32))


def finish(c: Candidates, take, rank, row, geometry: Geometry, cost,
           length: np.ndarray | None = None) -> Assignment:
    """Wrap (take, rank, row) into an Assignment with predicted per-rank costs. `length`: the
    tokens taken of each item (default: all of them)."""
    R, M = geometry.ranks, geometry.micro_batches
    length = c.length[take] if length is None else np.asarray(length, dtype=np.int64)
    row_costs = cost.row_costs(length, rank.astype(np.int64) * M + row, R * M,
                               extra_cost=c.extra_cost[take] if c.has_extra_cost else None)
    row_costs = row_costs.reshape(R, M)
    return Assignment(take=take, rank=rank, row=row, rank_cost=row_costs.sum(axis=1),
                      length=length, row_cost=row_costs,
                      step_time=pipeline_time(row_costs, geometry.pipeline_stages))
