"""Lookahead selection: choose this step's samples from a window of W upcoming steps.

When one document costs more than a slot's fair share (a slot: a rank, or a row under 1F1B,
`balance_slots`), no single-step plan helps: whichever slot gets it is the straggler. What
does help is *which step* takes it: a step whose every slot carries a document like it is
even again. So the planner looks at W steps' worth of candidates (the coordinator keeps the
windows that deep) and plans the step as the first of W:

- **Light or heavy.** A step of light documents gives each of its slots (of T tokens) about the
  same attention work, T times the light documents' work per token. A document whose own
  attention passes that by more than `LIGHT_TOLERANCE` of a slot's linear cost would be the
  lone straggler of its slot in such a step: it is heavy (`straggler_limit`).
- **Layers.** A heavy document's *excess* is what it costs above the light documents' rate per
  token. The step takes heavy documents only at one *level* of excess for all its slots
  (`heavy_layer`): the largest level that the window's alike documents can give every slot
  (for documents alike, one per slot), and none when the window cannot. Heavier documents
  wait for a step of their own level, so none is the lone straggler of a step. A layer takes
  at most one item of more than half a slot per slot (`ONE_PER_SLOT`): two never share one,
  and the balancer would leave the extra ones out, the oldest among them, which then came due
  alone.
- **Riders.** A heavy document too light to count for a layer's level (below `ALIKE`), due
  within `RIDE_AHEAD` steps, joins a heavier layer (its slot is lighter: no straggler) rather
  than come due alone in a step of light ones, while the layer's shortfall (level less the
  riders' excess) stays within `RIDE_SHARE` of the layer. A lighter slot costs a step about
  its shortfall over the slots, a lone forced document a fifth to a third of a step whatever
  the slots: riders pay at many slots (at 128k, PP = 4, R = 64, 256 of them, documents of
  97-105k, 0.58 of a 128k piece's excess, came due alone every few steps) and wait at few.
  Under pipeline stages, forced items ride too (`FORCED_RIDE`) where the window cannot even
  the step out at their own level but can give a heavier layer. A forced layer still short of
  its level takes peers that have not arrived, then other sources' (`FORCED_PEERS`). Under
  pipeline stages at 4-8 ranks, a forced step with slots left takes items due within `RIDE_AHEAD`
  steps of sources owed nothing, within `DUE_SLACK` of overdraft (`DUE_PEERS`, `_due_peers`).
- **Held once arrived** (`HOLD_ARRIVED`, `_arrived_layer`). Light documents flow in arrival
  order at their quotas; a heavy one joins a layer only when nothing light is left in front of
  it in its window (rank, source): it has *arrived*, and waits at the head of its window, in
  the outlier queue, for its peers. So a layer never leaves light items behind (taking heavy
  documents from deep in the window left every light one in front of them waiting until its
  quota reached it again: of 31,904 items deferred at 128k, PP = 4, R = 4, 31,236 were light),
  but for a forced layer short of its level (`FORCED_PEERS`).
  The layer's tokens are its sources' overshoot, given back by the carry; the light take of
  every source shrinks in proportion to the room the layer leaves.
- **Bounded deferral.** Every item that has waited `force_age` steps or more (2W by default:
  `planner.DEFERRAL_WINDOWS`) is taken now, whatever it costs; the heaviest forced one sets the
  level, and any heavy document no heavier joins it for free. Items due in the next steps are
  taken early where they would leave a step with more than half a step overdue
  (`bounded_forced`): the balancer can always place that much, so no item waits past the
  bound.
- **The mix over the window.** A source owed tokens this step may give its heavy documents
  past its step quota: the mixer's carried deficit takes the overshoot back over the next
  steps, so the mix is exact over windows of steps (not step by step). Only as far as the
  carry takes back (`layer_mix`): a layer of free items waits where it would leave another
  source owed more than `MIX_SLACK` steps' worth (where a slot is a rank's one row, a source
  offers the layer only what it is owed plus that much). Light documents then fill the
  quotas in arrival order, in the room the heavy ones left (a source short of light ones
  hands its part to the others, as `step_quotas` does).

The step's items then go to `assign_balanced` with the forced ones marked. Only step 0 is ever
committed: the next step plans again over its own window (a rolling horizon), so the later
virtual steps never need to be spelled out.
"""
from __future__ import annotations

import numpy as np

from .balance import item_costs
from .cost import CostModel
from .layer_mix import MIX_SLACK, bounds_overshoot, keeps_mix, within_overshoot
from .length_buckets import water_fill
from .types import Candidates, Geometry

LIGHT_TOLERANCE = 0.03   # a light document's attention may pass a light slot's mean by this
                         # share of a slot's linear cost (b·T)
FORCE_HORIZON = 4        # steps ahead (at most a quarter of the bound) whose overdue items
                         # `bounded_forced` keeps within half a step
