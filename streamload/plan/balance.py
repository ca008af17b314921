"""Cost-balanced assignment of a step's selected samples to (rank, row).

Pure NumPy. The objective is the step time: the largest per-rank cost under the cost model,
subject to every row holding at most C tokens and every rank having exactly M rows. With P > 1
pipeline stages a rank's time is the 1F1B time of its rows (`cost.pipeline_time`), which waits
on its costliest row too, so every row is a bin of its own (`Geometry.pipelined`).

The work happens on *bins*. With document masking a bin is a rank with M rows and item costs
add up, so bins are ranks. With plain causal attention a row's cost is a convex function of its
token count, so the best plan evens out row fills, and every row is a bin of its own whose
weight is its token count.

Phases, in order (vectorized over bins; Python loops run per round, never per item):

1. **Heavy items by LPT**, heaviest first, each to the bin with the least *projected* load that
   has room, in rounds: a round hands one item to every bin within one item's weight of the
   least loaded one, which is what one-at-a-time LPT would do for those items. An item goes to
   the rank that holds it instead when that rank is in the round and costs little more.
2. **Light items by water-filling** (items under `LIGHT_SHARE` of a bin's fair load,
   `ROW_LIGHT_SHARE` of a row's where rows are the bins: most of
   them by count, few of the cost). A water level gives every bin an allowance of tokens; each
   bin first keeps light items it holds itself; where rows are the bins most of the rest go
   out in runs by cumulative tokens (`_runs`), and what is left in waves, largest item into
   largest gap, never past a row's capacity or a bin's allowance. In an over-full step with
   rows as bins, each window's first items go before the others (`_window_fronts`).
3. **Forced** items (waited `max_age` steps) ride along with the rest, ahead of the others;
   one left out displaces non-forced items from a row (`_repair`). Should even that fail, the
   plan is made again with the forced items placed first, longest first, which cannot fail while
   they take at most half the step's capacity (first-fit-decreasing).
4. **Refinement** (up to `REFINE_BINS` bins): moves and swaps between the most loaded bin and the least loaded
   ones while they lower the maximum.
5. **Trim** (up to `REFINE_BINS` bins). With the step full, bins whose documents came out
   costlier per token sit above the rest with no room to even out. Their light items wait one
   step when that gains the epoch: the step saves more than the items cost later, at w/R, plus
   the overhead of the steps they add (`fill.deferral_gain`; never at R = 1).

6. **Arrival order** (over-full steps). The items left out should be each window's latest:
   an earlier item left out takes the place of a later one of its own (rank, source) window
   where it has at least `SWAP_SHARE` of its tokens, fits, and keeps the bin at or below the
   step's most loaded one; what is left out then fills the gaps it can (`_arrival_swaps`).
With rows as bins (P > 1), the filled rows are then dealt to ranks costliest first in snake
order (`deal_rows`), so rows that could not come out even land one per rank.

Items not taken stay in their buffers; the coordinator offers them again with age + 1, and
`max_age` bounds how often that can happen. When the selection leaves room to spare (under
`TIGHT` of the capacity) nothing that fits is left out.
"""
from __future__ import annotations

import numpy as np

from .cost import CostModel
from .fill import fit_limits, monotone_picks, deferral_gain
from .types import Assignment, Candidates, Geometry

_EPS = 1e-9
TIGHT = 0.98             # selections with this share of the step's capacity fill the step
HOME_SLACK = 0.25        # an item may go home this many of its weights above the LPT choice
REFINE_BINS = 64         # refinement and trim run up to this many bins (beyond: too slow,
                         # and with that many bins the rounds and water levels are close)
DROP_SHARE = 0.1         # refinement may leave out items up to this share of the top bin
LIGHT_SHARE = 1 / 256    # an item is light below this fraction of a bin's fair load
ROW_LIGHT_SHARE = 1 / 128  # the same where rows are the bins (1F1B): still 1/(128·M) of a
                           # rank's; half the items for LPT rounds (~950 a step at 32k, M=8)
WAVE_ITEMS = 4           # light items per row left to the waves after the runs (`_runs`)
ARRIVAL_SWAPS = True     # items left out are each window's latest (`_arrival_swaps`)
SWAP_SHARE = 0.5         # an earlier item takes a later one's place from this share of its tokens
FRONT_SHARE = 0.01       # each window's first items, up to this share of its selected tokens,
                         # go first in the light fill of an over-full step (`_window_fronts`)
RUN_ROWS = 1024          # open rows from which the runs go first (fewer: the waves are cheap)


def item_costs(c: Candidates, idx: np.ndarray | None, cost: CostModel, *,
               with_linear: bool = False):
    """Cost of each candidate in `idx` (None: all) on its own (document-masking cost + the
    source's hook). `with_linear` (all candidates only): (costs, their linear part b·L)."""
    if idx is None:   # every candidate: the lengths already as floats, nothing added for none
        weight, linear = cost.split_cost(c.float_length)
        if c.has_extra_cost:
            weight += c.extra_cost
        weight.flags.writeable = False
        c.costs[cost] = weight    # the same floats as below: (a·L·L + b·L) + extra, elementwise
        return (weight, linear) if with_linear else weight
    known = c.costs.get(cost)
    if known is not None:
        return known[idx]
    return cost.doc_cost(c.length[idx]) + c.extra_cost[idx]


def exchanged_fraction(c: Candidates, assignment: Assignment) -> float:
    """Fraction of the taken tokens that leave the rank holding them (0 when nothing is taken)."""
    if len(assignment) == 0:
        return 0.0
    lengths = assignment.length
    moved = lengths[c.rank[assignment.take] != assignment.rank].sum()
    return float(moved) / float(lengths.sum())


def exchanged_tokens(c: Candidates, assignment: Assignment) -> int:
    """Tokens that the exchange step has to send to another rank."""
    moved = c.rank[assignment.take] != assignment.rank
    return int(assignment.length[moved].sum())


