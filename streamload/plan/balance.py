"""Cost-balanced assignment of a step's selected samples to (rank, row).

Pure NumPy. The objective is the step time: the largest per-rank cost under the cost model,
subject to every row holding at most C tokens and every rank having exactly M rows.

The work happens on *bins*. With document masking a bin is a rank with M rows and item costs
add up, so bins are ranks. With plain causal attention a row's cost is a convex function of its
token count, so the best plan evens out row fills, and every row is a bin of its own whose
weight is its token count.

Phases, in order (each one vectorized over bins; Python loops run per round, not per item):

1. **Forced** items (waited `max_age` steps or more) go first, longest first, so they always fit
   while they take at most half the step's capacity (first-fit-decreasing cannot fail then).
2. **Keep at home.** Every rank keeps its own largest items up to `keep_fraction` of the fair
   share. This costs nothing in balance because phase 3 evens out what is left, and it keeps most
   bytes off the network.
3. **LPT.** The rest go, heaviest first, to the least loaded bin with room, in rounds: a round
   hands one item to each bin whose load is below (least load + next item's weight), which is
   what one-at-a-time LPT would do for those items.
4. **Refinement.** Moves and swaps between the most loaded bin and the least loaded ones while
   they lower the maximum.
5. **Home swap.** Items with the same length and cost are interchangeable; they are permuted
   among their slots so as many as possible land on the rank that holds them. Free in balance.

Items that fit nowhere without raising the step's maximum stay untaken; the coordinator offers
them again next step with age + 1, and `max_age` bounds how often that can happen.
"""
from __future__ import annotations

import numpy as np

from .cost import CostModel
from .types import Assignment, Candidates, Geometry

KEEP_FRACTION = 0.85     # share of the fair load each rank keeps from its own buffer
_EPS = 1e-9


def item_costs(c: Candidates, idx: np.ndarray, cost: CostModel) -> np.ndarray:
    """Cost of each candidate in `idx` on its own (document-masking cost + the source's hook)."""
    return cost.doc_cost(c.length[idx]) + c.extra_cost[idx]


def exchanged_fraction(c: Candidates, assignment: Assignment) -> float:
    """Fraction of the taken tokens that leave the rank holding them (0 when nothing is taken)."""
    if len(assignment) == 0:
        return 0.0
    lengths = c.length[assignment.take]
    moved = lengths[c.rank[assignment.take] != assignment.rank].sum()
    return float(moved) / float(lengths.sum())


def exchanged_tokens(c: Candidates, assignment: Assignment) -> int:
    """Tokens that the exchange step has to send to another rank."""
    moved = c.rank[assignment.take] != assignment.rank
    return int(c.length[assignment.take][moved].sum())


class _Bins:
    """Fill state of `num_bins` bins with `rows` rows of `capacity` tokens each."""

    def __init__(self, num_bins: int, rows: int, capacity: int, weight, length, home_bin):
        self.num_bins, self.rows, self.capacity = num_bins, rows, capacity
        self.fill = np.zeros((num_bins, rows), dtype=np.int64)
        self.load = np.zeros(num_bins, dtype=np.float64)
        self.maxroom = np.full(num_bins, capacity, dtype=np.int64)
        self.weight = weight            # per item (local index)
        self.length = length
        self.home_bin = home_bin        # -1 where an item has no home bin
        n = weight.shape[0]
        self.bin = np.full(n, -1, dtype=np.int64)
        self.row = np.full(n, -1, dtype=np.int64)

    def place(self, items: np.ndarray, bins: np.ndarray) -> np.ndarray:
        """Best-fit each item into a row of its bin (bins pairwise distinct). Returns success."""
        if items.size == 0:
            return np.zeros(0, dtype=bool)
        lengths = self.length[items]
        room = self.capacity - self.fill[bins]                       # (k, rows)
        fits = room >= lengths[:, None]
        score = np.where(fits, room, self.capacity + 1)
        row = score.argmin(axis=1)                                   # tightest row; ties: lowest
        ok = fits[np.arange(items.size), row]
        b, r, it = bins[ok], row[ok], items[ok]
        self.fill[b, r] += lengths[ok]
        self.load[b] += self.weight[it]
        self.maxroom[b] = self.capacity - self.fill[b].min(axis=1)
        self.bin[it] = b
        self.row[it] = r
        return ok

    def place_one(self, item: int, cap: float | None) -> bool:
        """Put one item on the least loaded bin with room; refuse if that would exceed `cap`."""
        length = self.length[item]
        fits = np.flatnonzero(self.maxroom >= length)
        if fits.size == 0:
            return False
        best = fits[np.argmin(self.load[fits])]                      # ties: lowest bin
        if cap is not None and self.load[best] + self.weight[item] > cap + _EPS:
            return False
        return bool(self.place(np.array([item]), np.array([best]))[0])

    def remove(self, item: int) -> None:
        b, r = self.bin[item], self.row[item]
        self.fill[b, r] -= self.length[item]
        self.load[b] -= self.weight[item]
        self.maxroom[b] = self.capacity - self.fill[b].min()
        self.bin[item] = -1
        self.row[item] = -1

    def put(self, item: int, b: int, r: int) -> None:
        self.fill[b, r] += self.length[item]
        self.load[b] += self.weight[item]
        self.maxroom[b] = self.capacity - self.fill[b].min()
        self.bin[item] = b
        self.row[item] = r


