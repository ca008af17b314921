"""Moves after a step is planned, under 1F1B: the slowest rank's items go to other (rank, row)
slots while that lowers the step's time (issue 20, the 1F1B counterpart of `swaps.py`).

Why a pass of its own: with P pipeline stages the balancer evens out *rows* (`balance.py`:
every row is a bin) and deals them to ranks (`balance.deal_rows`), and the top-up then fills
rows with room by row load (`fill.py`). Neither sees a rank's time, (sum + (P - 1) * max) / P
of its rows (`cost.pipeline_time`): a rank holding one heavy row pays it P times over, so its
other rows should be its lightest, and two heavy items should not share a rank while a rank
holds no heavy one. Where that goes wrong it costs most at small R and at the epoch's end,
where a step holds a few long documents (128k, P = 4, R = 4, the Loader's last step: the
top-up put a 129k document on the rank that held a 115k one, 565k against 469k had it gone
to a rank of its own).

It starts from the plan as made, or from a largest-first repack of the same items where
that is faster (each item, heaviest first, to the least loaded row with room, `balance._lpt`,
the rows then dealt to ranks like the balancer's, `deal_rows`). Whole rows then swap between
the slowest rank and any other while that lowers the step's time (`_row_swaps`: a row of one
long document cannot move item by item, and which rows share a rank decides its time), before
the moves and again after them. In the moves, each round takes the
slowest rank and, over its items x (at most `MAX_ITEMS`, spread over their costs) and the
(rank, row) slots with room for x (its own rows, and those of faster ranks: at most
`MAX_SLOTS`, the fastest ranks'), makes the move that brings
the slowest of the ranks' times lowest, x's old rank and the slot's rank worked out in full
under 1F1B. It stops when no move lowers the step's time, when the slowest rank is within
`TOLERANCE` of the time every rank would take with the step's work spread evenly over every
row (no plan goes below it), or after `MAX_MOVES`.

What it keeps: the plan's items (and the tokens taken of each) are the same, only their
(rank, row) change, so the selection, the quotas, the fill, exactly-once and the deferral
bound are the planner's; every row within C tokens; the step's time never rises.
Deterministic: ties go to the lowest index. It runs only where rows are the balancer's bins
under a pipeline (document masking, P > 1, M > 1), up to `MAX_ROWS` rows (each round is
O(items on the top rank x rows)), and not on a step with images under caps per row.
"""
from __future__ import annotations

import numpy as np

from .balance import _Bins, _lpt, deal_rows
from .caps import RowCaps
from .cost import CostModel, pipeline_time
from .types import Candidates, Geometry

MAX_ROWS = 256     # R * M at most (R = 64 at M = 4): beyond, rounds cost more than they gain
MAX_MOVES = 64     # moves per pass at most
TOLERANCE = 2e-3   # done when the slowest rank is within this share of the even time
MAX_SLOTS = 64     # a round looks at the slots with room of the fastest ranks, this many at most
MAX_ITEMS = 128    # a round looks at this many of the top rank's items at most
ROW_SWAPS = True   # whole rows swap between ranks too, before and after the moves (`_row_swaps`)
_RELATIVE = 1e-9   # a move must lower the step's time by this share at least


def applies(c: Candidates, geometry: Geometry, cost: CostModel, caps: RowCaps = RowCaps()
            ) -> bool:
    """Where the pass runs (see the module): rows as bins under 1F1B, R > 1, few rows, and
    no caps per row to keep on an image step."""
    return (geometry.ranks > 1 and geometry.pipelined and cost.document_masking
            and geometry.rows <= MAX_ROWS and not (caps.active and c.images is not None))


def _even_time(work: float, geometry: Geometry) -> float:
    """A rank's time were the step's `work` spread evenly over every row: no plan goes below."""
    return work / geometry.ranks * geometry.work_time


def _slowest_but(times: np.ndarray, top: int) -> np.ndarray:
    """Per rank r: the slowest time of the ranks other than `top` and r (-inf where none)."""
    others = np.where(np.arange(times.size) == top, -np.inf, times)
    first = int(np.argmax(others))
    second = float(np.max(np.where(np.arange(times.size) == first, -np.inf, others)))
    return np.where(np.arange(times.size) == first, second, float(others[first]))