class _Bins:
    """Fill state of `num_bins` bins with `rows` rows of `capacity` tokens each.

    Besides the load (cost) of each bin, it keeps a *projected* load used to choose bins: every
    bin will be topped up to about `target_tokens` tokens with light items, which cost about
    `light_density` per token, so a bin short of that will cost that much more by the end. With
    the step's tokens close to capacity (the usual case) this balances the part of the cost that
    is not linear in tokens, and the token fill along with it.
    """

    def __init__(self, num_bins: int, rows: int, capacity: int, weight, length, home_bin,
                 light_density: float = 0.0, target_tokens: float = 0.0):
        self.num_bins, self.rows, self.capacity = num_bins, rows, capacity
        self.fill = np.zeros((num_bins, rows), dtype=np.int64)
        self.load = np.zeros(num_bins, dtype=np.float64)
        self.tokens = np.zeros(num_bins, dtype=np.int64)
        self.maxroom = np.full(num_bins, capacity, dtype=np.int64)
        self.light_density, self.target_tokens = light_density, target_tokens
        self.weight = weight            # per item (local index)
        self.length = length
        self.home_bin = home_bin        # -1 where an item has no home bin
        n = weight.shape[0]
        self.bin = np.full(n, -1, dtype=np.int64)
        self.row = np.full(n, -1, dtype=np.int64)

    def reset(self) -> None:
        self.fill[:] = 0
        self.load[:] = 0.0
        self.tokens[:] = 0
        self.maxroom[:] = self.capacity
        self.bin[:] = -1
        self.row[:] = -1

    def projected(self, bins=None) -> np.ndarray:
        load = self.load if bins is None else self.load[bins]
        tokens = self.tokens if bins is None else self.tokens[bins]
        return load + self.light_density * np.maximum(self.target_tokens - tokens, 0.0)

    def place(self, items: np.ndarray, bins: np.ndarray) -> np.ndarray:
        """Best-fit each item into a row of its bin (bins pairwise distinct). Returns success."""
        if items.size == 0:
            return np.zeros(0, dtype=bool)
        lengths = self.length[items]
        if self.rows == 1:                                           # rows are the bins
            fill = self.fill.reshape(-1)                             # a view: one row each
            ok = self.capacity - fill[bins] >= lengths
            b, it, placed = (bins, items, lengths) if ok.all() else \
                (bins[ok], items[ok], lengths[ok])
            fill[b] += placed
            self.load[b] += self.weight[it]
            self.tokens[b] += placed
            self.maxroom[b] = self.capacity - fill[b]
            self.bin[it] = b
            self.row[it] = 0
            return ok
        room = self.capacity - self.fill[bins]                       # (k, rows)
        fits = room >= lengths[:, None]
        score = np.where(fits, room, self.capacity + 1)
        row = score.argmin(axis=1)                                   # tightest row; ties: lowest
        ok = fits[np.arange(items.size), row]
        b, r, it = bins[ok], row[ok], items[ok]
        self.fill[b, r] += lengths[ok]
        self.load[b] += self.weight[it]
        self.tokens[b] += lengths[ok]
        self.maxroom[b] = self.capacity - self.fill[b].min(axis=1)
        self.bin[it] = b
        self.row[it] = r
        return ok

    def place_one(self, item: int, cap: float | None) -> bool:
        """Put one item on the bin with room and the least projected load; refuse if its load
        would exceed `cap`."""
        fits = np.flatnonzero(self.maxroom >= self.length[item])
        if fits.size == 0:
            return False
        best = fits[np.argmin(self.projected(fits))]                # ties: lowest bin
        if cap is not None and self.load[best] + self.weight[item] > cap * (1 + 1e-12):
            return False
        return bool(self.place(np.array([item]), np.array([best]))[0])

    def remove(self, item: int) -> None:
        b, r = self.bin[item], self.row[item]
        self.fill[b, r] -= self.length[item]
        self.load[b] -= self.weight[item]
        self.tokens[b] -= self.length[item]
        self.maxroom[b] = self.capacity - self.fill[b].min()
        self.bin[item] = -1
        self.row[item] = -1

    def put(self, item: int, b: int, r: int) -> None:
        self.fill[b, r] += self.length[item]
        self.load[b] += self.weight[item]
        self.tokens[b] += self.length[item]
        self.maxroom[b] = self.capacity - self.fill[b].min()
        self.bin[item] = b
        self.row[item] = r


def _pair_home(chunk: np.ndarray, eligible: np.ndarray, keys: np.ndarray, weight: np.ndarray,
               home_bin: np.ndarray, slot_of_bin: np.ndarray, slack: float) -> np.ndarray:
    """Bins for one LPT round (`eligible` sorted by projected load `keys`).

    LPT gives the j-th heaviest item the j-th least loaded bin. An item goes to its home bin
    instead when that bin is in the round, not claimed by a heavier item, and loaded at most
    `slack` times the item's weight above the bin LPT would give it. The rest take the
    remaining bins in order, heaviest item to least loaded bin."""
    k = chunk.size
    # Scratch, one entry per bin and a last one for "no home" (-1), always -1.
    slot_of_bin[eligible] = np.arange(eligible.size)
    slot = slot_of_bin[home_bin[chunk]]
    slot_of_bin[eligible] = -1
    wants = np.flatnonzero((slot >= 0) & (keys[slot] <= keys[:k] + slack * weight[chunk]))
    if wants.size == 0:
        return eligible[:k]
    first = np.full(eligible.size, k, dtype=np.int64)
    np.minimum.at(first, slot[wants], wants)
    winners = first[first < k]                          # the heaviest item per claimed bin
    targets = np.full(k, -1, dtype=np.int64)
    targets[winners] = eligible[slot[winners]]
    free_slots = np.ones(eligible.size, dtype=bool)
    free_slots[slot[winners]] = False
    losers = np.flatnonzero(targets < 0)
    targets[losers] = eligible[np.flatnonzero(free_slots)[:losers.size]]
    return targets


def _lpt(bins: _Bins, queue: np.ndarray, *, cap: float | None, home_first: bool = False,
         forced: np.ndarray | None = None, home_slack: float = 0.0) -> None:
    """Place `queue` (heaviest first) by batched LPT on the projected load.

    A round only uses bins with room for its first item. An item that still misses (a longer
    one later in the round) falls back to the best bin with room. With `cap`, no item goes where
    it would lift a bin above max(cap, current maximum load): it stays untaken, unless it is
    `forced`.

    The queue is the items put back ahead of the rest (`front`) followed by `queue[at:]`, and
    the projected loads (and the largest load: loads only grow here) are kept up to date for
    the bins a round touches, so a round costs a few passes over the bins, not over the queue.
    """
    w, length = bins.weight, bins.length
    slot_of_bin = np.full(bins.num_bins + 1, -1, dtype=np.int64)
    projected = bins.projected()
    top = float(bins.load.max(initial=0.0))           # loads only grow here
    flat_fill = bins.fill.reshape(-1)                  # a view (one row per bin: `place`)
    front, at = queue[:0], 0
    while front.size or at < queue.size:
        head = int(front[0]) if front.size else int(queue[at])
        limit = None if cap is None else max(cap, top) * (1 + 1e-12)
        if forced is not None and forced[head]:
            limit = None                               # a forced item goes in regardless
        usable = bins.maxroom >= length[head]
        if limit is not None:
            usable &= bins.load + w[head] <= limit
        # The open bins' projected loads (the others: infinite), and the least of them.
        open_keys = np.where(usable, projected, np.inf)
        least = open_keys.min()
        if least == np.inf:
            # The head fits nowhere: drop every queued item that fits nowhere either.
            rest = np.concatenate([front, queue[at:]])
            least = float(bins.load.min())
            fits = length[rest] <= bins.maxroom.max()
            if limit is not None:
                fits &= least + w[rest] <= limit
            fits[0] = False
            queue, front, at = rest[fits], queue[:0], 0
            continue
        eligible = np.flatnonzero(open_keys < least + max(w[head], _EPS))
        keys = projected[eligible]
        if eligible.size > 1:
            order = np.argsort(keys, kind="stable")
            eligible, keys = eligible[order], keys[order]
        if front.size >= eligible.size:
            chunk, front = front[:eligible.size], front[eligible.size:]
        else:
            take = min(eligible.size - front.size, queue.size - at)
            chunk = np.concatenate([front, queue[at:at + take]]) if front.size else \
                queue[at:at + take]
            front, at = front[:0], at + take
        # One bin in the round: the item goes there, home or not (what `_pair_home` gives).
        targets = (_pair_home(chunk, eligible, keys, w, bins.home_bin, slot_of_bin, home_slack)
                   if home_first and eligible.size > 1 else eligible[:chunk.size])
        new_load = bins.load[targets] + w[chunk]
        if limit is not None:
            allowed = new_load <= limit
            if forced is not None:
                allowed |= forced[chunk]
            if not allowed.all():
                front = np.concatenate([chunk[~allowed], front])   # their turn comes again
                chunk, targets, new_load = chunk[allowed], targets[allowed], new_load[allowed]
            if chunk.size == 0:
                continue
        if bins.rows == 1:
            # One row per bin, and every item fits its bin (the usual round): `place` and the
            # projected loads at once, from the new loads (the same sums, fewer passes).
            lengths = length[chunk]
            new_fill = flat_fill[targets] + lengths
            if (new_fill <= bins.capacity).all():
                new_tokens = bins.tokens[targets] + lengths
                flat_fill[targets] = new_fill
                bins.load[targets] = new_load
                bins.tokens[targets] = new_tokens
                bins.maxroom[targets] = bins.capacity - new_fill
                bins.bin[chunk] = targets
                bins.row[chunk] = 0
                projected[targets] = new_load + bins.light_density * \
                    np.maximum(bins.target_tokens - new_tokens, 0.0)
                top = max(top, float(new_load.max()))
                continue
        ok = bins.place(chunk, targets)
        touched = targets if ok.all() else targets[ok]
        for item in chunk[~ok].tolist():
            if bins.place_one(item, None if forced is not None and forced[item] else limit):
                touched = np.append(touched, bins.bin[item])
        if touched.size:
            projected[touched] = bins.projected(touched)
            top = max(top, float(bins.load[touched].max()))


