"""Full steps: what the epoch pays for a slot left empty, and the top-up that fills the step.

Pure NumPy. A trainer pays for steps, not tokens: the epoch's compute is

    Σ over steps (the slowest rank's cost + a per-step overhead o)

and, with every step full and balanced, Σ of the slowest ranks' costs is the epoch's work over
R. Leaving an item of cost w and l tokens out of a step changes that sum in three ways:
- this step's slowest rank gets cheaper by Δ (at most w, and only if the item sat on it);
- the item's work is still paid later: full, balanced steps spread it at w / R;
- the epoch needs l / (R·M·C) steps more, each paying o.
So the epoch gains `Δ − w/R − o·l/(R·M·C)` (`deferral_gain`; with P pipeline stages the work
is paid at (M + P − 1)/(M·P) per unit, `Geometry.work_time`). At R = 1, Δ ≤ w = w/R: a slot
left empty never pays. Every rule in the planner that leaves an item out (balance's trim, its
refinement's drops, the top-up's refusals) asks this one question.

`top_up` runs after a planning method, on a step below FULL: rows with room take the step's
leftovers (selected but not placed first, then the rest of the windows in arrival order,
interleaved across sources as `select` interleaves them), never past a row's capacity; then
rows with room left take the head of a piece of a split document (the shortest piece longer
than the room), cut to fit, its rest staying in its buffer (every method: full steps are the
loader's guarantee, whatever the planner). The pool holds only sources the schedule gives a
share this step (`Planner._fill`). The mixer's carry sees what was taken, so the mix stays
exact over any window of steps.
"""
from __future__ import annotations

import bisect

import numpy as np

from .cost import CostModel
from .types import Candidates, Geometry

FULL = 0.99                # a step below this share of its tokens takes what fits, whatever
                           # it costs: the epoch rule trades only the last percent
MIN_CUT, MIN_CUT_SHARE = 32, 128   # a cut head holds at least max(32, C/128) tokens
MAX_ATTEMPTS_PER_ROW = 16   # the top-up looks at most this many candidates per row, plus a few
MIN_ATTEMPTS = 256
WAVE_ROWS = 64        # from this many rows, light items fill in vectorized waves first
LIGHT_FRACTION = 16   # light: at most C / 16 tokens
WAVES = 256
OFFER_PER_ROW = 4     # items a wave offers per open row