def _moves(weight: np.ndarray, length: np.ndarray, cell: np.ndarray, geometry: Geometry,
           max_moves: int) -> np.ndarray:
    """`cell` (rank * M + row per item) after the moves that lower the step's time."""
    R, M, C, P = geometry.ranks, geometry.micro_batches, geometry.capacity, \
        geometry.pipeline_stages
    cell = cell.copy()
    row_cost = np.bincount(cell, weights=weight, minlength=R * M).reshape(R, M)
    fill = np.bincount(cell, weights=length, minlength=R * M).astype(np.int64)
    own_rows = np.arange(M)
    every = np.arange(R * M)
    even = _even_time(float(weight.sum()), geometry)
    for _ in range(max_moves):
        times = pipeline_time(row_cost, P)
        top = int(np.argmax(times))
        now = float(times[top])
        if now <= even * (1 + TOLERANCE):
            break
        xs = np.flatnonzero(cell // M == top)
        if xs.size == 0:
            break
        # Slots that can take one of them: room for the shortest, on the top rank or on a
        # rank below it (a rank as slow already cannot take anything and lower the step);
        # and the items that fit one of those.
        room = C - fill
        slots = np.flatnonzero((room >= length[xs].min()) & (times[every // M] < now))
        if slots.size > MAX_SLOTS:   # those of the fastest ranks (ties: lowest slot)
            slots = np.sort(slots[np.lexsort((slots, times[slots // M]))[:MAX_SLOTS]])
        slots = np.union1d(slots, np.arange(top * M, top * M + M))
        xs = xs[length[xs] <= room[slots].max()]
        if xs.size == 0:
            break
        if xs.size > MAX_ITEMS:   # spread over their weights, lightest to heaviest
            xs = xs[np.lexsort((xs, weight[xs]))][
                np.linspace(0, xs.size - 1, MAX_ITEMS).round().astype(np.int64)]
        slot_rank, slot_row = slots // M, slots % M
        wx, lx, rx = weight[xs], length[xs], cell[xs] % M
        # The top rank's rows once x leaves (one line per x), and its time then.
        left = np.repeat(row_cost[top][None, :], xs.size, axis=0)
        left[np.arange(xs.size), rx] -= wx
        top_after = pipeline_time(left, P)
        # The slowest of the other ranks, the top one and q's rank left out.
        but = _slowest_but(times, top)
        rest = but[slot_rank]
        # q's rank with x in row q: its sum and max grow.
        q_rows = row_cost[slot_rank]                                   # (slots, M)
        q_max_other = np.where(own_rows[None, :] == slot_row[:, None], -np.inf,
                               q_rows).max(axis=1)
        grown = row_cost[slot_rank, slot_row][None, :] + wx[:, None]  # (nx, slots)
        q_after = (q_rows.sum(axis=1)[None, :] + wx[:, None]
                   + (P - 1) * np.maximum(q_max_other[None, :], grown)) / P
        new = np.maximum(np.maximum(top_after[:, None], q_after), rest[None, :])
        # Into another row of the top rank itself: only its max can change.
        mine = np.flatnonzero(slot_rank == top)
        inside = np.repeat(left[:, None, :], mine.size, axis=1)      # (nx, M, M)
        inside[:, np.arange(mine.size), slot_row[mine]] += wx[:, None]
        new[:, mine] = np.maximum(pipeline_time(inside, P), float(but[top]))
        fits = room[slots][None, :] >= lx[:, None]
        new = np.where(fits & (slots[None, :] != cell[xs][:, None]), new, np.inf)
        k = int(np.argmin(new))                                        # ties: lowest index
        if not new.flat[k] < now * (1 - _RELATIVE):
            break
        i, j = divmod(k, slots.size)
        x, q = int(xs[i]), int(slots[j])
        old = int(cell[x])
        row_cost.flat[old] -= weight[x]
        fill[old] -= length[x]
        row_cost.flat[q] += weight[x]
        fill[q] += length[x]
        cell[x] = q
    return cell


def _row_swaps(weight: np.ndarray, cell: np.ndarray, geometry: Geometry,
               max_swaps: int) -> np.ndarray:
    """`cell` after whole rows are swapped between the slowest rank and any other while that
    lowers the step's time. Under 1F1B a rank pays its costliest row P times: rows dealt one
    heavy per rank (`deal_rows`) leave each rank's other rows to decide, and a row of one long
    document cannot move item by item (no other row has room for it)."""
    R, M, P = geometry.ranks, geometry.micro_batches, geometry.pipeline_stages
    row_cost = np.bincount(cell, weights=weight, minlength=R * M).reshape(R, M)
    where = np.arange(R * M)                 # where each of the plan's rows is now
    mine_i, theirs_j = np.repeat(np.arange(M), M), np.tile(np.arange(M), M)
    for _ in range(max_swaps):
        times = pipeline_time(row_cost, P)
        top = int(np.argmax(times))
        now = float(times[top])
        if now <= _even_time(float(row_cost.sum()), geometry) * (1 + TOLERANCE):
            break
        others = np.flatnonzero(np.arange(R) != top)
        # Every (rank q, row i of the top rank, row j of q): both ranks' rows after the swap.
        pairs = np.arange(M * M)
        b_rows = row_cost[others]                                         # (R-1, M)
        a_new = np.repeat(np.repeat(row_cost[top][None, None, :], M * M, axis=1),
                          others.size, axis=0)                            # (R-1, M*M, M)
        a_new[:, pairs, mine_i] = b_rows[:, theirs_j]
        b_new = np.repeat(b_rows[:, None, :], M * M, axis=1)              # (R-1, M*M, M)
        b_new[:, pairs, theirs_j] = row_cost[top][mine_i][None, :]
        rest = _slowest_but(times, top)[others][:, None]
        new = np.maximum(np.maximum(pipeline_time(a_new, P), pipeline_time(b_new, P)), rest)
        k = int(np.argmin(new))                                           # ties: lowest
        if not new.flat[k] < now * (1 - _RELATIVE):
            break
        qi, pair = divmod(k, M * M)
        q, i, j = int(others[qi]), int(mine_i[pair]), int(theirs_j[pair])
        row_cost[top, i], row_cost[q, j] = row_cost[q, j], row_cost[top, i]
        s, t = top * M + i, q * M + j
        ws, wt = where == s, where == t
        where[ws], where[wt] = t, s
    return where[cell]


def _largest_first(weight: np.ndarray, length: np.ndarray, geometry: Geometry
                   ) -> np.ndarray | None:
    """The same items packed again, heaviest first, each to the least loaded row with room
    (`balance._lpt`), the rows dealt to ranks like the balancer's (`deal_rows`); None when
    an item finds no row."""
    R, M, C = geometry.ranks, geometry.micro_batches, geometry.capacity
    bins = _Bins(R * M, 1, C, weight, length, np.full(weight.size, -1, np.int64))
    items = np.arange(weight.size)
    _lpt(bins, items[np.lexsort((items, -length, -weight))], cap=None)
    if (bins.bin < 0).any():
        return None
    return deal_rows(bins.load, R, M)[bins.bin]


def pipeline_moves(c: Candidates, take: np.ndarray, rank: np.ndarray, row: np.ndarray,
                   length: np.ndarray, geometry: Geometry, cost: CostModel,
                   max_moves: int = MAX_MOVES) -> tuple[np.ndarray, np.ndarray]:
    """(rank, row) for the same `take` and `length` (tokens taken of each) with the step's
    1F1B time lowered by moves (see the module)."""
    take = np.asarray(take, np.int64)
    rank = np.asarray(rank, np.int64)
    row = np.asarray(row, np.int64)
    if take.size == 0:
        return rank.astype(np.int32), row.astype(np.int32)
    M, P = geometry.micro_batches, geometry.pipeline_stages
    length = np.asarray(length, np.int64)
    weight = cost.doc_cost(length)
    if c.has_extra_cost:
        weight = weight + c.extra_cost[take]
    cell = rank * M + row

    def step_time(cells: np.ndarray) -> float:
        return float(pipeline_time(np.bincount(cells, weights=weight, minlength=geometry.rows)
                                .reshape(geometry.ranks, M), P).max())

    # The plan as made, or the largest-first repack where that is faster; then the moves.
    start, start_time = cell, step_time(cell)
    if start_time <= _even_time(float(weight.sum()), geometry) * (1 + TOLERANCE):
        return rank.astype(np.int32), row.astype(np.int32)   # even already
    packed = _largest_first(weight, length, geometry)
    if packed is not None and step_time(packed) < start_time * (1 - _RELATIVE):
        start = packed
    if ROW_SWAPS:
        start = _row_swaps(weight, start, geometry, max_moves)
    best = _moves(weight, length, start, geometry, max_moves)
    if ROW_SWAPS:
        best = _row_swaps(weight, best, geometry, max_moves)
    best_time = step_time(best)
    if best_time >= start_time * (1 - _RELATIVE):   # never worse: the plan as made
        return rank.astype(np.int32), row.astype(np.int32)
    return (best // M).astype(np.int32), (best % M).astype(np.int32)