def _level(load: np.ndarray, room: np.ndarray, density: float, tokens: float, limit: float | None):
    """Water level L with sum(clip((L - load) / density, 0, room)) = tokens (or the most room
    allows, or `limit`). Returns each bin's allowance in tokens."""
    def allowance(level):
        return np.clip((level - load) / density, 0.0, room)
    lo = float(load.min())
    hi = float((load + density * room).max())
    if limit is not None:
        hi = min(hi, limit)
    if hi <= lo or allowance(hi).sum() <= tokens:
        return allowance(max(hi, lo))
    for _ in range(48):                                # bisection: deterministic and O(B) each
        mid = 0.5 * (lo + hi)
        if allowance(mid).sum() < tokens:
            lo = mid
        else:
            hi = mid
    return allowance(hi)


def _remainder(values: np.ndarray, divisor: int) -> np.ndarray:
    """`values % divisor` of non-negative integers; a mask where the divisor is a power of two
    (M rows usually are: a sixth of the division's time over 10^6 items)."""
    if divisor > 0 and divisor & (divisor - 1) == 0:
        return values & (divisor - 1)
    return values % divisor


def _group_starts(keys: np.ndarray) -> np.ndarray:
    """For a sorted array, the index where each element's run of equal values starts. O(n)."""
    n = keys.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.not_equal(keys[1:], keys[:-1], out=new[1:])
    return np.maximum.accumulate(np.where(new, np.arange(n), 0))


def _sorted_by(*keys: tuple[np.ndarray, int]) -> np.ndarray:
    """Indices that sort by several non-negative integer keys, the first one most significant,
    ties kept in their current order (stable).

    Each key comes with its exclusive upper bound. Keys are packed into one integer; when that
    fits in 16 bits NumPy's stable sort is a radix sort, which is what makes this cheap. Up to
    32 bits, two such sorts (low half, then high half) still beat a comparison sort.
    """
    if len(keys) == 1:   # one key: it is the packed key (no passes to pack it)
        packed, bound = keys[0][0], max(int(keys[0][1]), 1)
    else:
        bound = 1
        packed = np.zeros(keys[0][0].shape[0], dtype=np.int64)
        for key, key_bound in keys:
            bound *= max(int(key_bound), 1)
            packed *= max(int(key_bound), 1)
            packed += key
    if bound > 2 ** 62:
        return np.lexsort(tuple(k for k, _ in reversed(keys)))
    if bound <= 2 ** 16:
        return np.argsort(packed.astype(np.uint16), kind="stable")
    if bound <= 2 ** 32:
        order = np.argsort((packed & 0xFFFF).astype(np.uint16), kind="stable")
        return order[np.argsort((packed[order] >> 16).astype(np.uint16), kind="stable")]
    return np.argsort(packed, kind="stable")


def _longest_first(items: np.ndarray, length: np.ndarray,
                   lengths: np.ndarray | None = None) -> np.ndarray:
    """`items` by length, longest first, ties in their current order. The key counts down
    from the longest item present (not from C), so it fits 16 bits, a radix sort, whenever the
    items are shorter than 65,536 tokens (light items always are at any C in use).
    `lengths`: `length[items]`, when already known."""
    if lengths is None:
        lengths = length[items]
    longest = int(lengths.max(initial=0))
    return items[_sorted_by((longest - lengths, longest + 1))]