def _lpt(bins: _Bins, queue: np.ndarray, *, capped: bool, tries: int = 1) -> None:
    """Place `queue` (sorted heaviest first) by batched LPT; see the module docstring.

    An item that misses its bin (no row with room) falls back to the least loaded bin with room.
    With `capped`, that fallback may not raise the current maximum load (the item stays untaken).
    """
    n = queue.size
    if n == 0:
        return
    w, length = bins.weight, bins.length
    # Smallest length still queued (suffix minimum): bins with less room are useless.
    suffix_min = np.minimum.accumulate(length[queue][::-1])[::-1]
    misses = {}
    pending = np.zeros(0, dtype=np.int64)
    ptr = 0
    while ptr < n or pending.size:
        smallest = suffix_min[ptr] if ptr < n else np.iinfo(np.int64).max
        if pending.size:
            smallest = min(smallest, int(length[pending].min()))
        open_bins = np.flatnonzero(bins.maxroom >= smallest)
        if open_bins.size == 0:
            break
        head = pending[0] if pending.size else queue[ptr]
        loads = bins.load[open_bins]
        eligible = open_bins[loads < loads.min() + max(w[head], _EPS)]
        eligible = eligible[np.lexsort((eligible, bins.load[eligible]))]
        take_queue = max(0, min(eligible.size - pending.size, n - ptr))
        chunk = np.concatenate([pending[:eligible.size], queue[ptr:ptr + take_queue]])
        pending = pending[eligible.size:]
        ptr += take_queue
        ok = bins.place(chunk, eligible[:chunk.size])
        failed = chunk[~ok]
        retry = []
        for item in failed.tolist():
            misses[item] = misses.get(item, 0) + 1
            if misses[item] < tries:
                retry.append(item)
            else:
                bins.place_one(item, float(bins.load.max()) if capped else None)
        if retry:
            pending = np.concatenate([np.asarray(retry, dtype=np.int64), pending])


