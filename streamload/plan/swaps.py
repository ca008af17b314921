"""Swaps between ranks after a step is planned: the most loaded rank trades an item with any
other rank while that lowers the step's time (issue 23's image path).

Why a pass of its own: with image samples a step's rows are full (the full-steps guarantee) and
hold a few large items each (at M = 1 and C = 16k, four or five samples of up to 8 images), so a
rank's tokens are fixed and its cost is set by its items' cost *per token*: an encoder-heavy
sample (many patches, little text) and a text-heavy one of the same length differ by half or
more per token (ViT-600M-like over 7B-like: the encoder adds 0.53 of the backbone's cost per
token to a 1,024-token photo, 0.82 to a 2,560-token page). The balancer's own refinement
(`balance._refine`) looks at the four least loaded ranks for swaps, where rows are full and an
item must trade for one of about its length; the partner that evens the top rank is usually
elsewhere. This pass looks at every rank, or at the least loaded ones: `PARTNER_RANKS` at most,
fewer where ranks hold many items (about `PARTNER_ITEMS` items to trade with, from at least
`MIN_PARTNERS` ranks).

Each round takes the most loaded rank and, over its items x and every other taken item y (on
rank q among the partners), the swaps that bring max(load[top] - d, load[q] + d) (d = w_x - w_y)
below load[top], and the moves of x into a row of such a rank with room that do; both rows stay
within C tokens and within the caps per row (`caps.RowCaps`). Of those within `HOME_SLACK` (of
the mean rank load) of the lowest, it takes the one that leaves the most tokens on the rank
holding them (the exchange moves an image item with its pixels), then the lowest. It stops when
no swap lowers the top rank, when the top rank is within `TOLERANCE` of the mean, or after
`max_rounds`.

What it keeps: the plan's items (and the tokens taken of each) are the same, only their
(rank, row) change, so the selection, the quotas, exactly-once and the deferral bound are the
planner's; every row within C and the caps (a row over a cap before the pass, which
`caps.enforce` rules out, is never made worse); the step's time never rises (every swap
lowers the top rank below where it was, and the other rank of the swap to below that too).
Deterministic: ties go to the lowest index. Pure NumPy, O(rounds x items on the top rank x
items).

It runs where ranks are the bins: document masking without a pipeline (with 1F1B or plain
causal attention a rank's time is not the sum of its items' costs).

Text steps (no images or patches; `_shed`, swap9) trade differently, for speed and for what a
long-context layer step needs. In such a step (C = 128k, M = 2, R = 512: 40k-100k items) the
slowest ranks hold a 128k piece in one row and a 55k-75k document with short items in the
other; 100-130 ranks sit more than 1% above the mean, the least loaded ranks' rows are full and
the room is on ranks of middling load. One rank a round (the loop above, cp7's moves) lowered
64 of them at ~30 ms a step, and a move only sheds short items into what room there is. So:
- *many ranks a round*: the most loaded ranks (about R / `PARTNERS`, at most `SOURCES`, those
  more than `TOLERANCE` above the mean) each get their own partners, the other ranks dealt out
  least loaded first (the j-th to source j mod k), so every source's trade is made in the same
  round without two touching one rank; the candidates are built for all sources at once;
- *a move* of one of the source's items into a partner's row with room: per row, the longest
  item that fits and is at most half their gap long, and the next longer one;
- *a swap with a refill*: a long item x of the source (over C x `LONG` tokens) for a shorter
  long item y of a partner; where x does not fit in y's row, that row's short items (at most
  C x `SHORT` tokens, never x) go back into x's old row, longest first, until it does. With full rows this moves x's attention term
  over y's (its cost beyond its tokens) to the partner at no change in either rank's tokens:
  what evens a rank holding a piece and a 70k document when no rank has room for a move. A swap
  is weighed exactly (rows within C, the source lower, the partner below where the source was)
  and undone otherwise.
Each source makes its best swap and then its best move that still lowers it. It stops when the
top rank is within TOLERANCE of the mean, when a round makes no trade, when the top rank came
down by less than `GAIN` (of the mean) in `STALL` rounds, or after `TEXT_ROUNDS`. What it keeps
is the same as above (the items, rows within C, a step never slower). It does not weigh where
items are held (`HOME_SLACK`): at 128k CP=4 the share of tokens sent away from the rank holding
them rose by 1-1.5 points (0.597 -> 0.609 at R = 512) in the dry run. Deterministic: candidates
in a fixed order, ties to the first. 128k CP=4 dry runs, seeds 0-2: R = 512 0.968 -> 0.976,
R = 64 0.972 -> 0.976; the Loader at R = 4 0.963 -> 0.971; the pass ~32 -> ~11 ms a step at
R = 512 (docs/benchmarks.md, swap9).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .caps import RowCaps, item_visual
from .cost import CostModel
from .types import Candidates, Geometry

ROUNDS_PER_RANK = 1   # rounds at most: this many per rank (each lowers the top rank once)
MAX_ROUNDS = 64      # and at most this many (R = 256: 74 -> 34 ms a step, efficiency -0.007)
PARTNER_RANKS = 64    # the top rank trades with at most this many ranks, the least loaded
                      # (all of them up to R = 65): a round's cost stays bounded in R
PARTNER_ITEMS = 512   # ... and fewer where ranks hold many items: about this many items in
                      # all (M = 4 at R = 64: 18 ranks; 44 -> 27 ms a step, the same plans' cost)
MIN_PARTNERS = 16
TEXT_SHED = True      # text steps: `_shed` (False: the loop above, moves only as in cp7)
SWAP_TEXT = False     # ... with TEXT_SHED off, text steps only move (swaps there cost 20x the
                      # plan at R = 64, C = 128k for no gain over the moves, cp7)
TOLERANCE = 1e-3      # done when the top rank is within this share of the mean
HOME_SLACK = 2e-3     # options this close (share of the mean) to the lowest count as equal,
                      # and the one that keeps the most tokens home is taken
TEXT_ROUNDS = 64      # text steps (`_shed`): rounds at most, each trading for many ranks at once
PARTNERS = 16         # ... for about R / this many of the most loaded ranks (each with its own
SOURCES = 32          # partners), at most this many
MOVES = 4             # ... each making up to this many moves a round (into distinct rows)
STALL, GAIN = 2, 1e-4  # ... until the top rank comes down by less than GAIN (of the mean)
                       # in STALL rounds
LONG = 1 / 32         # ... items of more than this share of C swap (4k of 128k)
SHORT = 1 / 16        # ... items of at most this share of C refill a row after a swap (8k
                      # of 128k: at most 17% over their tokens in attention at a = 1/49152;
                      # 1/32 and 1/8 gave less in the Loader at R = 4: swap9)


def applies(geometry: Geometry, cost: CostModel) -> bool:
    """Where the pass runs: ranks as the bins (document masking, no pipeline), R > 1, on image
    and text steps alike (`refine_swaps`: the round loop on image steps, `_shed` on text)."""
    return geometry.ranks > 1 and cost.document_masking and not geometry.pipelined


def refine_swaps(c: Candidates, take: np.ndarray, rank: np.ndarray, row: np.ndarray,
                 length: np.ndarray, geometry: Geometry, cost: CostModel,
                 caps: RowCaps = RowCaps(), max_rounds: Optional[int] = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(rank, row) for the same `take` and `length` with the most loaded rank lowered by swaps
    and moves (see the module)."""
    take = np.asarray(take, np.int64)
    n = take.size
    R, M, C = geometry.ranks, geometry.micro_batches, geometry.capacity
    rank = np.asarray(rank, np.int64).copy()
    row = np.asarray(row, np.int64)
    if n < 2 or R < 2:
        return rank.astype(np.int32), row.astype(np.int32)
    length = np.asarray(length, np.int64)
    weight = cost.doc_cost(length).astype(np.float64) + c.extra_cost[take]
    slot = rank * M + row
    if TEXT_SHED and c.images is None and c.patches is None:
        # text: many ranks a round, moves and swaps with a refill (`_shed`)
        _shed(weight, length, rank, slot, R, M, C,
              TEXT_ROUNDS if max_rounds is None else max_rounds)
        return rank.astype(np.int32), (slot % M).astype(np.int32)
    limit = caps.limits()
    capped = caps.active and (c.images is not None or c.patches is not None)
    visual = item_visual(c)[take].astype(np.float64) if capped else np.zeros((n, 2))
    home = c.rank[take].astype(np.int64)   # the rank holding each item
    load = np.bincount(rank, weight, minlength=R)
    fill = np.bincount(slot, length, minlength=R * M).astype(np.int64)
    vis = np.stack([np.bincount(slot, visual[:, k], minlength=R * M) for k in range(2)], 1)
    # A row already over a cap (not after `caps.enforce`) may not get worse: its limit is
    # what it holds.
    vis_limit = np.maximum(limit[None, :], vis)
    rounds = min(ROUNDS_PER_RANK * R, MAX_ROUNDS) if max_rounds is None else max_rounds
    trade = SWAP_TEXT or c.images is not None
    # about PARTNER_ITEMS items to trade with (a round's cost), from at least MIN_PARTNERS ranks
    partners = min(PARTNER_RANKS, max(MIN_PARTNERS, PARTNER_ITEMS * R // n))
    for _ in range(rounds):
        top = int(np.argmax(load))
        cur = float(load[top])
        if cur <= float(load.mean()) * (1 + TOLERANCE):
            break
        xs = np.flatnonzero(rank == top)
        # the partners: every other rank, or the `partners` least loaded of them
        partner = np.ones(R, bool) if R <= partners + 1 else \
            np.isin(np.arange(R), np.argpartition(load, partners - 1)[:partners])
        partner[top] = False
        ys = np.flatnonzero(partner[rank])
        if xs.size == 0 or (ys.size == 0 and trade):
            break
        bar = cur - max(1e-9 * cur, 1e-12)
        # Swaps: x (top) for y (any other rank); text steps move only (`SWAP_TEXT`).
        if not trade:
            ys = ys[:0]
        d = weight[xs][:, None] - weight[ys][None, :]
        dl = length[xs][:, None] - length[ys][None, :]
        sx, sy = slot[xs], slot[ys]
        ok = (d > 0) & (fill[sx][:, None] - dl <= C) & (fill[sy][None, :] + dl <= C)
        if capped:
            dv = visual[xs][:, None, :] - visual[ys][None, :, :]
            ok &= (vis[sx][:, None, :] - dv <= vis_limit[sx][:, None, :]).all(axis=2)
            ok &= (vis[sy][None, :, :] + dv <= vis_limit[sy][None, :, :]).all(axis=2)
        swap_value = np.where(ok, np.maximum(cur - d, load[rank[ys]][None, :] + d), np.inf)
        # Moves: x into a row of any other rank with room for one of the top rank's items
        # (the least loaded ranks are often full: their rows took what the top rank sheds).
        other = np.flatnonzero((fill + length[xs].min() <= C) & (np.arange(R * M) // M != top))
        fits = fill[other][None, :] + length[xs][:, None] <= C
        if capped:
            fits &= (vis[other][None, :, :] + visual[xs][:, None, :] <=
                     vis_limit[other][None, :, :]).all(axis=2)
        move_value = np.where(fits, np.maximum(cur - weight[xs][:, None],
                                               load[other // M][None, :] + weight[xs][:, None]),
                              np.inf)
        lowest = min(float(swap_value.min(initial=np.inf)), float(move_value.min(initial=np.inf)))
        if not lowest < bar:
            break
        # Of the options within HOME_SLACK of the lowest, the one that sends the fewest tokens
        # away from the ranks holding them (the exchange's traffic: an image item moves with
        # its pixels), then the lowest; ties to the first.
        near = min(lowest + HOME_SLACK * float(load.mean()), bar)
        values = np.concatenate([swap_value.ravel(), move_value.ravel()])
        close = np.flatnonzero((values <= near) & (values < bar))
        # tokens away from home after the option less before (x: the top rank's item; a swap
        # sends x to y's rank and y to the top rank, a move sends x to the row's rank)
        n_swaps = swap_value.size
        sw, mv = close[close < n_swaps], close[close >= n_swaps] - n_swaps
        xi = np.concatenate([xs[sw // max(ys.size, 1)], xs[mv // max(other.size, 1)]])
        yi = ys[sw % max(ys.size, 1)]
        dest = np.concatenate([rank[yi], other[mv % max(other.size, 1)] // M])
        away = length[xi] * ((home[xi] != dest).astype(np.int64) - (home[xi] != top))
        away[:sw.size] += length[yi] * ((home[yi] != top).astype(np.int64) - (home[yi] != rank[yi]))
        pick = int(close[np.lexsort((close, values[close], away))[0]])
        if pick < swap_value.size:
            best = ("swap", int(xs[pick // ys.size]), int(ys[pick % ys.size]))
        else:
            pick -= swap_value.size
            best = ("move", int(xs[pick // other.size]), int(other[pick % other.size]))
        if best[0] == "swap":
            x, y = best[1], best[2]
            a, b = int(slot[x]), int(slot[y])
            _shift(x, a, b, weight, length, visual, load, fill, vis, M)
            _shift(y, b, a, weight, length, visual, load, fill, vis, M)
            slot[x], slot[y] = b, a
            rank[x], rank[y] = b // M, a // M
        else:
            x, b = best[1], best[2]
            _shift(x, int(slot[x]), b, weight, length, visual, load, fill, vis, M)
            slot[x] = b
            rank[x] = b // M
    return rank.astype(np.int32), (slot % M).astype(np.int32)


def _shift(i: int, a: int, b: int, weight, length, visual, load, fill, vis, M: int) -> None:
    """Item i's cost, tokens and images/patches from slot a to slot b."""
    load[a // M] -= weight[i]
    load[b // M] += weight[i]
    fill[a] -= length[i]
    fill[b] += length[i]
    vis[a] -= visual[i]
    vis[b] += visual[i]


def _shed(weight: np.ndarray, length: np.ndarray, rank: np.ndarray, slot: np.ndarray,
          R: int, M: int, C: int, max_rounds: int) -> None:
    """Text steps: the ranks above the mean shed cost, many a round (the module's text part);
    `rank` and `slot` change in place."""
    bins = _TextSlots(weight, length, rank, slot, R, M, C)
    load = bins.load
    mean = float(load.mean())
    tops = [float(load.max())] * STALL
    for _ in range(max_rounds):
        order = np.argsort(-load, kind="stable")
        k = max(1, min(SOURCES, R // PARTNERS))
        sources = order[:k][load[order[:k]] > mean * (1 + TOLERANCE)]
        if sources.size == 0:
            break
        # the other ranks dealt out, least loaded first: owner[q] = the index of q's source
        owner = np.full(R, -1)
        others = order[sources.size:][::-1]
        owner[others] = np.arange(others.size) % sources.size
        if not bins.trade_round(sources, owner):
            break
        # done when the top rank came down by less than GAIN (of the mean) in STALL rounds
        tops.append(float(load.max()))
        if tops[-1 - STALL] - tops[-1] < GAIN * mean:
            break


class _TextSlots:
    """A text step's (rank, row) slots as `_shed` trades them: every item's slot and rank
    (the caller's arrays, changed in place), each rank's load, each slot's tokens and its short
    items' tokens (what a refill can send back)."""

    def __init__(self, weight, length, rank, slot, R: int, M: int, C: int):
        self.weight, self.length, self.rank, self.slot = weight, length, rank, slot
        self.M, self.C = M, C
        self.short = length <= int(C * SHORT)
        self.longs = np.flatnonzero(length > int(C * LONG))
        self.load = np.bincount(rank, weight, minlength=R)
        self.fill = np.bincount(slot, length, minlength=R * M).astype(np.int64)
        self.short_fill = np.bincount(slot[self.short], length[self.short],
                                      minlength=R * M).astype(np.int64)

    def trade_round(self, sources: np.ndarray, owner: np.ndarray) -> int:
        """Every source's best swap and move with its own partners; how many it made."""
        weight, length, rank, slot = self.weight, self.length, self.rank, self.slot
        load, fill, M, C = self.load, self.fill, self.M, self.C
        k = sources.size
        group = np.full(load.size, -1)
        group[sources] = np.arange(k)
        src_load = load[sources]
        # Moves: for each row b with room of a partner of source g, the item of g that comes
        # closest to halving their gap: the longest that fits b and is at most half the gap
        # long, and the next longer one if it fits (by length, about the order of cost)
        xs = np.flatnonzero(group[rank] >= 0)
        # sorted by (source, length, index): the keys are distinct, so any sort gives this
        n = rank.size
        xs = np.sort((group[rank[xs]] * (C + 1) + length[xs]) * n + xs)
        key, xs = xs // n, xs % n
        slots = np.flatnonzero((owner[np.arange(fill.size) // M] >= 0) & (fill < C))
        slots = slots[np.argsort(owner[slots // M], kind="stable")]
        gb = owner[slots // M]
        room = C - fill[slots]
        half = np.floor((src_load[gb] - load[slots // M]) / 2).clip(0, C).astype(np.int64)
        at = np.searchsorted(key, gb * (C + 1) + np.minimum(room, half), side="right") - 1
        at = np.stack([at, at + 1], 1).clip(0, max(xs.size - 1, 0))
        x = xs[at] if xs.size else np.zeros(at.shape, np.int64)
        ok = (key[at] // (C + 1) == gb[:, None]) & (length[x] <= room[:, None]) \
            if xs.size else np.zeros(at.shape, bool)
        move_value = np.where(ok, np.maximum(src_load[gb][:, None] - weight[x],
                                             load[slots // M][:, None] + weight[x]), np.inf)
        move_x, move_to = x.ravel(), np.repeat(slots, 2)
        move_value, move_group = move_value.ravel(), np.repeat(gb, 2)
        best_move, _ = _group_min(move_value, move_group, k)
        # each source's MOVES best moves (into distinct rows), lowest value first
        live = np.flatnonzero(move_value < np.inf)
        live = live[np.lexsort((live, move_value[live], move_group[live]))]
        lg = move_group[live]
        rank_in = np.arange(live.size) - np.searchsorted(lg, lg)
        live = live[rank_in < MOVES]
        move_start = np.searchsorted(move_group[live], np.arange(k + 1))
        # Swaps with a refill: (long item of source g) x (shorter long item of a partner of g);
        # the refill's cost taken as its tokens here (short items), weighed exactly when made
        lx = self.longs[group[rank[self.longs]] >= 0]
        ly = self.longs[owner[rank[self.longs]] >= 0]
        lx, ly = lx[np.argsort(group[rank[lx]], kind="stable")], \
            ly[np.argsort(owner[rank[ly]], kind="stable")]
        glx = group[rank[lx]]
        sx, sy = _cross(glx, owner[rank[ly]], k)
        u, v = lx[sx], ly[sy]
        dl = length[u] - length[v]
        d = weight[u] - weight[v]
        over = np.maximum(fill[slot[v]] + dl - C, 0)
        ok = (dl > 0) & (d > dl) & (over <= self.short_fill[slot[v]]) & \
            (fill[slot[u]] - dl + over <= C)
        swap_value = np.where(ok, np.maximum(src_load[glx[sx]] - d + over,
                                             load[rank[v]] + d - over), np.inf)
        best_swap, swap_at = _group_min(swap_value, glx[sx], k)
        # each source makes its best swap, then its best move if that still lowers it (checked
        # on the loads and rooms as they are then)
        traded = 0
        bar = src_load * (1 - 1e-12)
        for j in np.flatnonzero(np.minimum(best_move, best_swap) < bar):
            s = int(sources[j])
            if best_swap[j] < bar[j]:
                i = int(swap_at[j])
                traded += self.swap_refill(int(u[i]), int(v[i]))
            for i in live[move_start[j]:move_start[j + 1]].tolist():
                y, to = int(move_x[i]), int(move_to[i])
                if rank[y] == s and fill[to] + length[y] <= C and \
                        max(load[s] - weight[y], load[to // M] + weight[y]) < load[s] * (1 - 1e-12):
                    self.place(y, to)
                    traded += 1
        return traded

    def swap_refill(self, x: int, y: int) -> bool:
        """x and y change places, then y's old row sends short items to x's old row until it
        fits; undone unless it does, the source is lower and the other rank below where the
        source was."""
        a, b = int(self.slot[x]), int(self.slot[y])
        s, q = a // self.M, b // self.M
        before = float(self.load[s])
        self.place(x, b)
        self.place(y, a)
        refill = self.refill(a, b, x) if self.fill[b] > self.C else np.zeros(0, np.int64)
        if self.fill[b] <= self.C and self.fill[a] <= self.C and \
                max(self.load[s], self.load[q]) < before * (1 - 1e-12):
            return True
        self.place_all(refill, b)
        self.place(y, b)
        self.place(x, a)
        return False

    def refill(self, a: int, b: int, x: int) -> np.ndarray:
        """Row b's short items but x (the long item that came) into row a, longest first, each
        one that fits a, until b fits (the fewest items moved); the items moved. Most often a
        prefix does it at once."""
        row = np.flatnonzero(self.slot == b)
        row = row[self.short[row] & (row != x)]
        row = row[np.lexsort((row, -self.length[row]))]
        total = np.cumsum(self.length[row])
        j = int(np.searchsorted(total, self.fill[b] - self.C))
        if j < row.size and total[j] <= self.C - self.fill[a]:
            self.place_all(row[:j + 1], a)
            return row[:j + 1]
        moved = []
        for i in row.tolist():
            if self.fill[b] <= self.C:
                break
            if self.fill[a] + self.length[i] <= self.C:
                self.place(i, a)
                moved.append(i)
        return np.array(moved, np.int64)

    def place(self, i: int, b: int) -> None:
        """Item i into slot b."""
        a, w, n = int(self.slot[i]), self.weight[i], self.length[i]
        self.load[a // self.M] -= w
        self.load[b // self.M] += w
        self.fill[a] -= n
        self.fill[b] += n
        if self.short[i]:
            self.short_fill[a] -= n
            self.short_fill[b] += n
        self.slot[i] = b
        self.rank[i] = b // self.M

    def place_all(self, items: np.ndarray, b: int) -> None:
        """Short items, all in one slot, into slot b."""
        if items.size == 0:
            return
        a, w, n = int(self.slot[items[0]]), self.weight[items].sum(), int(self.length[items].sum())
        self.load[a // self.M] -= w
        self.load[b // self.M] += w
        self.fill[a] -= n
        self.fill[b] += n
        self.short_fill[a] -= n
        self.short_fill[b] += n
        self.slot[items] = b
        self.rank[items] = b // self.M


def _group_min(value: np.ndarray, group: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group in [0, k) (`group` sorted): the lowest value (inf where none) and the first
    index holding it."""
    lowest = np.full(k, np.inf)
    at = np.zeros(k, np.int64)
    if value.size == 0:
        return lowest, at
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    lowest[group[starts]] = np.minimum.reduceat(value, starts)
    hit = np.flatnonzero(value == lowest[group])
    first = np.r_[True, group[hit[1:]] != group[hit[:-1]]]
    at[group[hit[first]]] = hit[first]
    return lowest, at


def _cross(ga: np.ndarray, gb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (i, j) with ga[i] == gb[j], for ga and gb sorted group ids in [0, k)."""
    na = np.bincount(ga, minlength=k)
    nb = np.bincount(gb, minlength=k)
    per = na * nb                                   # pairs per group
    total = int(per.sum())
    if total == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    grp = np.repeat(np.arange(k), per)
    within = np.arange(total) - np.repeat(np.cumsum(per) - per, per)
    nbg = nb[grp]
    return (np.cumsum(na) - na)[grp] + within // nbg, (np.cumsum(nb) - nb)[grp] + within % nbg