def _put_many(bins: _Bins, items: np.ndarray, cells: np.ndarray, gaps: np.ndarray, *,
              one_per_row: bool = False, lengths: np.ndarray | None = None) -> None:
    """Place items into flat row indices (several per row allowed); shrink `gaps` to match.

    With `one_per_row` (no row twice, as in a wave) the rows are updated in place, not through
    counts over every row: the same sums (one item per row, and per bin unless a bin has
    several rows, where the bins' loads are still summed by `np.bincount`)."""
    M, B = bins.rows, bins.num_bins
    if lengths is None:          # else the caller's `bins.length[items]`
        lengths = bins.length[items]
    b, r = (cells, 0) if M == 1 else (cells // M, cells % M)   # one row per bin: the cell
    if one_per_row:
        bins.fill[b, r] += lengths
        gaps[cells] -= lengths
        if M == 1:
            bins.load[b] += bins.weight[items]
            bins.tokens[b] += lengths
        else:
            bins.load += np.bincount(b, weights=bins.weight[items], minlength=B)
            bins.tokens += np.bincount(b, weights=lengths, minlength=B).astype(np.int64)
        bins.bin[items] = b
        bins.row[items] = r
        return
    per_cell = np.bincount(cells, weights=lengths, minlength=B * M)
    cell_tokens = per_cell.astype(np.int64)
    bins.fill += cell_tokens.reshape(B, M)
    bins.load += np.bincount(b, weights=bins.weight[items], minlength=B)
    bins.tokens += cell_tokens if M == 1 else \
        np.bincount(b, weights=lengths, minlength=B).astype(np.int64)
    gaps -= per_cell
    bins.bin[items] = b
    bins.row[items] = r


def _keep_home(bins: _Bins, items: np.ndarray, gaps: np.ndarray) -> np.ndarray:
    """Each bin's own items (in the given order) into its own gaps by cumulative tokens.

    Bin b's rows cover [b * span, b * span + its gaps) of one axis, so nothing spills into
    another bin. Returns the items not kept (an item that straddles two rows, or passes the
    bin's gaps, or has no home), in the given order.
    """
    B, M, C = bins.num_bins, bins.rows, bins.capacity
    length = bins.length
    home = bins.home_bin[items]
    if home.size and int(home.min()) >= 0:   # every item has a home (rows under 1F1B)
        own = _sorted_by((home, B))
        count = np.bincount(home, minlength=B)
    else:
        own = np.flatnonzero(home >= 0)
        count = np.bincount(home[own], minlength=B)
        own = own[_sorted_by((home[own], B))]
    # By home, so each bin's items are a run: per-bin values are repeated over the runs
    # (sequential writes), not gathered per item.
    bin_ids = np.arange(B)
    own_items, own_home = items[own], np.repeat(bin_ids, count)
    lengths = length[own_items]
    # Tokens before each item in its bin, and up to it: whole numbers (the sums are exact).
    running = np.cumsum(lengths)
    first = np.cumsum(count) - count                  # each bin's first item in the runs
    before_bin = np.where(first > 0, running[np.maximum(first - 1, 0)], 0) if running.size \
        else np.zeros(B, dtype=np.int64)
    within = running - np.repeat(before_bin, count)
    span = float(M * C + 1)
    base_of = bin_ids * span
    end = np.repeat(base_of, count) + within
    if M == 1:
        # One row per bin: the row is the home's (or none), found without a search. The same
        # sums as below: the search would land on the home exactly when end - 0.5 <= its end.
        # Below's start test (end - lengths >= cell_end - gap - 0.5) always holds here: the
        # start, base + (within - length), is a whole number at least the base, while
        # cell_end - gap is the base within a rounding error far under 0.5 (B·span < 2^50),
        # so it is left out.
        slot = own_home
        cell_end = np.repeat(gaps + base_of, count)
        ok = ((end - 0.5 <= cell_end) | (slot == B - 1)) & (end <= cell_end + 0.5)
    else:
        cell_end = (np.cumsum(gaps.reshape(B, M), axis=1) +
                    (np.arange(B) * span)[:, None]).ravel()
        slot = np.minimum(np.searchsorted(cell_end, end - 0.5, side="left"), B * M - 1)
        ok = (end - lengths >= cell_end[slot] - gaps[slot] - 0.5) & \
            (end <= cell_end[slot] + 0.5)
        # A bin's own items past its span would land in the next bin's gaps, on top of that
        # bin's own items there (a row went 9k tokens over C at 128k once windows were 8 steps
        # deep).
        ok &= slot // M == own_home
    _put_many(bins, own_items[ok], slot[ok], gaps, lengths=lengths[ok])
    rest = np.ones(items.size, dtype=bool)
    rest[own[ok]] = False
    return items[rest]


def _runs(bins: _Bins, items: np.ndarray, gaps: np.ndarray) -> np.ndarray:
    """Most of `items` (largest first) into the rows' gaps in one pass, by cumulative tokens:
    rows in order, each a run of consecutive items, so many items per row at once. Returns what
    is left for `_waves` to place one per row: the items that would straddle two rows, and the
    last `WAVE_ITEMS` per open row, the shortest, which fill what the runs leave of each gap.

    The runs fill each gap in proportion to its size, up to the share of the items' tokens the
    runs place, so the short items left are spread like the rest (the water level's allowance,
    `_fill_light`). Light items cost about the same per token, so which row gets which run
    hardly moves its cost; waves of one item per row took ~250 rounds a step at 128k rows.
    Only where every bin is one row (rows under 1F1B, plain causal attention) and at least
    `RUN_ROWS` rows are open: with a rank's rows as one bin the waves' largest-into-largest
    matching balanced better (a 128k CP step of R = 512 went from 0.969 to 0.957 with runs),
    and with fewer rows the waves cost little (at R = 64 the dry runs came out 0.003 lower on
    average with runs, within the seeds' spread, for no CPU worth having)."""
    length = bins.length
    open_cells = np.flatnonzero(gaps >= float(length[items[-1]]) - 0.5) if items.size else items
    keep = WAVE_ITEMS * open_cells.size
    if items.size <= keep or open_cells.size < RUN_ROWS or bins.rows > 1:
        return items
    head, tail = items[:items.size - keep], items[items.size - keep:]
    # Dealt across the rows: the k-th of every `open` items go to one run, so each run holds
    # a like mix of long and short items (longest-first runs made the first rows costlier).
    stride = open_cells.size
    dealt = np.arange(-(-head.size // stride) * stride).reshape(-1, stride).T.ravel()
    head = head[dealt[dealt < head.size]]
    lengths = length[head]
    room = gaps[open_cells]
    share = min(1.0, float(lengths.sum() + length[tail].sum()) / max(float(room.sum()), 1.0))
    budget = room * share * float(lengths.sum()) / float(lengths.sum() + length[tail].sum())
    cell_end = np.cumsum(budget)
    end = np.cumsum(lengths).astype(np.float64)
    slot = np.minimum(np.searchsorted(cell_end, end - 0.5, side="left"), open_cells.size - 1)
    ok = (end - lengths >= cell_end[slot] - budget[slot] - 0.5) & (end <= cell_end[slot] + 0.5)
    _put_many(bins, head[ok], open_cells[slot[ok]], gaps, lengths=lengths[ok])
    return np.concatenate([_longest_first(head[~ok], length), tail])


def _waves(bins: _Bins, items: np.ndarray, gaps: np.ndarray, max_waves: int = 512) -> np.ndarray:
    """Items (largest first) into rows, at most one per row per wave, never past a row's gap.

    In a wave, rows with room go largest gap first, and each takes the largest remaining item
    that fits in it (`fill.largest_that_fits`). Returns what is left. (64 waves left a tenth of
    a light step unplaced at 128k rows, about 100 documents a row, for the top-up to place
    without regard to cost.)

    A wave costs O(rows · log items), not O(items): the items stay where they are, and the
    placed ones are kept as a sorted list of positions (`dead`), so the matching's search runs
    over the original lengths and then counts the placed items away (compacted once a
    quarter of them are placed).
    """
    length = bins.length
    lengths = length[items]                          # descending
    ascending = lengths[::-1].copy()
    alive = np.ones(items.size, dtype=bool)
    dead = np.zeros(0, dtype=np.int64)               # placed positions, sorted
    last = items.size - 1                            # the last position still waiting
    for _ in range(max_waves):
        if dead.size * 4 > items.size:               # compact: the lists stay short
            items, lengths = items[alive], lengths[alive]
            ascending = lengths[::-1].copy()
            alive = np.ones(items.size, dtype=bool)
            dead, last = dead[:0], items.size - 1
        if dead.size == items.size:
            break
        while not alive[last]:
            last -= 1
        cells = np.flatnonzero(gaps >= lengths[last] - 0.5)
        if cells.size == 0:
            break
        cells = cells[np.lexsort((cells, -gaps[cells]))]
        # First fit among all positions, then among the waiting ones (less those placed).
        first = items.size - np.searchsorted(ascending, fit_limits(gaps[cells], lengths),
                                             side="right")
        first -= np.searchsorted(dead, first, side="left")
        pick, ok = monotone_picks(first, items.size - dead.size)
        if not ok.any():
            break
        # The k-th waiting item sits at k + #{i: dead[i] - i <= k}.
        k = pick[ok]
        position = k + np.searchsorted(dead - np.arange(dead.size), k, side="right")
        _put_many(bins, items[position], cells[ok], gaps, one_per_row=True)
        alive[position] = False
        dead = np.insert(dead, np.searchsorted(dead, position), position)
    return items[alive]


def _fill_light(bins: _Bins, items: np.ndarray, *, cap: float | None, home_first: bool,
                forced: np.ndarray | None = None, early: np.ndarray | None = None
                ) -> np.ndarray:
    """Spread many small items in a few vectorized passes (see the module docstring).

    A water level gives every bin an allowance of tokens, split over the bin's rows in
    proportion to their free space (the rows' *gaps*); no row ever takes more than its gap.
    First each bin keeps its own items in its own gaps, then the rest go largest first in
    waves. Forced items (bool per item in `forced`) go before the others, and past the
    allowance where they must; then the `early` ones (each window's first, `_window_fronts`),
    then the rest. Returns the items not placed.
    """
    if items.size == 0:
        return items
    C = bins.capacity
    length = bins.length
    lengths = length[items]
    tokens = float(lengths.sum())
    free = (C - bins.fill).astype(np.float64)
    free[free < lengths.min()] = 0.0
    room = free.sum(axis=1)
    density = max(float(bins.weight[items].sum()) / tokens, _EPS)
    limit = None if cap is None else max(cap, float(bins.load.max()))
    allowance = _level(bins.load, room, density, tokens, limit)
    gaps = (free * (allowance / np.maximum(room, 1.0))[:, None]).ravel()
    items = _longest_first(items, length, lengths)

    left = []
    must = forced[items] if forced is not None else np.zeros(items.size, dtype=bool)
    front = early[items] & ~must if early is not None else np.zeros(items.size, dtype=bool)
    for group, is_forced in ((items[must], True), (items[front], False),
                             (items[~must & ~front], False)):
        if group.size == 0:
            continue
        if home_first:
            group = _keep_home(bins, group, gaps)
        group = _waves(bins, _runs(bins, group, gaps), gaps)
        if is_forced and group.size:
            # Past the allowance: wherever a row has room. Then no gap may exceed real room.
            real = (C - bins.fill).astype(np.float64).ravel()
            group = _waves(bins, group, real)
            np.minimum(gaps, (C - bins.fill).astype(np.float64).ravel(), out=gaps)
        left.append(group)
    bins.maxroom = C - bins.fill.min(axis=1)
    return np.concatenate(left) if left else items[:0]


def _repair(bins: _Bins, missing: np.ndarray, forced: np.ndarray) -> bool:
    """Make room for forced items left out: each takes a row where it fits once non-forced
    items leave (fewest tokens evicted, then least loaded bin). False if one fits nowhere."""
    if missing.size == 0:
        return True
    C, M = bins.capacity, bins.rows
    length = bins.length
    placed_forced = np.flatnonzero(forced & (bins.bin >= 0))
    forced_fill = np.bincount(bins.bin[placed_forced] * M + bins.row[placed_forced],
                              weights=length[placed_forced], minlength=bins.num_bins * M)
    for item in missing[np.lexsort((missing, -length[missing]))].tolist():
        l = int(length[item])
        fill = bins.fill.ravel()
        ok = np.flatnonzero(forced_fill + l <= C)
        if ok.size == 0:
            return False
        evict = np.maximum(fill[ok] + l - C, 0)
        best = ok[np.lexsort((ok, bins.load[ok // M], evict))[0]]
        b, r = divmod(int(best), M)
        if fill[best] + l > C:
            in_row = np.flatnonzero((bins.bin == b) & (bins.row == r) & ~forced)
            in_row = in_row[np.lexsort((in_row, -length[in_row]))]
            freed = np.cumsum(length[in_row])
            n = int(np.searchsorted(freed, fill[best] + l - C, side="left")) + 1
            for other in in_row[:n].tolist():
                bins.remove(other)
        bins.put(item, b, r)
        forced_fill[best] += l
    return True


def _trim(bins: _Bins, droppable: np.ndarray, geometry: Geometry, overhead: float,
          levels: int = 64) -> np.ndarray:
    """Lower the most loaded bins to a common level by leaving light items for the next step,
    when that gains the epoch (`fill.deferral_gain`). Returns the items left out.

    With the step full, bins whose documents came out costlier per token end up above the rest
    with no room to even out. Their light items can wait one step when what the step saves
    beats what the epoch pays for them later. The level is chosen among `levels` candidates,
    to maximize that gain; of levels that gain alike, the highest, so that nothing waits for
    no gain (with ranks as bins and no overhead, every level below all bins' loads gains
    top - mean).
    """
    placed = np.flatnonzero((bins.bin >= 0) & droppable)
    if placed.size == 0:
        return placed
    B = bins.num_bins
    w, length = bins.weight, bins.length
    load = bins.load
    floor = load - np.bincount(bins.bin[placed], weights=w[placed], minlength=B)
    top = float(load.max())
    lowest = float(floor.max())
    if lowest >= top:
        return placed[:0]
    density = float(w[placed].sum()) / float(length[placed].sum())
    level = np.linspace(lowest, top, levels + 1)
    lost_work = np.maximum(load[None, :] - level[:, None], 0.0).sum(axis=1)
    gain = deferral_gain(top - level, lost_work, lost_work / density, geometry, overhead)
    best = int(np.flatnonzero(gain >= gain.max() - 1e-9 * top)[-1])
    if gain[best] <= 1e-9 * top:
        return placed[:0]
    cut = level[best]
    over = placed[load[bins.bin[placed]] > cut]
    # Per bin, lightest items first, until the bin is at the level.
    over = over[np.lexsort((over, w[over], bins.bin[over]))]
    b = bins.bin[over]
    csum = np.cumsum(w[over])
    starts = _group_starts(b)
    before = csum - w[over] - (csum[starts] - w[over][starts])
    out = over[before < load[b] - cut - 1e-9 * top]
    ob, orow = bins.bin[out], bins.row[out]
    M = bins.rows
    bins.fill -= np.bincount(ob * M + orow, weights=length[out],
                             minlength=B * M).astype(np.int64).reshape(B, M)
    bins.load -= np.bincount(ob, weights=w[out], minlength=B)
    bins.tokens -= np.bincount(ob, weights=length[out], minlength=B).astype(np.int64)
    bins.maxroom = bins.capacity - bins.fill.min(axis=1)
    bins.bin[out] = -1
    bins.row[out] = -1
    return out


def _arrival_windows(c: Candidates, selected: np.ndarray):
    """For `_arrival_swaps`: each selected item's window (source · ranks + rank), its position,
    and the order that sorts them by (window, position): None when they already are (the
    candidates' own order, as windows lay them out). `selected` ascending."""
    num_windows = c.num_ranks * c.num_sources
    position = c.position[selected].astype(np.int64)
    if c.dense_positions:   # laid out by (window, position): ascending indices are in order,
        # and each window's items a run of the selection (`_selected_windows`)
        window = np.repeat(np.arange(num_windows), np.diff(_selected_windows(c, selected)))
        return window, position, None, num_windows
    window = c.source[selected].astype(np.int64) * c.num_ranks + c.rank[selected]
    key = window * (int(position.max(initial=0)) + 1) + position
    order = np.argsort(key, kind="stable") if (key[1:] < key[:-1]).any() else None
    return window, position, order, num_windows


def _window_fronts(length: np.ndarray, window: np.ndarray,
                   order: np.ndarray | None, bounds: np.ndarray | None = None) -> np.ndarray:
    """bool per selected item: the first items of each (rank, source) window, as long as they
    hold at most `FRONT_SHARE` of the window's selected tokens (`window`, `order`:
    `_arrival_windows`). The light fill places them before the other light items
    (`_fill_light`). An item an over-full step left out stands at the front of its window at
    the next step; placed largest first with the rest, the shortest were left out again (at
    128k, P = 4, R = 4, a third of the items left out were left out the next step too), and
    every step a later item of their window went ahead counts in their delay.

    `bounds` (order None only): where each window starts in the selection, and the end
    (`_selected_windows`); then the fronts are found per window (`_fronts_within`)."""
    if bounds is not None and order is None:
        return _fronts_within(length, bounds)
    lengths = (length if order is None else length[order]).astype(np.float64)
    w = window if order is None else window[order]
    if lengths.size == 0:
        return np.zeros(0, dtype=bool)
    # Windows are runs of equal `w`: running tokens within each, and each one's total (O(n)).
    starts = np.flatnonzero(np.concatenate([[True], w[1:] != w[:-1]]))
    counts = np.diff(np.append(starts, lengths.size))
    total = np.cumsum(lengths)
    upto = total - np.repeat(total[starts] - lengths[starts], counts)
    front = upto <= FRONT_SHARE * np.repeat(np.add.reduceat(lengths, starts), counts)
    if order is None:
        return front
    out = np.zeros(length.size, dtype=bool)
    out[order] = front
    return out


def _selected_windows(c: Candidates, selected: np.ndarray) -> np.ndarray | None:
    """Where each window (source · num_ranks + rank) starts among `selected` (ascending), and
    the end; None when the candidates are not laid out by window (`window_bounds`)."""
    bounds = c.window_bounds
    return None if bounds is None else np.searchsorted(selected, bounds)


def _fronts_within(length: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """`_window_fronts` for windows that are runs of the selection at `bounds`: the same
    items, found per window by a search over the running tokens (one pass over the items, not
    ten). Token counts are whole numbers, so `upto <= FRONT_SHARE · total` (upto: the tokens
    of a window's items up to and including this one) holds exactly when upto is at most
    the floor of that bound."""
    front = np.zeros(length.size, dtype=bool)
    some = bounds[:-1] < bounds[1:]
    start, end = bounds[:-1][some], bounds[1:][some]
    if start.size == 0:
        return front
    total = np.cumsum(length)
    base = total[start] - length[start]                  # tokens before each window
    allowed = np.floor(FRONT_SHARE * (total[end - 1] - base).astype(np.float64))
    count = np.searchsorted(total, base + allowed.astype(np.int64), side="right") - start
    first = np.cumsum(count) - count
    front[np.repeat(start - first, count) + np.arange(int(count.sum()))] = True
    return front


def _arrival_swaps(bins: _Bins, eligible: np.ndarray, window: np.ndarray,
                   position: np.ndarray, order: np.ndarray | None, num_windows: int) -> int:
    """Leave out the *latest* items of each window, not arbitrary ones: an eligible item left
    out takes the place of a later placed one of its own window (rank, source), the earliest
    left out with the latest placed, and so on. Only where the earlier item has at least
    `SWAP_SHARE` of the later one's tokens, fits its row, and keeps its bin at or below the
    step's most loaded bin: the step time never rises and no row overflows. Returns the number
    of swaps. Vectorized: every pair is checked against its row's room and its bin's headroom
    by running sums that count every pair before it (conservative).
    """
    w, length = bins.weight, bins.length
    # By (window, position) (`_arrival_windows`).
    items = np.flatnonzero(eligible) if order is None else order[eligible[order]]
    if items.size == 0:
        return 0
    placed = bins.bin[items] >= 0
    out, inn = items[~placed], items[placed]
    if out.size == 0 or inn.size == 0:
        return 0
    # The i-th earliest left out of a window against its i-th latest placed.
    count = np.bincount(window[inn], minlength=num_windows)
    end = np.cumsum(count)
    rank_out = np.arange(out.size) - _group_starts(window[out])
    has = rank_out < count[window[out]]
    x = out[has]
    y = inn[end[window[x]] - 1 - rank_out[has]]
    later = position[x] < position[y]
    # At least half the later one's tokens: the refill that follows can close a smaller gap
    # with what is left out, a larger one not (every length: 0.6 points of efficiency lost).
    x, y = x[later], y[later]
    keep = length[x] >= SWAP_SHARE * length[y]
    x, y = x[keep], y[keep]
    if x.size == 0:
        return 0
    M = bins.rows
    b, r = bins.bin[y], bins.row[y]
    cell = b * M + r
    grow = np.maximum(length[x] - length[y], 0)
    heavier = np.maximum(w[x] - w[y], 0.0)
    order = np.argsort(cell, kind="stable")
    start = _group_starts(cell[order])
    used = np.cumsum(grow[order])
    used = used - used[start] + grow[order][start]
    ok = np.zeros(x.size, dtype=bool)
    ok[order] = used <= (bins.capacity - bins.fill.ravel()[cell[order]])
    top = float(bins.load.max())
    order = np.argsort(b, kind="stable")
    start = _group_starts(b[order])
    extra = np.cumsum(heavier[order])
    extra = extra - extra[start] + heavier[order][start]
    ok[order] &= bins.load[b[order]] + extra <= top * (1 + 1e-12)
    x, y, b, r, cell = x[ok], y[ok], b[ok], r[ok], cell[ok]
    if x.size == 0:
        return 0
    B = bins.num_bins
    bins.fill += np.bincount(cell, weights=length[x] - length[y],
                             minlength=B * M).astype(np.int64).reshape(B, M)
    bins.load += np.bincount(b, weights=w[x] - w[y], minlength=B)
    bins.tokens += np.bincount(b, weights=length[x] - length[y], minlength=B).astype(np.int64)
    bins.maxroom = bins.capacity - bins.fill.min(axis=1)
    bins.bin[x], bins.row[x] = b, r
    bins.bin[y] = -1
    bins.row[y] = -1
    return int(x.size)


class _Members:
    """Items of each bin, for the few bins that refinement looks at."""

    def __init__(self, bins: _Bins):
        self.bins = bins
        self.order = np.argsort(bins.bin, kind="stable")
        self.starts = np.searchsorted(bins.bin[self.order], np.arange(-1, bins.num_bins + 1))
        self.arrived: dict[int, list[int]] = {}

    def of(self, b: int) -> np.ndarray:
        first = self.order[self.starts[b + 1]:self.starts[b + 2]]
        extra = self.arrived.get(b)
        if extra:
            first = np.concatenate([first, np.asarray(extra, dtype=np.int64)])
            first = np.unique(first)
        return first[self.bins.bin[first] == b]

    def moved(self, item: int, b: int) -> None:
        self.arrived.setdefault(b, []).append(item)


def _refine(bins: _Bins, max_iters: int, neighbours: int = 16, swap_neighbours: int = 4,
            drop: np.ndarray | None = None, tolerance: float = 1e-4,
            geometry: Geometry | None = None, overhead: float = 0.0) -> None:
    """Moves and swaps off the most loaded bin while they lower the maximum.

    With `drop` (bool per item: may be left out) and the step's `geometry`, when nothing else
    helps, an item of the most loaded bin is left untaken if that gains the epoch
    (`fill.deferral_gain`).
    """
    w, length, C = bins.weight, bins.length, bins.capacity
    B = bins.num_bins
    if B < 2 or max_iters <= 0:
        return
    members = _Members(bins)
    for _ in range(max_iters):
        top = int(np.argmax(bins.load))
        cur = bins.load[top]
        if cur <= bins.load.mean() * (1 + tolerance):
            break
        k = min(neighbours + 1, B)
        low = np.argpartition(bins.load, k - 1)[:k] if k < B else np.arange(B)
        low = low[low != top]
        low = low[np.lexsort((low, bins.load[low]))][:neighbours]
        xs = members.of(top)
        if xs.size == 0:
            break
        best_new, best = cur - max(1e-7 * cur, _EPS), None
        # Moves: x from top to q.
        wx, lx = w[xs], length[xs]
        fits = bins.maxroom[low][None, :] >= lx[:, None]
        new = np.maximum(cur - wx[:, None], bins.load[low][None, :] + wx[:, None])
        new = np.where(fits, new, np.inf)
        if new.size:
            flat = int(np.argmin(new))
            if new.flat[flat] < best_new:
                best_new = new.flat[flat]
                best = ("move", xs[flat // low.size], low[flat % low.size])
        # Swaps: x on top with y on one of the lowest bins.
        ys = np.concatenate([members.of(int(q)) for q in low[:swap_neighbours]])
        if ys.size:
            wy, ly = w[ys], length[ys]
            d = wx[:, None] - wy[None, :]
            dl = lx[:, None] - ly[None, :]
            room_x = C - bins.fill[top, bins.row[xs]]                       # (nx,)
            room_y = C - bins.fill[bins.bin[ys], bins.row[ys]]              # (ny,)
            ok = (d > 0) & (dl <= room_y[None, :]) & (-dl <= room_x[:, None])
            new = np.maximum(cur - d, bins.load[bins.bin[ys]][None, :] + d)
            new = np.where(ok, new, np.inf)
            flat = int(np.argmin(new))
            if new.flat[flat] < best_new:
                best_new = new.flat[flat]
                best = ("swap", xs[flat // ys.size], ys[flat % ys.size])
        if best is None and drop is not None:
            # No move or swap helps: leave out a light item of the top bin when that gains
            # the epoch (the step is as slow as its slowest rank; the item is paid later).
            # Only items small against the bin: a heavy one would be the bottleneck of
            # whichever step takes it, so leaving it out only postpones the cost.
            xd = xs[drop[xs] & (w[xs] <= DROP_SHARE * cur)]
            if xd.size:
                second = float(np.partition(bins.load, B - 2)[B - 2])
                new_max = np.maximum(cur - w[xd], second)
                gain = deferral_gain(cur - new_max, w[xd], length[xd], geometry, overhead)
                pick = int(np.argmax(gain))
                if gain[pick] > 1e-9 * cur:
                    best = ("drop", xd[pick], None)
        if best is None:
            break
        if best[0] == "drop":
            bins.remove(best[1])
        elif best[0] == "move":
            x, q = int(best[1]), int(best[2])
            bins.remove(x)
            room = C - bins.fill[q]
            r = int(np.argmin(np.where(room >= length[x], room, C + 1)))
            bins.put(x, q, r)
            members.moved(x, q)
        else:
            x, y = int(best[1]), int(best[2])
            bx, rx, by, ry = bins.bin[x], bins.row[x], bins.bin[y], bins.row[y]
            bins.remove(x)
            bins.remove(y)
            bins.put(x, by, ry)
            bins.put(y, bx, rx)
            members.moved(x, int(by))
            members.moved(y, int(bx))


def deal_rows(load: np.ndarray, ranks: int, rows: int) -> np.ndarray:
    """Where each of R·M filled rows goes, as rank·M + row: costliest first, dealt in snake
    order (ranks 0..R-1, then R-1..0, ...). Rows that could not come out even (a step with
    fewer full-row documents than rows) are spread one per rank before any rank gets two: under
    1F1B a rank pays its costliest row P - 1 more times, so two heavy rows on one rank cost
    more than one on each, and the snake evens out the ranks' sums too."""
    order = np.argsort(-load, kind="stable")
    position = np.arange(order.size)
    sweep, j = position // ranks, position % ranks
    rank = np.where(sweep % 2 == 0, j, ranks - 1 - j)
    cell = np.empty(order.size, dtype=np.int64)
    cell[order] = rank * rows + sweep
    return cell


def _oldest_that_fit(c: Candidates, selected: np.ndarray, forced: np.ndarray,
                     geometry: Geometry) -> np.ndarray:
    """`forced`, cut to the oldest items that take at most half the step (what first-fit
    decreasing can always place). More overdue items than a step can hold happen when a
    selection overshoots step after step (a W-deep lookahead window of pieces near C at small
    R); placing them longest first then served the same long pieces every time, and a source
    of short documents waited 30 steps and got a fifth of its share. Oldest first, every item
    gets its turn."""
    limit = geometry.step_tokens // 2
    lengths = c.length[selected]
    if int(lengths[forced].sum()) <= limit:
        return forced
    idx = np.flatnonzero(forced)
    idx = idx[np.lexsort((idx, -c.age[selected[idx]]))]   # oldest first, then candidate order
    keep = np.zeros_like(forced)
    first = np.cumsum(lengths[idx]) <= limit
    keep[idx[first]] = True
    # Then the shortest of the rest, while they fit: past the first that did not, a prefix
    # left out items of a few hundred tokens that waited as long (ages of 17 against 16).
    rest = idx[~first]
    rest = rest[np.argsort(lengths[rest], kind="stable")]
    keep[rest[int(lengths[idx[first]].sum()) + np.cumsum(lengths[rest]) <= limit]] = True
    return keep


def assign_balanced(c: Candidates, selected: np.ndarray, geometry: Geometry, cost: CostModel, *,
                    forced: np.ndarray | None = None, refine_iters: int | None = None,
                    light_share: float | None = None, overhead: float = 0.0
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Assign `selected` candidates to (rank, row), minimizing the largest per-rank cost.
    An item is left out only when that gains the epoch, with `overhead` the cost of a step
    (`fill.deferral_gain`).

    `forced` (bool per selected item) marks items that must be taken: the plan holds all of
    them whenever first-fit-decreasing can place them on their own (always while they take at
    most half the step's capacity). Returns (take, rank, row) like `assign_naive`; items left
    out stay in their buffers.
    """
    R, M, C = geometry.ranks, geometry.micro_batches, geometry.capacity
    selected = np.asarray(selected, dtype=np.int64)
    if forced is None:
        forced = np.zeros(selected.size, dtype=bool)
    # Candidate index order, the tie-break everywhere below: as the selections give it (a
    # check over the selection), else an O(n) sort by marking (over every candidate).
    forced = np.array(forced, dtype=bool)
    if selected.size > 1 and not (selected[1:] > selected[:-1]).all():
        mark = np.zeros(len(c), dtype=np.int8)
        mark[selected] = 1
        mark[selected[forced]] = 2
        selected = np.flatnonzero(mark)
        forced = mark[selected] == 2
    if selected.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32)
    forced = _oldest_that_fit(c, selected, forced, geometry)
    length = c.length[selected].astype(np.int64)
    usable = length <= C
    all_usable = bool(usable.all())

    def of_usable(values):   # `values[usable]` (a copy, not needed when all are)
        return values if all_usable else values[usable]

    usable_tokens = float(of_usable(length).sum())
    masking = cost.document_masking
    # With P pipeline stages a rank's step waits on its costliest micro-batch (1F1B), so the
    # rows are the bins: even rows make even ranks, and the bubble small.
    rows_are_bins = masking and geometry.pipelined
    if light_share is None:
        light_share = ROW_LIGHT_SHARE if rows_are_bins else LIGHT_SHARE
    if rows_are_bins:
        weight = item_costs(c, selected, cost)
        usable_weight = float(of_usable(weight).sum())
        target_tokens = min(float(C), usable_tokens / (R * M))
        # An item's home is a row of the rank that holds it (spread by position).
        home = c.rank[selected].astype(np.int64)
        home *= M
        home += _remainder(c.position[selected], M)
        bins = _Bins(R * M, 1, C, weight, length, home, float(cost.b), target_tokens)
        light = usable & ~forced & (weight < light_share * usable_weight / (R * M))
        if light.any():
            bins.light_density = float(weight[light].sum()) / float(length.sum(where=light))
    elif masking:
        weight = item_costs(c, selected, cost)
        usable_weight = float(of_usable(weight).sum())
        # Every token costs at least b: bins short of the average token count will still get
        # that many tokens of light items, at about b each.
        target_tokens = min(float(M * C), usable_tokens / R)
        bins = _Bins(R, M, C, weight, length, c.rank[selected].astype(np.int64),
                     float(cost.b), target_tokens)
        light = usable & ~forced & (weight < light_share * usable_weight / R)
        if light.any():
            bins.light_density = float(weight[light].sum()) / float(length.sum(where=light))
    else:
        # Rows are the bins; evening out row tokens minimizes every rank's sum of row costs.
        weight = length.astype(np.float64) + c.extra_cost[selected] / max(cost.b + cost.a * C, _EPS)
        usable_weight = float(of_usable(weight).sum())
        bins = _Bins(R * M, 1, C, weight, length, np.full(selected.size, -1, np.int64))
    excess = weight - bins.light_density * length
    local = np.arange(selected.size, dtype=np.int64)
    # Leaving an item for the next step only pays when steps are full anyway (then the next
    # step is full too, and the step time is what counts). When the selection fits with room
    # to spare, everything that fits is taken.
    tight = usable_tokens >= TIGHT * M * C * R
    # The level no plan can beat: the fair load, or the heaviest item on its own. (Capping
    # below the heaviest item would leave it waiting for ever.)
    bound = max(usable_weight / bins.num_bins, float(weight.max(initial=0, where=usable)))
    cap = bound if tight else None
    if refine_iters is None:
        refine_iters = min(4 * bins.num_bins, 32) if bins.num_bins <= REFINE_BINS else 0
    extra = c.has_extra_cost and bool(c.extra_cost[selected].any())
    arrival = _arrival_windows(c, selected) if tight and ARRIVAL_SWAPS else None
    # Over-full steps with rows as bins: each window's first items go first in the light fill.
    # (With a rank's rows as one bin it bought no delay in the dry runs: left alone there.)
    early = _window_fronts(length, arrival[0], arrival[2], _selected_windows(c, selected)) \
        if rows_are_bins and arrival is not None and FRONT_SHARE > 0 else None

    def largest_first(items):
        if not extra:   # weight and excess both grow with length: sort integers
            return _longest_first(items, length)
        return items[np.lexsort((items, -weight[items], -excess[items]))]

    def run(forced_first: bool) -> bool:
        rest = of_usable(local)
        if forced_first:
            # Longest first, so first-fit-decreasing guarantees they fit while they take at
            # most half the step's capacity.
            f = local[forced & usable]
            _lpt(bins, f[np.lexsort((f, -weight[f], -length[f]))], cap=None)
            rest = local[~forced & usable]
        light = (weight if rest is local else weight[rest]) < \
            light_share * usable_weight / bins.num_bins
        # Going home may cost balance only where light items will even it out afterwards.
        _lpt(bins, largest_first(rest[~light]), cap=cap, home_first=masking, forced=forced,
             home_slack=HOME_SLACK if tight else 0.0)
        left = _fill_light(bins, rest[light], cap=cap, home_first=masking, forced=forced,
                           early=early)
        left = _fill_light(bins, left, cap=0.0 if tight else None, home_first=masking,
                           forced=forced, early=early)
        if not tight and left.size:
            # Room to spare: whatever still fits somewhere goes there.
            _waves(bins, _longest_first(left, length),
                   (C - bins.fill).astype(np.float64).ravel())
            bins.maxroom = C - bins.fill.min(axis=1)
        if not _repair(bins, local[forced & usable & (bins.bin < 0)], forced):
            return False
        _refine(bins, refine_iters, drop=~forced if masking and tight else None,
                geometry=geometry, overhead=overhead)
        if masking and tight and bins.num_bins <= REFINE_BINS:
            out = _trim(bins, ~forced & (weight <= DROP_SHARE * float(bins.load.max())),
                        geometry, overhead)
            if out.size:
                # What was left out may still fit below the new maximum elsewhere.
                _fill_light(bins, out, cap=0.0, home_first=True)
        if arrival is not None:
            # Items left out wait a step: let them be each window's latest (among items small
            # against a bin, those trim may leave out).
            movable = ~forced & usable & (weight <= DROP_SHARE * float(bins.load.max()))
            if _arrival_swaps(bins, movable, *arrival):
                _fill_light(bins, local[movable & (bins.bin < 0)], cap=0.0, home_first=masking)
                _arrival_swaps(bins, movable, *arrival)
        return True

    # Forced items (usually the oldest, light ones) ride along with the rest; a forced item
    # left out displaces others. Should that fail, plan again with the forced ones first.
    if not run(forced_first=False):
        bins.reset()
        run(forced_first=True)

    placed = local[bins.bin >= 0]
    # Each item's (rank, row) as rank · M + row, and the plan in that order.
    if masking and not rows_are_bins:
        cell = bins.bin[placed] * M + bins.row[placed]
    elif rows_are_bins:
        cell = deal_rows(bins.load, R, M)[bins.bin[placed]]
    else:
        cell = bins.bin[placed]
    out = _sorted_by((cell, R * M))
    cell = cell[out]
    # (rank, row) from the cells, in int32 where they fit: a fifth of int64 divisions' time
    if R * M < 2 ** 31:
        rank, row = np.divmod(cell.astype(np.int32), np.int32(M))
    else:
        rank, row = (cell // M).astype(np.int32), (cell % M).astype(np.int32)
    return selected[placed[out]], rank, row
