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
import heapq

import numpy as np

from .cost import CostModel
from .select import interleaved, interleaved_head
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
    first_fit = lengths.size - np.searchsorted(lengths[::-1], fit_limits(room, lengths),
                                               side="right")
    return monotone_picks(first_fit, lengths.size)


def fit_limits(room: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The longest whole length that fits each `room` (within half a token: rooms may be
    fractional gaps), in `lengths`' integer dtype, so a search over the lengths compares
    integers (a float key made NumPy convert the whole array on every call)."""
    if np.issubdtype(room.dtype, np.integer) or not np.issubdtype(lengths.dtype, np.integer):
        return room if np.issubdtype(room.dtype, np.integer) else room + 0.5
    return np.floor(room + 0.5).astype(lengths.dtype)


def monotone_picks(first_fit: np.ndarray, available: int) -> tuple[np.ndarray, np.ndarray]:
    """`largest_that_fits` from each row's first fitting index among `available` items."""
    j = np.arange(first_fit.size)
    pick = j + np.maximum.accumulate(first_fit - j) if first_fit.size else j
    return pick, pick < available


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
        row_load = cost.row_costs(c.length[take], cells, R * M,
                                  extra_cost=c.extra_cost[take] if c.has_extra_cost else None)
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

    def wave_fill(self, pool: np.ndarray, stop_at: float) -> tuple[np.ndarray, int]:
        """Light items of `pool` (in priority order) into rows with room, in vectorized waves:
        a wave offers the next items in order (a few per open row), and rows, roomiest first,
        each take the longest offered item that fits (`largest_that_fits`). For items this
        light the row they land in barely moves the step's cost, and a per-item choice over
        thousands of rows cost seconds per step at R·M = 2048. Only a prefix of `pool` is
        offered; returns the items of that prefix not placed, in order, and its length.

        A wave touches only the items it offers: placed items are marked, not cut out of the
        pool, and the scan for the next offer starts at the first item still offered (the
        ones before it are longer than any room, and rooms only shrink)."""
        lengths, cost = self.c.length, self.cost
        pool = np.asarray(pool, dtype=np.int64)
        # Only a prefix can be needed: a few times the tokens the step is short of.
        short = max(stop_at - float(self.fill.sum()), 0.0)
        prefix = _first_reaching(lengths, pool, OFFER_PER_ROW * short) + 1
        left = pool[:prefix]
        left_len = lengths[left]
        alive = np.ones(left.size, dtype=bool)
        # How many items still waiting have each length: the shortest one opens the rows.
        waiting = np.bincount(left_len) if left.size else np.zeros(1, dtype=np.int64)
        n_alive, start = left.size, 0
        for _ in range(WAVES):
            total = int(self.fill.sum())
            if n_alive == 0 or total >= stop_at:
                break
            open_rows = np.flatnonzero(self.room >= int(np.argmax(waiting > 0)))
            if open_rows.size == 0:
                break
            offered = _first_alive(alive, left_len, int(self.room[open_rows].max()), start,
                                   OFFER_PER_ROW * open_rows.size)
            start = int(offered[0])
            # Longest first; gaps roomiest first: the j-th gap takes the first item from the
            # running position that fits it.
            offered = offered[_descending(left_len[offered])]
            rows = open_rows[_descending(self.room[open_rows])]
            pick, ok = largest_that_fits(self.room[rows], left_len[offered])
            if not ok.any():
                break
            chosen, cells = offered[pick[ok]], rows[ok]
            # Stop near FULL: the rows in order of the wave, while the step is short.
            placed_len = left_len[chosen]
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
            alive[chosen] = False
            n_alive -= chosen.size
            waiting -= np.bincount(placed_len, minlength=waiting.size)
        return left[alive], left.size

    def best(self, item: int, index: "_ByLoad | None" = None) -> tuple[int, float, float]:
        """(row, the item's cost there, what the step's slowest rank gains): the row whose
        rank ends cheapest, then the tightest (then the first). The item must fit somewhere.
        `index`: the rows by load (`_ByLoad`, document masking only), which finds the same row
        without a pass over all rows when one of the least loaded fits."""
        cost, length = self.cost, int(self.c.length[item])
        if index is not None:
            found = index.best(self, item, length)
            if found is not None:
                return found
        # Only the rows it fits are looked at (often few: the others are full).
        fits = np.flatnonzero(self.room >= length)
        extra = float(self.c.extra_cost[item])
        if cost.document_masking:   # the index caches the cost by length: the same float
            marginal = (float(cost.doc_cost(length)) if index is None else
                        index.cost_of(self, length)) + extra
        else:   # a row's cost is convex in its tokens: what this row would add
            f = self.fill[fits].astype(np.float64)
            marginal = cost.a * ((f + length) ** 2 - f * f) + cost.b * length + extra
        row_load = self.load[fits] if self.geometry.pipelined else \
            self.load[self.row_rank[fits]]
        ends = row_load + marginal
        tied = np.flatnonzero(ends == ends.min())
        at = int(tied[np.argmin(self.room[fits[tied]])])
        work = marginal if cost.document_masking else float(marginal[at])
        top = index.top if index is not None else float(self.load.max())   # the same max
        return int(fits[at]), work, max(float(ends[at] - top), 0.0)

    def fill_pass(self, pool: np.ndarray, *, cost_aware: bool, overhead: float,
                  stop_at: float, budget: int, refuse: bool = True) -> np.ndarray:
        """One pass over `pool`; returns the items it refused (cost-aware) or skipped, and
        those it did not reach, in order. An item longer than every row's room is skipped for
        free; `budget` bounds the others. `refuse=False`: cost-aware placement (the row whose
        rank ends cheapest) of every item that fits, even where leaving it out would gain the
        epoch. (The pool goes to Python lists a chunk at a time: the pass often stops early in
        a pool of a million items.)"""
        pool = np.asarray(pool, dtype=np.int64)
        left, lengths = [], self.c.length
        max_room = int(self.room.max())
        index, by_load = None, cost_aware and self.cost.document_masking
        total, attempts = int(self.fill.sum()), 0
        for first in range(0, pool.size, _CHUNK):
            part = pool[first:first + _CHUNK]
            for k, (item, length) in enumerate(zip(part.tolist(), lengths[part].tolist())):
                if attempts >= budget or max_room <= 0 or total >= stop_at:
                    return np.concatenate([np.asarray(left, dtype=np.int64),
                                           pool[first + k:]])
                if length > max_room:
                    left.append(item)
                    continue
                attempts += 1
                if not cost_aware:
                    cell = int(np.argmax(self.room >= length))
                    self.place(item, cell, 0.0)
                else:
                    if by_load and index is None:   # built once a pass places an item
                        index = _ByLoad(self)
                    cell, work, raised = self.best(item, index)
                    if refuse and deferral_gain(raised, work, length, self.geometry,
                                                overhead) > 0:
                        left.append(item)
                        continue
                    self.place(item, cell, work)
                    if index is not None:
                        index.placed(self, cell)
                total += length
                if int(self.room[cell]) + length == max_room:   # rooms only shrink
                    max_room = int(self.room.max())
        return np.asarray(left, dtype=np.int64)


_CHUNK = 4096   # items a fill pass turns into Python ints at a time
_BY_LOAD_SCAN = 64   # rows `_ByLoad` looks at before it leaves the choice to a full pass


class _ByLoad:
    """The rows of a `_Rows` ordered by (load, room, row), for `_Rows.best` under document
    masking, where an item costs the same in every row: the row whose rank ends cheapest is
    the least loaded one that fits (then the tightest, then the first). A heap with stale
    entries skipped (each row's entry carries a version); loads only grow during a pass.

    Ties are taken as `best` takes them: rows whose load plus the item's cost rounds to the
    same float are tied, even at different loads. If the first `_BY_LOAD_SCAN` rows looked
    at leave the choice open (few rows fit), `best` makes it with its pass over all rows."""

    def __init__(self, rows: _Rows):
        self.pipelined = rows.geometry.pipelined
        self.M = rows.geometry.micro_batches
        row_load = rows.load if self.pipelined else rows.load[rows.row_rank]
        self.version = [0] * rows.room.size
        self.heap = [(float(load), int(room), cell, 0) for cell, (load, room) in
                     enumerate(zip(row_load.tolist(), rows.room.tolist()))]
        heapq.heapify(self.heap)
        self.top = float(rows.load.max(initial=0.0))
        self.work: dict[int, float] = {}     # doc_cost by length
        self.misses_from = rows.geometry.capacity + 1   # items from this long skip the heap

    def placed(self, rows: _Rows, cell: int) -> None:
        """Row `cell` took an item (its rank's load grew: all of that rank's rows move)."""
        cells = [cell] if self.pipelined else \
            range((cell // self.M) * self.M, (cell // self.M + 1) * self.M)
        load = float(rows.load[rows.row_rank[cell]])
        self.top = max(self.top, load)
        for c in cells:
            self.version[c] += 1
            heapq.heappush(self.heap, (load, int(rows.room[c]), c, self.version[c]))

    def cost_of(self, rows: _Rows, length: int) -> float:
        """`float(doc_cost(length))`, cached by length."""
        work = self.work.get(length)
        if work is None:
            work = self.work[length] = float(rows.cost.doc_cost(length))
        return work

    def best(self, rows: _Rows, item: int, length: int) -> tuple[int, float, float] | None:
        marginal = self.cost_of(rows, length) + float(rows.c.extra_cost[item])
        if length >= self.misses_from:
            return None
        heap, version = self.heap, self.version
        popped, choice, end = [], None, None
        while heap and len(popped) < _BY_LOAD_SCAN:
            entry = heapq.heappop(heap)
            load, room, cell, v = entry
            if v != version[cell]:
                continue                      # stale: the row has a newer entry
            popped.append(entry)
            if end is not None and load + marginal != end:
                break                         # past the tied rows
            if room >= length and (choice is None or (room, cell) < choice[:2]):
                choice, end = (room, cell), load + marginal
        else:
            if heap or choice is None:        # looked at too many rows: the full pass decides
                choice = None
        for entry in popped:
            heapq.heappush(heap, entry)
        if choice is None:
            # Rooms only shrink: items this long will likely not fit the least loaded rows
            # either, so they go straight to the full pass.
            self.misses_from = min(self.misses_from, length)
            return None
        return choice[1], marginal, max(end - self.top, 0.0)


def _first_reaching(lengths: np.ndarray, items: np.ndarray, tokens: float) -> int:
    """The first index i with sum(lengths[items[:i + 1]]) >= tokens (items.size if none), as
    np.searchsorted(np.cumsum(lengths[items]), tokens) gives it, summing only as far as
    needed (in doubling chunks)."""
    done, chunk, base = 0, 4096, 0
    while done < items.size:
        csum = base + np.cumsum(lengths[items[done:done + chunk]])
        if csum.size and csum[-1] >= tokens:
            return done + int(np.searchsorted(csum, tokens))
        base = int(csum[-1]) if csum.size else base
        done += chunk
        chunk *= 2
    return items.size


def _first_alive(alive: np.ndarray, lengths: np.ndarray, limit: int, start: int,
                 count: int) -> np.ndarray:
    """Indices of the first `count` items from `start` that are `alive` and at most `limit`
    long, scanning in doubling chunks."""
    found, total, chunk = [], 0, max(2 * count, 1024)
    while total < count and start < alive.size:
        stop = min(start + chunk, alive.size)
        hits = start + np.flatnonzero(alive[start:stop] & (lengths[start:stop] <= limit))
        found.append(hits)
        total += hits.size
        start, chunk = stop, 2 * chunk
    return np.concatenate(found)[:count] if found else np.zeros(0, dtype=np.int64)


def _descending(values: np.ndarray) -> np.ndarray:
    """Indices that sort non-negative integers `values` largest first, ties in index order
    (np.argsort(-values, kind="stable")). Values under 2**16 sort by radix, in linear time."""
    if values.size and int(values.max()) < 1 << 16 and int(values.min()) >= 0:
        return np.argsort((int(values.max()) - values).astype(np.uint16), kind="stable")
    return np.argsort(-values, kind="stable")


class Leftovers:
    """What the top-up may add, in priority order: the selected items the method did not
    place (in the selection's order), then the rest of the windows interleaved across sources
    as `select` interleaves (`select.interleaved`); only items of `eligible` sources (bool per
    source; None: all).

    Worked out only as far as the top-up reads it: a step the waves fill needs only the head
    of its light items (`light_head`), and sorting every candidate of a lookahead window for it
    cost more than the rest of the top-up."""

    def __init__(self, c: Candidates, selected: np.ndarray, take: np.ndarray,
                 eligible: np.ndarray | None = None):
        self.c = c
        placed = np.zeros(len(c), dtype=bool)
        placed[take] = True
        unplaced = np.asarray(selected, dtype=np.int64)
        unplaced = unplaced[~placed[unplaced]]
        placed[unplaced] = True
        self.member = ~placed                    # the rest of the windows
        if eligible is not None:
            unplaced = unplaced[eligible[c.source[unplaced]]]
            self.member &= c.by_source(eligible)
        self.unplaced = unplaced
        self.size = unplaced.size + int(np.count_nonzero(self.member))
        self._all: np.ndarray | None = None

    @classmethod
    def of(cls, c: Candidates, pool: np.ndarray) -> "Leftovers":
        """A pool given in full (in its order)."""
        self = cls.__new__(cls)
        self.c, self.unplaced, self.member = c, np.asarray(pool, dtype=np.int64), None
        self.size, self._all = self.unplaced.size, self.unplaced
        return self

    def all(self) -> np.ndarray:
        """The whole pool, in order."""
        if self._all is None:
            self._all = np.concatenate([self.unplaced,
                                        interleaved(self.c, np.flatnonzero(self.member))])
        return self._all

    def light_head(self, longest: int, tokens: float) -> np.ndarray:
        """The pool's items of at most `longest` tokens, in order, at least as far as the first
        one at which their running total reaches `tokens` (all of them if it never does)."""
        lengths = self.c.length
        if self._all is None:
            first = self.unplaced[lengths[self.unplaced] <= longest]
            have = float(lengths[first].sum())
            if have >= tokens:
                return first
            # One more item's worth: the running total crosses `tokens` inside the head.
            rest = interleaved_head(self.c, self.member, longest, tokens - have + longest + 1)
            if rest is not None:
                return np.concatenate([first, rest])
        pool = self.all()
        return pool[lengths[pool] <= longest]


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
    pool = pool if isinstance(pool, Leftovers) else Leftovers.of(c, pool)
    rows = _Rows(c, take, rank, row, geometry, cost)
    full = FULL * geometry.step_tokens
    if pool.size == 0 or rows.fill.sum() >= full:   # full already: nothing to do (and cheap)
        return take, rank, row, c.length[take]
    max_room = int(rows.room.max(initial=0))
    light_limit = min(max_room, geometry.capacity // LIGHT_FRACTION)
    budget = MAX_ATTEMPTS_PER_ROW * R * M + MIN_ATTEMPTS
    if R * M > WAVE_ROWS:
        # Many rows: light items go in vectorized waves first; the per-item pass sees the rest.
        # The waves offer only a few times the tokens the step is short of.
        short = max(full - float(rows.fill.sum()), 0.0)
        waved, offered = rows.wave_fill(pool.light_head(light_limit, OFFER_PER_ROW * short), full)
        if rows.fill.sum() < full and rows.room.max() > 0:   # else the passes stop at once
            everything = pool.all()
            length = c.length[everything]
            light = length <= light_limit
            rows_pass(rows, np.concatenate([everything[(length <= max_room) & ~light], waved,
                                            everything[light][offered:]]),
                      cost_aware, overhead, full, budget)
    else:
        everything = pool.all()
        rows_pass(rows, everything[c.length[everything] <= max_room], cost_aware, overhead,
                  full, budget)
    if rows.fill.sum() < full:
        everything = pool.all()
        added = np.zeros(len(c), dtype=bool)
        added[rows.added] = True
        rows.cut_to_fill(everything[c.divisible[everything] & ~added[everything]])
    cells = np.asarray(rows.cells, dtype=np.int64)
    return (np.concatenate([take, np.asarray(rows.added, dtype=np.int64)]),
            np.concatenate([rank, (cells // M).astype(rank.dtype)]),
            np.concatenate([row, (cells % M).astype(row.dtype)]),
            np.concatenate([c.length[take], np.asarray(rows.lengths, dtype=np.int64)]))


def rows_pass(rows: _Rows, fits: np.ndarray, cost_aware: bool, overhead: float, stop_at: float,
              budget: int) -> None:
    """The per-item passes of `top_up`: cost-aware first (when asked), then what still fits."""
    left = rows.fill_pass(fits, cost_aware=cost_aware, overhead=overhead, stop_at=stop_at,
                          budget=budget)
    if cost_aware and left.size:
        # Still short: what fits goes in regardless, but each to the row whose rank ends
        # cheapest (first fit put a refused document into the first row with room, which made
        # it the step's straggler: 128k rows, 4 stages, R = 4 ran at 0.95 instead of 0.96).
        rows.fill_pass(left, cost_aware=True, refuse=False, overhead=overhead, stop_at=stop_at,
                       budget=budget)