def largest_that_fits(room: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One wave of a monotone matching: `room` descending (one per row), `lengths` descending
    (one per item); the j-th row takes the longest item left that fits in it, each item at most
    once. Rooms and lengths both descend, so the item for row j is j + the running max of
    (first fitting index - j). Returns (pick, ok): row j takes item pick[j] where ok[j].
    (`balance._waves` and `_Rows.wave_fill` run waves of it.)"""
    ascending = lengths[::-1]
    first_fit = lengths.size - np.searchsorted(ascending, room + 0.5, side="right")
    j = np.arange(room.size)
    pick = j + np.maximum.accumulate(first_fit - j) if room.size else j
    return pick, pick < lengths.size


def deferral_gain(lowered_max, work, tokens, geometry: Geometry, overhead: float):
    """What leaving `work` (cost units) of `tokens` tokens out of this step gains the epoch,
    when it lowers the step's slowest rank by `lowered_max` (module docstring). Positive: leave
    it out. Works on arrays."""
    return lowered_max - work * geometry.work_time / geometry.ranks \
        - overhead * tokens / geometry.step_tokens


def epoch_cost(step_time: np.ndarray, work: float, tokens: int, geometry: Geometry,
               overhead: float) -> float:
    """What a step's plan costs the epoch, up to a constant: its slowest rank's time
    (`step_time`, per rank), less the `work` it retires (paid at `work_time`/R per unit in full,
    balanced steps if left for later) and the overhead of the steps its tokens save. Of two
    plans for one step, the lower is better; at R = 1 that is the one with more tokens."""
    return float(step_time.max(initial=0.0)) - work * geometry.work_time / geometry.ranks \
        - overhead * tokens / geometry.step_tokens


def step_overhead_cost(fraction: float, geometry: Geometry, cost: CostModel) -> float:
    """The per-step overhead `o` in cost units: `fraction` of the linear cost of one rank's
    full step (M·C tokens at b each; at a·C per token when b is 0)."""
    per_token = cost.b if cost.b > 0 else cost.a * geometry.capacity
    return float(fraction) * geometry.micro_batches * geometry.capacity * per_token


class _Rows:
    """The step's rows as the top-up fills them: tokens per row, cost per rank."""

    def __init__(self, c: Candidates, take, rank, row, geometry: Geometry, cost: CostModel):
        R, M, C = geometry.ranks, geometry.micro_batches, geometry.capacity
        self.c, self.geometry, self.cost = c, geometry, cost
        cells = rank.astype(np.int64) * M + row
        self.fill = np.bincount(cells, weights=c.length[take], minlength=R * M).astype(np.int64)
        self.room = C - self.fill
        row_load = cost.row_costs(c.length[take], cells, R * M, extra_cost=c.extra_cost[take])
        if geometry.pipelined:   # under 1F1B each row counts on its own (balance.py)
            self.load, self.row_rank = row_load, np.arange(R * M)
        else:
            self.load, self.row_rank = row_load.reshape(R, M).sum(axis=1), np.repeat(np.arange(R), M)
        self.added: list[int] = []
        self.cells: list[int] = []
        self.lengths: list[int] = []   # tokens taken of each added item

    def place(self, item: int, cell: int, work: float, length: int | None = None) -> None:
        length = int(self.c.length[item]) if length is None else length
        self.fill[cell] += length
        self.room[cell] -= length
        self.load[self.row_rank[cell]] += work
        self.added.append(item)
        self.cells.append(cell)
        self.lengths.append(length)

    def cut_to_fill(self, divisible: np.ndarray) -> None:
        """Rows with room take, largest room first, the head of a divisible item cut to the
        room (the shortest item longer than it); the rest of the item stays in its buffer. Rows
        with less than MIN_CUT of room are left: a head that short is a document boundary
        for a few tokens."""
        capacity = self.geometry.capacity
        open_rows = np.flatnonzero(self.room >= max(MIN_CUT, capacity // MIN_CUT_SHARE))
        open_rows = open_rows[np.argsort(-self.room[open_rows], kind="stable")]
        # By length (ties in `divisible`'s order): each row cuts the shortest item longer than
        # its room, so the rest left in the buffer is the shortest, and it packs whole later
        # instead of starting a chain of cuts (every row a rest plus the head of the next).
        by_length = np.argsort(self.c.length[divisible], kind="stable")
        items = divisible[by_length].tolist()
        lengths = self.c.length[divisible][by_length].tolist()
        for cell in open_rows.tolist():
            if not items:
                break
            room = int(self.room[cell])
            k = min(bisect.bisect_right(lengths, room), len(items) - 1)   # else the longest
            item, length = items.pop(k), lengths.pop(k)
            head = min(room, length)
            work = float(self.cost.doc_cost(head)) + float(self.c.extra_cost[item])
            self.place(item, cell, work, head)

    def wave_fill(self, pool: np.ndarray, stop_at: float) -> np.ndarray:
        """Light items of `pool` (in priority order) into rows with room, in vectorized waves:
        a wave offers the next items in order (a few per open row), and rows, roomiest first,
        each take the longest offered item that fits (`largest_that_fits`). For items this light the row they land in barely moves the step's
        cost, and a per-item choice over thousands of rows cost seconds per step at
        R·M = 2048. Returns the items not placed, in order."""
        lengths, cost = self.c.length, self.cost
        pool = np.asarray(pool, dtype=np.int64)
        # Only a prefix can be needed: a few times the tokens the step is short of.
        short = max(stop_at - float(self.fill.sum()), 0.0)
        prefix = int(np.searchsorted(np.cumsum(lengths[pool]), OFFER_PER_ROW * short)) + 1
        left, rest = pool[:prefix], pool[prefix:]
        for _ in range(WAVES):
            total = int(self.fill.sum())
            if left.size == 0 or total >= stop_at:
                break
            open_rows = np.flatnonzero(self.room >= lengths[left].min())
            if open_rows.size == 0:
                break
            offered = np.flatnonzero(lengths[left] <= self.room[open_rows].max())
            offered = offered[:OFFER_PER_ROW * open_rows.size]
            # Longest first; gaps roomiest first: the j-th gap takes the first item from the
            # running position that fits it.
            offered = offered[np.argsort(-lengths[left[offered]], kind="stable")]
            rows = open_rows[np.argsort(-self.room[open_rows], kind="stable")]
            pick, ok = largest_that_fits(self.room[rows], lengths[left[offered]])
            if not ok.any():
                break
            chosen, cells = offered[pick[ok]], rows[ok]
            # Stop near FULL: the rows in order of the wave, while the step is short.
            placed_len = lengths[left[chosen]]
            keep = np.cumsum(placed_len) - placed_len < stop_at - total
            chosen, cells, placed_len = chosen[keep], cells[keep], placed_len[keep]
            items = left[chosen]
            np.add.at(self.load, self.row_rank[cells],
                      cost.doc_cost(placed_len) + self.c.extra_cost[items])
            self.fill[cells] += placed_len
            self.room[cells] -= placed_len
            self.added.extend(items.tolist())
            self.cells.extend(cells.tolist())
            self.lengths.extend(placed_len.tolist())
            gone = np.zeros(left.size, dtype=bool)
            gone[chosen] = True
            left = left[~gone]
        return np.concatenate([left, rest])

    def best(self, item: int) -> tuple[int, float, float]:
        """(row, the item's cost there, what the step's slowest rank gains): the row whose
        rank ends cheapest, then the tightest. The item must fit somewhere."""
        cost, length = self.cost, int(self.c.length[item])
        fits = np.flatnonzero(self.room >= length)
        extra = float(self.c.extra_cost[item])
        if cost.document_masking:
            marginal = np.full(fits.size, float(cost.doc_cost(length)) + extra)
        else:   # a row's cost is convex in its tokens: what this row would add
            f = self.fill[fits].astype(np.float64)
            marginal = cost.a * ((f + length) ** 2 - f * f) + cost.b * length + extra
        ends = self.load[self.row_rank[fits]] + marginal
        tied = np.flatnonzero(ends == ends.min())
        pick = tied[np.argmin(self.room[fits[tied]])]
        return int(fits[pick]), float(marginal[pick]), max(float(ends[pick] - self.load.max()), 0.0)

    def fill_pass(self, pool: list[int], *, cost_aware: bool, overhead: float,
                  stop_at: float, budget: int, refuse: bool = True) -> list[int]:
        """One pass over `pool`; returns the items it refused (cost-aware) or skipped. An item
        longer than every row's room is skipped for free; `budget` bounds the others.
        `refuse=False`: cost-aware placement (the row whose rank ends cheapest) of every item
        that fits, even where leaving it out would gain the epoch."""
        left, lengths = [], self.c.length
        max_room = int(self.room.max())
        total, attempts = int(self.fill.sum()), 0
        for k, item in enumerate(pool):
            if attempts >= budget or max_room <= 0 or total >= stop_at:
                left.extend(pool[k:])
                break
            length = int(lengths[item])
            if length > max_room:
                left.append(item)
                continue
            attempts += 1
            if not cost_aware:
                self.place(item, int(np.flatnonzero(self.room >= length)[0]), 0.0)
            else:
                cell, work, raised = self.best(item)
                if refuse and deferral_gain(raised, work, length, self.geometry, overhead) > 0:
                    left.append(item)
                    continue
                self.place(item, cell, work)
            total += length
            max_room = int(self.room.max())
        return left


def top_up(c: Candidates, take: np.ndarray, rank: np.ndarray, row: np.ndarray,
           pool: np.ndarray, geometry: Geometry, cost: CostModel, *, overhead: float,
           cost_aware: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Add candidates from `pool` (indices, in priority order, none of them in `take`) to rows
    with room. Returns the new (take, rank, row) and the tokens taken of each item (`length`),
    the added items after the planned ones.

    It brings a step up to FULL of its tokens, no further (a step that full is left as the
    method planned it, which also keeps this loop off the common path). `cost_aware`: each
    item goes to the row whose rank ends cheapest (then the tightest row), and only when
    leaving it out would not gain the epoch (`deferral_gain` <= 0); then, while the step is
    still below FULL, a second pass places what fits regardless (each item still where its rank
    ends cheapest): the step's tokens are the
    recipe's batch size, so the epoch rule may only trade the last percent. Otherwise first fit
    in (rank, row) order, as a token-balanced loader packs. Last, for every method (full steps
    are the loader's guarantee, not a planner's), rows with room left take the head of a
    divisible item (a piece of a long document) cut to fit (`cut_to_fill`)."""
    R, M = geometry.ranks, geometry.micro_batches
    pool = np.asarray(pool, dtype=np.int64)
    rows = _Rows(c, take, rank, row, geometry, cost)
    full = FULL * geometry.step_tokens
    fits = pool[c.length[pool] <= rows.room.max(initial=0)]
    if pool.size == 0 or rows.fill.sum() >= full:   # full already: nothing to do (and cheap)
        return take, rank, row, c.length[take]
    budget = MAX_ATTEMPTS_PER_ROW * R * M + MIN_ATTEMPTS
    if R * M > WAVE_ROWS:
        # Many rows: light items go in vectorized waves first; the per-item pass sees the rest.
        light = c.length[fits] <= geometry.capacity // LIGHT_FRACTION
        rest = rows.wave_fill(fits[light], full)
        fits = np.concatenate([fits[~light], rest])
    left = rows.fill_pass(fits.tolist(), cost_aware=cost_aware, overhead=overhead,
                          stop_at=full, budget=budget)
    if cost_aware and left:
        # Still short of FULL: what fits goes in regardless, but each to the row whose rank
        # ends cheapest (first fit put a refused document into the first row with room, which
        # made it the step's straggler: 128k rows, 4 stages, R = 4 ran at 0.95 instead of 0.96).
        rows.fill_pass(left, cost_aware=True, refuse=False, overhead=overhead, stop_at=full,
                       budget=budget)
    if rows.fill.sum() < full:
        added = np.zeros(len(c), dtype=bool)
        added[rows.added] = True
        rows.cut_to_fill(pool[c.divisible[pool] & ~added[pool]])
    cells = np.asarray(rows.cells, dtype=np.int64)
    return (np.concatenate([take, np.asarray(rows.added, dtype=np.int64)]),
            np.concatenate([rank, (cells // M).astype(rank.dtype)]),
            np.concatenate([row, (cells % M).astype(row.dtype)]),
            np.concatenate([c.length[take], np.asarray(rows.lengths, dtype=np.int64)]))