LIGHT_ROUNDS = 8         # rounds of `straggler_limit`'s fixed point (it converges in 2-4)
LEVEL_CANDIDATES = 64   # distinct excesses tried as a step's level (spread over the range)
ALIKE = 0.75         # an item fits a level when a slot of it reaches this share of the level
HOLD_ARRIVED = True  # heavy documents join a layer only once arrived (`_arrived_layer`);
                     # False: from anywhere in the window (the rule before, for comparison)
ARRIVAL_ROUNDS = 3   # rounds for the arrived heavy items and the light take to agree
ONE_PER_SLOT = True  # a layer takes at most one item of more than half a slot per slot;
                     # False: as many as its excess allows (the rule before, for comparison)
RIDE_AHEAD = 2       # heavy items due within this many steps may ride a heavier layer
RIDE_SHARE = 0.05    # riders while the layer's shortfall stays within this share of it
FORCED_PEERS = True  # a forced layer short of its level takes heavy
                     # items not yet arrived, then other sources' (`_forced_peers`); False:
                     # arrived ones of sources owed tokens only (the rule before)
PEER_SLOTS = 32      # ... from this many slots (each peer at most 1/32 of the step; at fewer
                     # it moved the Loader's mix: 32k DP R = 2 0.0088 -> 0.0114, R = 4 -> 0.030)
FORCED_RIDE = True   # under pipeline stages, a forced item without peers rides a heavier
                     # layer (`heavy_layer`; measured to cost 32k DP R = 64, where it is off)
DUE_PEERS = (4, 8)   # from and up to these many ranks, under pipeline stages, a forced step
                     # with slots left without a heavy item takes as peers items due within
                     # RIDE_AHEAD steps of sources owed nothing (`_due_peers`; (0, 0): never;
                     # measured to move 128k PP=4's mix at R = 2, 0.0035 -> 0.0125)
DUE_SLACK = 0.25     # ... while each such source's overdraft past its quota stays within this
                     # many steps' worth (0.1 moved 32k PP=4 R = 4's mix to 0.0146; 0.05: no gain)
LEVEL_BLOCKS = (2, 8)  # `_first_feasible` tries the top 2 levels, then to the 8th, then the rest


# Per-source quotas for a step: the targets, with the shortfall of sources that have less than
# their target moved to the others in proportion to their targets (the rule `select` applies).
step_quotas = water_fill