def _keep_home(bins: _Bins, items: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """Each home bin keeps its heaviest items while their cost stays within `budget[bin]`.

    Returns the items not kept. Rounds go by position: round j places the j-th item of every bin.
    """
    home = bins.home_bin[items]
    w = bins.weight[items]
    order = np.lexsort((items, -w, home))
    items, home, w = items[order], home[order], w[order]
    starts = np.searchsorted(home, home, side="left")
    csum = np.cumsum(w)
    before = csum - w - (csum[starts] - w[starts])          # cost of earlier items of the same bin
    keep = before + w <= budget[home] + _EPS
    # A bin whose heaviest item alone exceeds the budget still keeps it: it is the bottleneck
    # wherever it goes, and moving it costs bytes.
    keep |= (np.arange(items.size) == starts) & (budget[home] > 0)
    # `before + w` grows along a bin's items, so what each bin keeps is a prefix.
    kept, kept_home = items[keep], home[keep]
    position = np.arange(kept.size) - np.searchsorted(kept_home, kept_home, side="left")
    rest = [items[~keep]]
    by_pos = np.argsort(position, kind="stable")
    bounds = np.searchsorted(position[by_pos], np.arange(position.max() + 2 if kept.size else 1))
    for j in range(bounds.size - 1):
        sel = by_pos[bounds[j]:bounds[j + 1]]
        ok = bins.place(kept[sel], kept_home[sel])
        rest.append(kept[sel][~ok])
    return np.concatenate(rest)


def _refine(bins: _Bins, max_iters: int, neighbours: int = 16,
            drop: np.ndarray | None = None) -> None:
    """Moves and swaps off the most loaded bin while they lower the maximum.

    With `drop` (bool per item: may be left out), when nothing else helps, an item of the most
    loaded bin is left untaken if that raises tokens per unit of step time.
    """
    w, length, C = bins.weight, bins.length, bins.capacity
    B = bins.num_bins
    if B < 2:
        return
    for _ in range(max_iters):
        top = int(np.argmax(bins.load))
        cur = bins.load[top]
        others = np.flatnonzero(np.arange(B) != top)
        k = min(neighbours, others.size)
        low = others[np.argpartition(bins.load[others], k - 1)[:k]] if k < others.size else others
        low = low[np.lexsort((low, bins.load[low]))]
        xs = np.flatnonzero(bins.bin == top)
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
        # Swaps: x on top with y on one of the low bins.
        in_low = np.isin(bins.bin, low)
        ys = np.flatnonzero(in_low)
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
            # No move or swap helps: leave out a light item of the top bin when that raises
            # tokens per unit of step time (the step is as slow as its slowest rank).
            xd = xs[drop[xs]]
            if xd.size:
                second = float(np.max(bins.load[others]))
                total = float(length[bins.bin >= 0].sum())
                new_max = np.maximum(cur - w[xd], second)
                efficiency = (total - length[xd]) / np.maximum(new_max, _EPS)
                pick = int(np.argmax(efficiency))
                if efficiency[pick] > total / cur * (1 + 1e-9):
                    best = ("drop", xd[pick], None)
        if best is None:
            break
        if best[0] == "drop":
            bins.remove(best[1])
        elif best[0] == "move":
            x, q = best[1], best[2]
            bins.remove(x)
            room = C - bins.fill[q]
            fits_row = room >= length[x]
            r = int(np.argmin(np.where(fits_row, room, C + 1)))
            bins.put(x, q, r)
        else:
            x, y = best[1], best[2]
            bx, rx, by, ry = bins.bin[x], bins.row[x], bins.bin[y], bins.row[y]
            bins.remove(x)
            bins.remove(y)
            bins.put(x, by, ry)
            bins.put(y, bx, rx)


def _home_swap(length, extra, item_rank, home, slot_key) -> np.ndarray:
    """Permute interchangeable items (same length and extra cost) among their slots so that as
    many as possible sit on their home rank. Returns, for every item, the index of the item
    whose slot it takes over (a permutation within each group)."""
    n = length.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    # Group id per item: identical (length, extra) pairs.
    gorder = np.lexsort((extra, length))
    same = np.concatenate([[False], (np.diff(length[gorder]) == 0) & (np.diff(extra[gorder]) == 0)])
    group = np.empty(n, dtype=np.int64)
    group[gorder] = np.cumsum(~same)
    R = int(max(item_rank.max(), home.max())) + 1
    item_key = group * R + home            # (group, wanted rank)
    slot_key_r = group * R + item_rank     # (group, rank of the slot)
    items_sorted = np.lexsort((np.arange(n), item_key))
    slots_sorted = np.lexsort((slot_key, slot_key_r))
    ik, sk = item_key[items_sorted], slot_key_r[slots_sorted]
    i_first = np.searchsorted(ik, ik, side="left")
    s_first = np.searchsorted(sk, sk, side="left")
    i_pos = np.arange(n) - i_first                     # position within (group, home)
    s_pos = np.arange(n) - s_first
    s_lo = np.searchsorted(sk, ik, side="left")
    s_hi = np.searchsorted(sk, ik, side="right")
    i_matched = i_pos < (s_hi - s_lo)
    i_lo = np.searchsorted(ik, sk, side="left")
    i_hi = np.searchsorted(ik, sk, side="right")
    s_matched = s_pos < (i_hi - i_lo)
    target = np.empty(n, dtype=np.int64)               # target[item] = slot (as an item index)
    target[items_sorted[i_matched]] = slots_sorted[s_lo[i_matched] + i_pos[i_matched]]
    # The rest pair up in order within each group (equal counts per group by construction).
    rest_items = items_sorted[~i_matched]
    rest_slots = slots_sorted[~s_matched]
    rest_items = rest_items[np.argsort(group[rest_items], kind="stable")]
    rest_slots = rest_slots[np.argsort(group[rest_slots], kind="stable")]
    target[rest_items] = rest_slots
    return target


def assign_balanced(c: Candidates, selected: np.ndarray, geometry: Geometry, cost: CostModel, *,
                    forced: np.ndarray | None = None, keep_fraction: float = KEEP_FRACTION,
                    refine_iters: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Assign `selected` candidates to (rank, row), minimizing the largest per-rank cost.

    `forced` (bool per selected item) marks items that must be taken; they are placed first.
    Returns (take, rank, row) like `assign_naive`; items left out stay in their buffers.
    """
    R, M, C = geometry.ranks, geometry.micro_batches, geometry.capacity
    selected = np.asarray(selected, dtype=np.int64)
    if forced is None:
        forced = np.zeros(selected.size, dtype=bool)
    order = np.argsort(selected, kind="stable")          # candidate index order: the tie-break
    selected, forced = selected[order], np.asarray(forced, dtype=bool)[order]
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32))
    if selected.size == 0:
        return empty
    length = c.length[selected].astype(np.int64)
    home = c.rank[selected].astype(np.int64)
    fits_at_all = length <= C
    if cost.document_masking:
        weight = item_costs(c, selected, cost)
        bins = _Bins(R, M, C, weight, length, home)
    else:
        # Rows are the bins; evening out row tokens minimizes every rank's sum of row costs.
        weight = length.astype(np.float64) + c.extra_cost[selected] / max(cost.b + cost.a * C, _EPS)
        bins = _Bins(R * M, 1, C, weight, length, np.full(selected.size, -1, np.int64))
        keep_fraction = 0.0
    local = np.arange(selected.size, dtype=np.int64)

    # 1. Forced items: longest first, so first-fit-decreasing guarantees they fit.
    f = local[forced & fits_at_all]
    _lpt(bins, f[np.lexsort((f, -weight[f], -length[f]))], capped=False)

    free = local[~forced & fits_at_all]
    # 2. Keep at home, up to a share of the fair load.
    if keep_fraction > 0 and free.size:
        fair = float(weight[fits_at_all].sum()) / bins.num_bins
        budget = np.maximum(keep_fraction * fair - bins.load, 0.0)
        free = _keep_home(bins, free, budget)
    # 3. LPT for the rest, heaviest first.
    free = free[np.lexsort((free, -weight[free]))]
    _lpt(bins, free, capped=True)
    # 4. Refinement on the most loaded bins.
    if refine_iters is None:
        refine_iters = 4 * bins.num_bins if bins.num_bins <= 64 else 64
    _refine(bins, refine_iters, drop=~forced if cost.document_masking else None)

    placed = local[bins.bin >= 0]
    if cost.document_masking:
        rank, row = bins.bin[placed], bins.row[placed]
    else:
        rank, row = bins.bin[placed] // M, bins.bin[placed] % M
    # 5. Interchangeable items back home where possible.
    if cost.document_masking and placed.size:
        target = _home_swap(length[placed], c.extra_cost[selected[placed]], rank, home[placed],
                            rank * M + row)
        rank, row = rank[target], row[target]
    take = selected[placed]
    out = np.lexsort((take, row, rank))
    return take[out], rank[out].astype(np.int32), row[out].astype(np.int32)