def _take_arrival(c: Candidates, mask: np.ndarray, used: np.ndarray, quota: np.ndarray,
                  tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Among candidates in `mask`, per source in arrival order (position, then rank), those
    taken while the source's tokens are below its quota (one item of overshoot, like `select`).

    Whole positions are taken while a source's quota lasts; only the one position where it runs
    out is sorted by rank, so this is O(n). Updates `used`; returns a mask of what is taken and
    its tokens per (source, position). `tokens`: the tokens of the items in `mask` per
    (source, position), [S, largest position + 1] (as `Candidates.arrival_tokens` lays them
    out).
    """
    take = np.zeros(len(c), dtype=bool)
    if not mask.any():
        return take, np.zeros_like(tokens)
    through = np.cumsum(tokens, axis=1)                         # up to and including p
    remaining = quota - used
    # First position where a source reaches its quota (P when it never does), in the
    # positions' own dtype: the comparisons below then convert nothing.
    cutoff = (through < remaining[:, None]).sum(axis=1)
    limit = c.by_source(cutoff.astype(c.position.dtype))
    take = mask & (c.position < limit)
    edge = np.flatnonzero(mask & (c.position == limit))
    edge_tokens = None
    if edge.size:
        edge = edge[np.lexsort((c.rank[edge], c.source[edge]))]
        taken, edge_tokens = _edge_take(c, edge, cutoff, through, remaining)
        take[edge[taken]] = True
    _count_take(used, cutoff, through, edge_tokens)
    # What was taken: the whole positions before each source's cutoff, and the edge items
    # taken at it.
    took = np.where(np.arange(tokens.shape[1]) < cutoff[:, None], tokens, 0.0)
    if edge_tokens is not None:
        at = np.flatnonzero(edge_tokens > 0)
        took[at, cutoff[at]] += edge_tokens[at]
    return take, took


def _edge_take(c: Candidates, edge: np.ndarray, cutoff: np.ndarray, through: np.ndarray,
               remaining: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of the items at their source's cutoff position (`edge`, ordered by source, then rank),
    those taken while the source's tokens stay below `remaining` (counting the whole positions
    before: `through`, running sums per source and position). Returns (taken, a mask over
    `edge`; their tokens per source)."""
    es = c.source[edge].astype(np.int64)
    before_position = np.where(cutoff[es] > 0, through[es, np.maximum(cutoff[es] - 1, 0)], 0.0)
    lengths = c.length[edge]
    csum = np.cumsum(lengths)
    starts = np.searchsorted(es, es, side="left")
    within = csum - lengths - (csum[starts] - lengths[starts])
    taken = before_position + within < remaining[es]
    return taken, np.bincount(es, weights=np.where(taken, lengths, 0), minlength=c.num_sources)


def _count_take(used: np.ndarray, cutoff: np.ndarray, through: np.ndarray,
                edge_tokens: np.ndarray | None) -> None:
    """Adds a take's tokens to `used`: its edge items' (`edge_tokens`, None when there were
    none), then its whole positions' (known already: sums of whole numbers, so exact)."""
    if edge_tokens is not None:
        used += edge_tokens
    used += np.where(cutoff > 0, through[np.arange(used.shape[0]), np.maximum(cutoff - 1, 0)],
                     0.0)


def select_lookahead(c: Candidates, targets: np.ndarray, geometry: Geometry, cost: CostModel, *,
                     window: int, force_age: int, eligible: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """This step's items out of a `window`-step lookahead. Returns (selected, forced).
    `eligible` (bool per source; None: all): the sources with a share this step, the only
    ones a forced layer may take past their quotas (`_forced_peers`)."""
    S = c.num_sources
    slots = balance_slots(geometry, cost)
    targets = np.maximum(np.asarray(targets, dtype=np.float64), 0.0)
    if len(c) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    length, source, age = c.length, c.source, c.age
    # The lookahead pool: `window` steps' worth per source, overdue items first, then arrival
    # order (what `select` does with window * targets). Masks over all candidates from here on.
    forced = bounded_forced(c, force_age, geometry.step_tokens // 2)
    overdue = np.flatnonzero(forced)
    forced_tokens = np.bincount(source[overdue], weights=length[overdue],
                                minlength=S).astype(np.float64)
    key = c.arrival_key
    # Token sums below are whole numbers, so exact: they are made from this histogram of the
    # items not forced, by adding and taking away items, not by more passes over every item.
    unforced = ~forced
    unforced_tokens = c.arrival_tokens_less(overdue).reshape(S, -1)   # [S, positions]
    window_quota = step_quotas(targets * window, unforced_tokens.sum(axis=1) + forced_tokens)
    # The pool's tokens per source: the forced ones and what the arrival fill takes (which it
    # counts into `pool_by_source`).
    pool_by_source = forced_tokens.copy()
    pool_take, pool_by_position = _take_arrival(c, unforced, pool_by_source, window_quota,
                                                unforced_tokens)
    pool = forced | pool_take
    weight, linear_part = item_costs(c, None, cost, with_linear=True)
    quota = step_quotas(targets, pool_by_source)
    pool_tokens = float(pool_by_source.sum())   # whole numbers: the float sum is exact
    if pool_tokens <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    slot_tokens = geometry.capacity if slots == geometry.rows else \
        geometry.micro_batches * geometry.capacity
    # Heavy: what a step of light documents cannot even out (`straggler_limit`).
    # b·L as `item_costs` made it: the same floats (in its buffer, read nowhere else)
    attention = np.subtract(weight, linear_part, out=linear_part)
    np.maximum(attention, 0.0, out=attention)
    linear = float(cost.b) * slot_tokens if cost.b > 0 else float(cost.a) * slot_tokens ** 2
    # Only items above the limit's floor can pass it: the heavy ones are looked up among them.
    high = above_floor(attention, pool, linear)
    limit = straggler_limit(attention, length, pool, slot_tokens, linear, high, pool_tokens)
    heavy_items = high[(attention[high] > limit) & (length[high] <= geometry.capacity)]
    # What a heavy item costs above the light documents' rate per token: what its slot
    # carries more than a slot of light documents of the same tokens.
    light_pool = pool.copy()
    light_pool[heavy_items] = False
    # The light pool's tokens: the pool's less the heavy items' (whole numbers: exact).
    light_pool_tokens = pool_tokens - float(length[heavy_items].sum())
    density = float(weight[light_pool].sum()) / light_pool_tokens \
        if light_pool_tokens > 0 else float(cost.b)
    excess = np.zeros(len(c))                      # read for heavy items only
    excess[heavy_items] = np.maximum(weight[heavy_items] - density * length[heavy_items], 0.0)

    used = forced_tokens
    taken = forced.copy()
    room = float(geometry.step_tokens) - float(forced_tokens.sum())
    # A source owed tokens this step (quota > 0) may give heavy documents past its quota: the
    # mixer's carry takes the overshoot back over the next steps (the mix stays exact over the
    # window). A source with nothing owed waits.
    # (Heavy items are few: these are indices, looked up among them alone.)
    heavy_forced = forced[heavy_items]
    free = heavy_items[~heavy_forced & (quota > used)[source[heavy_items]]]
    # ... by at most what the carry takes back (`layer_mix`).
    slack = None if MIX_SLACK is None else MIX_SLACK * float(geometry.step_tokens)
    if slack is not None and bounds_overshoot(geometry):
        free = within_overshoot(free, source, length, age, quota - used, slack)
    must = heavy_items[heavy_forced]
    light = pool_take.copy()                       # the pool less the forced and heavy items
    light[heavy_items] = False
    # The light items' tokens: the pool's not forced, less its heavy ones (few).
    heavy_unforced = heavy_items[~heavy_forced]
    light_tokens = pool_by_position - np.bincount(
        key[heavy_unforced], weights=c.float_length[heavy_unforced],
        minlength=pool_by_position.size).reshape(pool_by_position.shape)
    if not HOLD_ARRIVED:
        picked = heavy_layer(excess, must, free, age, length, slots, slot_tokens, room)
        used += np.bincount(source[picked], weights=length[picked], minlength=S)
        taken[picked] = True
        lights = _LightTake(c, light, light_tokens)
        light_take = lights.mask(lights(quota, used, room - float(length[picked].sum())))
    else:
        picked, light_take = _arrived_layer(c, excess, must, free, light, quota,
                                            used, room, slots, slot_tokens, light_tokens,
                                            force_age, FORCED_RIDE and geometry.pipelined,
                                            slack,
                                            _peer_pools(free, heavy_items, heavy_forced,
                                                        source, eligible)
                                            if FORCED_PEERS and
                                            slots >= PEER_SLOTS else ())
        if must.size and geometry.pipelined and \
                DUE_PEERS[0] <= geometry.ranks <= DUE_PEERS[1] and \
                slots - must.size - picked.size > 0:
            due = _due_peers(heavy_items, heavy_forced, source, length, age, quota - used,
                             force_age, slots - must.size - picked.size,
                             DUE_SLACK * float(geometry.step_tokens))
            if due.size:
                picked, light_take = _arrived_layer(
                    c, excess, must, np.union1d(free, due), light, quota, used.copy(), room,
                    slots, slot_tokens, light_tokens, force_age,
                    FORCED_RIDE and geometry.pipelined, slack, ())
        taken[picked] = True
    taken |= light_take
    selected = np.flatnonzero(taken)
    return selected, forced[selected]


class _LightTake:
    """Light documents fill the quotas in arrival order (round-robin over ranks by position),
    in `room` tokens: quotas still open shrink in proportion when it is short. A source short
    of light documents (one of long ones only) hands its part to the others, as `step_quotas`
    does (its heavy ones wait for their layer; the carry keeps the mix).

    The rounds of `_arrived_layer` take from the same light items in different rooms, and ask
    of each take only where it cuts each window: the first light item it leaves there. So the
    light items' tokens per (source, position) (`tokens`, as `_take_arrival` takes them) are
    summed once, and a take (the same as `_take_arrival`'s) is a cut position per source,
    looked up per window (S·R lookups, `_first_light`), not a pass over every candidate; its
    mask is made only for the one take kept (`mask`)."""

    def __init__(self, c: Candidates, light: np.ndarray, tokens: np.ndarray):
        self.c, self.light = c, light
        self.available = tokens.sum(axis=1)
        self.through = np.cumsum(tokens, axis=1)
        self.span = tokens.shape[1]                    # positions: largest + 1
        self.windows = np.arange(c.num_sources * c.num_ranks, dtype=np.int64)
        self.window_source = self.windows // c.num_ranks
        self.never = np.iinfo(c.position.dtype).max
        self.light_items = self.key = None
        if c.dense_positions:   # window w's item at position p is window_bounds[w] + p
            self.start, self.end = c.window_bounds[:-1], c.window_bounds[1:]
            return
        # Any other layout (sources relabelled by length buckets): the light items sorted by
        # (window, position), searched.
        items = np.flatnonzero(light)
        key = (c.source[items].astype(np.int64) * c.num_ranks + c.rank[items]) * self.span \
            + c.position[items]
        order = np.argsort(key, kind="stable")
        self.light_items, self.key = items[order], key[order]

    def _next_light(self, i: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Per entry, the first light candidate at index `i` or after and before `end`; `end`
        where there is none. Looks at the next 1, 4, 16, ... items of the entries still
        searching (most find one at once: heavy items are few), so a long run of them costs a
        few rounds, not one per item."""
        light, n = self.light, self.light.size
        at = np.flatnonzero(i < end)
        width = 1
        while at.size:
            ahead = i[at, None] + np.arange(width)
            hit = light[np.minimum(ahead, n - 1)] & (ahead < end[at, None])
            found = hit.any(axis=1)
            i[at[found]] += hit[found].argmax(axis=1)
            at = at[~found]
            i[at] = np.minimum(i[at] + width, end[at])
            at = at[i[at] < end[at]]
            width = min(4 * width, 4096)
        return i

    def _first_light(self, windows: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per window of `windows`, its first light item at position `at` or later: (candidate
        index, position); -1 and the position dtype's largest value where there is none."""
        if self.key is None:                           # dense positions
            start, end = self.start[windows], self.end[windows]
            i = self._next_light(np.minimum(start + at, end), end)
            found = i < end
            return np.where(found, i, -1), \
                np.where(found, i - start, self.never).astype(self.c.position.dtype)
        n = self.key.size
        if n == 0:
            return np.full(windows.size, -1), np.full(windows.size, self.never,
                                                      self.c.position.dtype)
        first_key = windows * self.span
        j = np.minimum(np.searchsorted(self.key, first_key + at), n - 1)
        key = self.key[j]
        found = (key >= first_key + at) & (key < first_key + self.span)
        return np.where(found, self.light_items[j], -1), \
            np.where(found, key - first_key, self.never).astype(self.c.position.dtype)

    def __call__(self, quota: np.ndarray, used: np.ndarray, room: float):
        """The take in `room` tokens, `used` tokens of each source taken already (updated):
        (cutoff, the edge items taken, first left). `cutoff`: per source, the position before
        which every light item is taken; the edge items (indices) are those taken at it;
        `first_left`: per window (source · num_ranks + rank), the least position of a light
        item left, the position dtype's largest value where there is none."""
        remaining = np.maximum(quota - used, 0.0)
        remaining = step_quotas(remaining * (max(room, 0.0) / max(remaining.sum(), 1e-9)),
                                self.available)
        remaining = (used + remaining) - used          # as `_take_arrival` rounds it
        cutoff = (self.through < remaining[:, None]).sum(axis=1)
        cut = cutoff[self.window_source]
        index, first_left = self._first_light(self.windows, cut)
        at_edge = np.flatnonzero(first_left == cut)
        edge = index[at_edge]                          # by window: by source, then rank
        edge_tokens = None
        if edge.size:
            taken, edge_tokens = _edge_take(self.c, edge, cutoff, self.through, remaining)
            again = at_edge[taken]                     # taken: the next one is the first left
            first_left[again] = self._first_light(again, cut[again] + 1)[1]
            edge = edge[taken]
        _count_take(used, cutoff, self.through, edge_tokens)
        return cutoff, edge, first_left

    def mask(self, take) -> np.ndarray:
        """A take's items as a mask over the candidates."""
        cutoff, edge, _ = take
        c = self.c
        out = self.light & (c.position < c.by_source(cutoff.astype(c.position.dtype)))
        out[edge] = True
        return out


def _arrived(c: Candidates, candidates: np.ndarray, first_left: np.ndarray) -> np.ndarray:
    """Of `candidates` (indices, ascending), those with no light item the step leaves before
    them in their own window (`first_left`, from `_LightTake`): taking them overtakes no
    light item. The candidates, few, are looked up alone."""
    window = c.source[candidates].astype(np.int64) * c.num_ranks + c.rank[candidates]
    return candidates[c.position[candidates] < first_left[window]]


def _arrived_layer(c: Candidates, excess: np.ndarray, must: np.ndarray, free: np.ndarray,
                   light: np.ndarray, quota: np.ndarray, used: np.ndarray, room: float,
                   slots: int, slot_tokens: int, light_tokens: np.ndarray, force_age: int,
                   forced_ride: bool = False,
                   slack: float | None = None, peers: tuple = ()) -> tuple[np.ndarray, np.ndarray]:
    """The heavy layer out of the heavy documents that have *arrived* (`HOLD_ARRIVED`), and
    the light take around it. Returns (picked heavy indices, light take mask). `must`, `free`:
    the forced and the free heavy items (indices, ascending); `light_tokens`: the light
    items' tokens per (source, position) (as `_take_arrival` takes them).

    Light documents flow in arrival order at their quotas, so none of them is ever deferred
    (but behind the `peers` of a forced layer, below); a heavy one may join a layer only when
    every light item before it in its window is taken (in this step or an earlier one): the
    held ones sit at the front of their windows. The layer's tokens count as the sources'
    overshoot (the carry repays it): they shrink the light take of every source in
    proportion, through the room. Which heavy items have arrived
    depends on the room the layer leaves, so the candidates shrink until they agree (a few
    rounds); a picked item still behind a light one left waits for the next step. A layer of
    free items only waits too where it would leave a source owed more than `slack` tokens
    (`layer_mix.keeps_mix`; None: never).

    `peers`: pools of heavy items (indices, ascending) that a forced layer still short of its
    level takes from next, in turn (`_forced_peers`); () for none."""
    length, age = c.length, c.age
    ride_age = force_age - RIDE_AHEAD if RIDE_AHEAD > 0 else None
    candidates = free
    light_take = _LightTake(c, light, light_tokens)
    whole_used = used.copy()
    whole_room = take = light_take(quota, whole_used, room)
    for _ in range(ARRIVAL_ROUNDS):
        candidates = _arrived(c, candidates, take[2])
        picked = heavy_layer(excess, must, candidates, age, length, slots, slot_tokens, room,
                             ride_age, forced_ride)
        if picked.size == 0:   # no layer: the light take is the whole room's
            if not (must.size and peers):
                return picked, light_take.mask(whole_room)
            take, arrived = whole_room, np.zeros(0, dtype=bool)
            break
        layer_used = used.copy()
        take = light_take(quota, layer_used, room - float(length[picked].sum()))
        arrived = _within(picked, _arrived(c, free, take[2]))
        if arrived.all():
            break
    picked = picked[arrived]
    if slack is not None and must.size == 0:
        layer_used += np.bincount(c.source[picked], weights=length[picked],
                                  minlength=quota.size)
        # Sources with heavy items to give are never short of light ones (`keeps_mix`).
        heavy = np.bincount(c.source[free], minlength=quota.size)   # (`must` is empty here)
        light_only = np.where(heavy > 0, 0.0, light_take.available)
        if not keeps_mix(quota, used, layer_used, whole_used, light_only, slack):
            return picked[:0], light_take.mask(whole_room)
    if must.size and peers:
        before = picked.size
        for pool in peers:
            picked = np.union1d(picked, _forced_peers(excess, must, picked, pool, age, length,
                                                      slots, slot_tokens, room))
        if picked.size > before:
            take = light_take(quota, used.copy(), room - float(length[picked].sum()))
    return picked, light_take.mask(take)


def _due_peers(heavy_items: np.ndarray, heavy_forced: np.ndarray, source: np.ndarray,
               length: np.ndarray, age: np.ndarray, owed: np.ndarray, force_age: int,
               lone: int, slack: float) -> np.ndarray:
    """Heavy items due within RIDE_AHEAD steps of sources owed nothing (`owed` <= 0, tokens
    per source) that a forced step with `lone` slots left may take as peers (`DUE_PEERS`):
    the oldest first, at most `lone`, and per source while its overdraft (-`owed` plus the
    items' tokens) stays within `slack`. They come due within those steps whatever their
    source's quota, likely alone in a step; taken now they even out a forced step."""
    due = heavy_items[~heavy_forced & (owed <= 0)[source[heavy_items]] &
                      (age[heavy_items] >= force_age - RIDE_AHEAD)]
    if due.size == 0:
        return due
    due = within_overshoot(due, source, length, age, owed, slack, overdrawn=True)
    return np.sort(due[np.lexsort((due, -age[due]))][:lone])


def _peer_pools(free: np.ndarray, heavy_items: np.ndarray, heavy_forced: np.ndarray,
                source: np.ndarray, eligible: np.ndarray | None) -> tuple:
    """The pools a forced layer short of its level takes peers from, in turn (`_forced_peers`):
    the free heavy items (of sources owed tokens), then, past their quotas, the unforced heavy
    items of every source with a share this step (`eligible`; None: all)."""
    others = ~heavy_forced
    if eligible is not None:
        others &= eligible[source[heavy_items]]
    return free, heavy_items[others]


def _forced_peers(excess: np.ndarray, must: np.ndarray, picked: np.ndarray, pool: np.ndarray,
                  age: np.ndarray, length: np.ndarray, slots: int, slot_tokens: int,
                  room: float) -> np.ndarray:
    """Heavy items of `pool` that join a forced layer (`FORCED_PEERS`) besides the `picked`
    ones, where those leave it short of its level by more than `RIDE_SHARE` of it; none
    otherwise. A forced item sets the step's slowest slot whatever joins it, so every slot
    left light is lost: at 32k DP R = 512, forced 32k pieces sat with 80-250 arrived peers
    for 512 ranks (steps at 0.68-0.75) while the lookahead held 1,700-2,000 more. The pools
    (`_peer_pools`): the heavy items of sources owed tokens not yet arrived (taking one
    overtakes the light items before it in its window: they wait a step or more), then those
    of any source with a share this step (the mixer's carry repays the overshoot, as it does
    a layer's); from `PEER_SLOTS` slots (rows under pipeline stages: there they once cost
    128k PP=4 R = 64 0.9685 -> 0.9599; at 50faab5 they gave 0.9685 -> 0.9724, seeds 1/2
    0.9544 -> 0.9767, 0.9682 -> 0.9793, at twice the mean delay, pp64). Items join in `heavy_layer`'s order, the
    oldest first (the fewest light items before them first instead let the old ones come due:
    R = 512 seed 0, 0.961 -> 0.901)."""
    layer = np.union1d(must, picked)
    level = float(excess[layer].max())
    if float(excess[layer].sum()) >= (1 - RIDE_SHARE) * slots * level:
        return pool[:0]
    rest = pool[~_within(pool, picked)]
    return heavy_layer(excess, layer, rest, age, length, slots, slot_tokens,
                       room - float(length[picked].sum()))


def _within(items: np.ndarray, among: np.ndarray) -> np.ndarray:
    """`np.isin(items, among)` for `among` ascending (indices): searched, not a table over
    every candidate index (np.isin's choice for integers: 6·10^6 entries at R = 4096)."""
    if among.size == 0:
        return np.zeros(items.size, dtype=bool)
    at = np.minimum(np.searchsorted(among, items), among.size - 1)
    return among[at] == items


def bounded_forced(c: Candidates, force_age: int, limit: int) -> np.ndarray:
    """The items this step must take, at most `limit` tokens of them where the bound allows: the
    overdue ones (age >= `force_age`), and as many of those due in the next steps as those
    steps could not take at `limit` each (earliest deadline first: the oldest, then in arrival
    order).

    The balancer places any set of forced items of at most half the step (first-fit
    decreasing); of more, `balance._oldest_that_fit` keeps the oldest half and the rest wait
    one step past the bound (the loader saw ages of 17 against a bound of 16, when pieces of a
    row each came due together). With the tokens due within k + 1 steps D_k (those of age
    >= `force_age` - k), this step takes max over k of D_k - k·`limit`, so no later step has
    more than `limit` overdue."""
    age, length = c.age, c.length
    forced = age >= force_age
    horizon = max(min(force_age // 4, FORCE_HORIZON), 1)
    near = np.flatnonzero(age >= force_age - horizon)
    due_in = np.maximum(force_age - age[near].astype(np.int64), 0)        # steps left
    by_deadline = np.bincount(due_in, weights=length[near], minlength=horizon + 1)
    k = np.arange(horizon + 1)
    need = float((np.cumsum(by_deadline) - k * limit).max())
    have = float(length[forced].sum())
    if need > have:
        soon = np.flatnonzero(~forced)
        soon = soon[np.lexsort((c.rank[soon], c.position[soon], -age[soon]))]
        ahead = have + np.cumsum(length[soon])
        forced[soon[(ahead - length[soon] < need) & (ahead <= limit)]] = True
    return forced


def above_floor(attention: np.ndarray, pool: np.ndarray, linear: float) -> np.ndarray:
    """The items of `pool` whose attention passes LIGHT_TOLERANCE · `linear`, the floor that
    `straggler_limit` never goes below: the only ones it can make heavy (indices, ascending)."""
    return np.flatnonzero(pool & (attention > LIGHT_TOLERANCE * linear * (1 - 1e-9)))


def straggler_limit(attention: np.ndarray, length: np.ndarray, pool: np.ndarray,
                    slot_tokens: int, linear: float, high: np.ndarray | None = None,
                    pool_tokens: float | None = None) -> float:
    """The most attention work a light document may have: a step of light documents gives
    every slot (of `slot_tokens` tokens, `linear` of linear cost when full) about X = T x their
    attention per token, and the balancer evens that out only when no document alone passes X
    by much. Documents above X + LIGHT_TOLERANCE · (linear + X) are heavy, and X itself is over
    the light ones: the fixed point, approached from above (each round only lowers it).

    A fixed share of a slot's cost (the rule before) left documents just under it as the lone
    stragglers of light steps: at C = 128k over CP, R = 64, such steps ran at 0.90-0.93.
    `high`: `above_floor(attention, pool, linear)`, `pool_tokens`: the pool's tokens, when
    already known."""
    x = attention if pool.all() else attention[pool]
    limit = float(x.max(initial=0.0))
    # Every item is light in the first round; later rounds only drop items above the limit,
    # never below LIGHT_TOLERANCE · linear (the mean is not negative). So the sums are the
    # first round's less those of the few items above the limit, found among the items above
    # that floor (`above_floor`, looked up once). Token sums are whole numbers, so exact.
    total_x = float(x.sum())
    total_l = float(length.sum(where=pool)) if pool_tokens is None else pool_tokens
    high = above_floor(attention, pool, linear) if high is None else high
    above, above_l = attention[high], length[high].astype(np.float64)
    for _ in range(LIGHT_ROUNDS):
        out = above > limit
        tokens = total_l - float(above_l[out].sum())
        mean = slot_tokens * (total_x - float(above[out].sum())) / tokens if tokens > 0 else 0.0
        lower = mean + LIGHT_TOLERANCE * (linear + mean)
        if lower >= limit:
            break
        limit = lower
    return limit


def heavy_layer(excess: np.ndarray, must: np.ndarray, free: np.ndarray, age: np.ndarray,
                length: np.ndarray, slots: int, slot_tokens: int, room: float,
                ride_age: int | None = None, forced_ride: bool = False) -> np.ndarray:
    """Which heavy documents (`free`, candidate indices) join this step, besides the forced
    ones (`must`), so that every one of the step's `slots` (of `slot_tokens` tokens) carries
    the same excess cost.

    The step's level e is the largest excess a slot will carry: the heaviest forced item's,
    or else the largest e that the free items fit for it can give every slot. An item fits a
    level when it is no heavier than e and dense enough to reach e within a slot's tokens
    (excess per token >= ALIKE · e / slot_tokens: attention grows with L², so half-length
    documents cannot stand in for a full one); for items alike, that is one per slot. Items
    heavier than e wait for a step of their own level (or until they are forced), so none of
    them is the lone straggler of a step. Items of age `ride_age` or more, no heavier than e
    but not dense enough, ride (`RIDE_SHARE`; None: none rides). The fit items then join,
    oldest first (then heaviest), while their excess stays within slots·e, their tokens within
    `room`, and those of more than half a slot within one per slot (`ONE_PER_SLOT`) (with a
    forced item, every item no heavier than e is fit; where those cannot even the step out,
    the forced items ride the heavier layer the free ones give with `forced_ride`).
    Without a level (too little heavy work in the window to even out a step) none joins.
    """
    def fit(level, dense):
        ok = excess[free] <= level * (1 + 1e-9)
        if not dense:
            return free[ok]
        alike = ok & (excess[free] * slot_tokens >= ALIKE * level * length[free])
        if ride_age is None:
            return free[alike]
        riders = free[ok & ~alike & (age[free] >= ride_age)]
        riders = riders[np.lexsort((riders, -excess[riders], -age[riders]))]
        riders = riders[np.cumsum(level - excess[riders]) <=
                        RIDE_SHARE * slots * level - forced_deficit]
        return np.union1d(free[alike], riders)

    def layer_level():
        levels = np.unique(excess[free])[::-1]
        if levels.size == 0:
            return None
        if levels.size > LEVEL_CANDIDATES:   # spread over the whole range, the heaviest first
            levels = levels[np.unique(np.linspace(0, levels.size - 1, LEVEL_CANDIDATES)
                                      .astype(np.int64))]
        return _first_feasible(levels, excess[free][:, None], length[free][:, None],
                               slots, slot_tokens)

    must_excess = float(excess[must].sum())
    forced_deficit = 0.0
    dense = not must.size
    if must.size:
        level = float(excess[must].max())
        # Forced items the window cannot even out at their own level ride a heavier layer
        # the window can give, while their shortfall stays within RIDE_SHARE of it.
        below = excess[free][excess[free] <= level * (1 + 1e-9)]
        if forced_ride and ride_age is not None and \
                must_excess + float(below.sum()) < slots * level:
            higher = layer_level()
            if higher is not None and higher > level and \
                    higher * must.size - must_excess <= RIDE_SHARE * slots * higher:
                level, dense = higher, True
                forced_deficit = higher * must.size - must_excess
    else:
        level = layer_level()
        if level is None:
            return free[:0]
    budget = slots * level - must_excess
    if budget <= 0:
        return free[:0]
    # A forced item sets the step's slowest slot whatever joins it: then any item no heavier
    # fills the other slots toward it for free (one less straggler later), alike or not.
    eligible = fit(level, dense=dense)
    eligible = eligible[np.lexsort((eligible, -excess[eligible], -age[eligible]))]
    within = (np.cumsum(excess[eligible]) - excess[eligible] < budget) & \
        (np.cumsum(length[eligible]) <= room)
    if ONE_PER_SLOT:
        # Two items of more than half a slot never share one: past `slots` of them (the
        # forced ones counted) the balancer would leave the extra ones out, oldest or not.
        wide = 2 * length[eligible] > slot_tokens
        open_slots = slots - int((2 * length[must] > slot_tokens).sum())
        within &= ~wide | (np.cumsum(wide & within) <= open_slots)
    return eligible[within]


def _first_feasible(levels: np.ndarray, x: np.ndarray, l: np.ndarray, slots: int,
                    slot_tokens: int) -> float | None:
    """The first of `levels` (heaviest first) that the items of excess `x` and length `l`
    (columns) fit for can give every slot (`heavy_layer`); None when none can.

    The top levels are tried first (in most steps the top one is feasible), a block of
    columns at a time. Each column's sum is the same float whatever the block: NumPy sums a
    C-ordered (n, k) matrix over axis 0 row after row for k >= 2 (a single column would be
    summed pairwise), so blocks keep at least two columns, as the whole matrix has."""
    start = 0
    for stop in LEVEL_BLOCKS + (levels.size,):
        stop = min(stop, levels.size)
        if stop <= start:
            continue
        first = max(min(start, stop - 2), 0)           # at least two columns when there are
        block = levels[first:stop]
        fits = (x <= block[None, :] * (1 + 1e-9)) & \
            (x * slot_tokens >= ALIKE * block[None, :] * l)
        feasible = np.where(fits, x, 0.0).sum(axis=0) >= slots * block
        if feasible.any():
            return float(block[int(np.argmax(feasible))])
        start = stop
    return None


def balance_slots(geometry: Geometry, cost: CostModel) -> int:
    """How many bins the balancer evens out per step: ranks, or rows when each row counts on
    its own (pipeline stages, or plain causal attention, `balance.assign_balanced`)."""
    if geometry.pipelined or not cost.document_masking:
        return geometry.rows
    return geometry.ranks
