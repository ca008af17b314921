"""Lookahead selection: choose this step's samples from a window of W upcoming steps.

When one document costs more than a rank's fair share, no single-step plan helps: whichever
rank gets it is the straggler. What does help is the *number* of such heavy documents in a
step. With R ranks, a step that holds k*R heavy documents gives every rank k of them, and the
light documents even out the rest. A step with k*R + 1 has one rank carrying an extra one.

So the planner looks at W steps' worth of candidates (the coordinator keeps the windows that
deep) and plans the step as the first of W:

- **Rate.** The window holds H heavy documents for W steps, about H/W per step. Step 0 takes a
  whole number of *layers* of R heavy documents, the number of layers nearest to that rate
  (more when forced ones need it). Heavy documents left out are deferred; as they accumulate,
  the rate rises and a later step takes another layer, so nothing starves.
- **Bounded deferral.** Every item that has waited `force_age` steps or more (2W by default:
  `planner.DEFERRAL_WINDOWS`) is taken now, whatever it costs. Layers are completed around the forced heavy documents.
- **Exact quotas.** Step 0 takes each source's quota in tokens, like single-step selection: the
  forced and heavy documents count against it, and light documents in arrival order fill the
  rest, so every step's selection is within one item of each source's quota, and so is every
  window's. (Only forced documents may go past a quota: the deferral bound comes first.)

The step's items then go to `assign_balanced` with the forced ones marked. Only step 0 is ever
committed: the next step plans again over its own window (a rolling horizon), so the later
virtual steps never need to be spelled out.
"""
from __future__ import annotations

import numpy as np

from .balance import item_costs
from .cost import CostModel
from .length_buckets import water_fill
from .types import Candidates, Geometry

HEAVY_SHARE = 0.25   # a document is heavy from this fraction of a slot's fair cost per step
# Heavy levels by cost, as a share of the cost of a document of C tokens: [.., 0.2), [0.2, 0.4),
# [0.4, 0.7), >= 0.7.
LEVEL_EDGES = np.array([0.2, 0.4, 0.7])
LEVELS = LEVEL_EDGES.size + 1


# Per-source quotas for a step: the targets, with the shortfall of sources that have less than
# their target moved to the others in proportion to their targets (the rule `select` applies).
step_quotas = water_fill


def _take_quota(items: np.ndarray, lengths: np.ndarray, sources: np.ndarray, used: np.ndarray,
                quota: np.ndarray) -> np.ndarray:
    """Take `items` (in the given order, per source) while the source's tokens are below quota.

    Updates `used` in place. Overshoots a source's quota by at most one item, like `select`.
    """
    if items.size == 0:
        return items
    order = np.argsort(sources, kind="stable")
    items, lengths, sources = items[order], lengths[order], sources[order]
    starts = np.searchsorted(sources, sources, side="left")
    csum = np.cumsum(lengths)
    before = csum - lengths - (csum[starts] - lengths[starts])     # earlier tokens, same source
    keep = used[sources] + before < quota[sources]
    np.add.at(used, sources[keep], lengths[keep])
    return items[keep]


def _take_arrival(c: Candidates, mask: np.ndarray, used: np.ndarray,
                  quota: np.ndarray) -> np.ndarray:
    """Among candidates in `mask`, per source in arrival order (position, then rank), those
    taken while the source's tokens are below its quota (one item of overshoot, like `select`).

    Whole positions are taken while a source's quota lasts; only the one position where it runs
    out is sorted by rank, so this is O(n). Updates `used`; returns a mask of what is taken.
    """
    S = used.shape[0]
    take = np.zeros(len(c), dtype=bool)
    if not mask.any():
        return take
    P = int(c.position.max()) + 1
    key = c.source.astype(np.int64) * P + c.position
    tokens = np.bincount(key, weights=np.where(mask, c.length, 0), minlength=S * P).reshape(S, P)
    through = np.cumsum(tokens, axis=1)                          # tokens up to and including p
    remaining = quota - used
    # First position where a source reaches its quota (P when it never does).
    cutoff = (through < remaining[:, None]).sum(axis=1)
    limit = cutoff[c.source]
    take = mask & (c.position < limit)
    edge = np.flatnonzero(mask & (c.position == limit))
    if edge.size:
        es = c.source[edge].astype(np.int64)
        edge = edge[np.lexsort((c.rank[edge], es))]
        es = c.source[edge].astype(np.int64)
        before_position = np.where(cutoff[es] > 0, through[es, np.maximum(cutoff[es] - 1, 0)], 0.0)
        lengths = c.length[edge]
        csum = np.cumsum(lengths)
        starts = np.searchsorted(es, es, side="left")
        within = csum - lengths - (csum[starts] - lengths[starts])
        take[edge[before_position + within < remaining[es]]] = True
    used += np.bincount(c.source[take], weights=c.length[take], minlength=S)
    return take


def select_lookahead(c: Candidates, targets: np.ndarray, geometry: Geometry, cost: CostModel, *,
                     window: int, force_age: int) -> tuple[np.ndarray, np.ndarray]:
    """This step's items out of a `window`-step lookahead. Returns (selected, forced)."""
    S = c.num_sources
    slots = balance_slots(geometry, cost)
    targets = np.maximum(np.asarray(targets, dtype=np.float64), 0.0)
    if len(c) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    length, source, age = c.length, c.source, c.age
    # The lookahead pool: `window` steps' worth per source, overdue items first, then arrival
    # order (what `select` does with window * targets). Masks over all candidates from here on.
    forced = age >= force_age
    window_quota = step_quotas(targets * window, np.bincount(source, weights=length, minlength=S))
    pool_used = np.bincount(source[forced], weights=length[forced], minlength=S).astype(np.float64)
    pool = forced | _take_arrival(c, ~forced, pool_used, window_quota)
    weight = item_costs(c, np.arange(len(c)), cost)
    quota = step_quotas(targets, np.bincount(source[pool], weights=length[pool], minlength=S))
    step_tokens = float(quota.sum())
    pool_tokens = float(length[pool].sum())
    if pool_tokens <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    fair = float(weight[pool].sum()) / pool_tokens * step_tokens / slots   # a slot's fair cost
    heavy = pool & (weight >= HEAVY_SHARE * fair) & (length <= geometry.capacity)
    # Levels by cost against a full row's document (C tokens): items of one level are alike,
    # so a layer of them evens out its rows; the top level (pieces near C) can share a row
    # with nothing heavy, so it must come in whole layers.
    full = float(cost.doc_cost(geometry.capacity))
    level = np.searchsorted(LEVEL_EDGES, weight / full, side="right").astype(np.int64)

    used = np.bincount(source[forced], weights=length[forced], minlength=S).astype(np.float64)
    taken = forced.copy()
    room = float(geometry.step_tokens) - float(length[forced].sum())

    # Heavy documents: whole layers of one per slot, level by level, heaviest level first.
    for lv in range(LEVELS - 1, -1, -1):
        in_level = heavy & (level == lv)
        if not in_level.any():
            continue
        forced_here = int((forced & in_level).sum())
        if forced_here % slots and lv > 0:
            # Complete the forced items' layer from the level below, heaviest first.
            below = np.flatnonzero(heavy & (level == lv - 1) & ~forced & ~taken
                                   & (quota[source] > used[source]))
            below = below[np.lexsort((below, -age[below], -weight[below]))]
            extra = below[:(-forced_here) % slots]
            level[extra] = lv
            in_level = heavy & (level == lv)
        # A source owed tokens this step (quota > 0) may release a layer past its quota: the
        # mixer's carry takes the overshoot back over the next steps (the mix stays exact over
        # the window). A source with nothing owed waits.
        cand = np.flatnonzero(in_level & ~forced & ~taken & (quota[source] > used[source]))
        cand = cand[np.lexsort((cand, -weight[cand], -age[cand]))]   # oldest, heaviest, arrival
        # The forced ones set the step's slowest slot: their layer's other slots take what
        # there is at this level for free (each item so taken is one less straggler later).
        open_layer = (-forced_here) % slots
        want = min(open_layer, cand.size)
        if want == open_layer and cand.size - want >= slots:
            want += slots                             # a whole new layer is there: release it
        picked = cand[:want]
        fits = np.cumsum(length[picked]) <= room
        if not fits.all():   # a layer that does not fit the step waits (forced ones never do)
            whole = (int(fits.sum()) + forced_here) // slots * slots - forced_here
            picked = picked[:max(whole, 0)]
        used += np.bincount(source[picked], weights=length[picked], minlength=S)
        room -= float(length[picked].sum())
        taken[picked] = True

    # Light documents fill the quotas in arrival order (round-robin over ranks by position), in
    # the room the layers left: quotas still open shrink in proportion when it is short.
    # A source short of light documents (one of long ones only) hands its part to the others,
    # as `step_quotas` does (its heavy ones wait for their layer; the carry keeps the mix).
    remaining = np.maximum(quota - used, 0.0)
    light = pool & ~taken & ~heavy
    light_available = np.bincount(source[light], weights=length[light], minlength=S)
    remaining = step_quotas(remaining * (max(room, 0.0) / max(remaining.sum(), 1e-9)),
                            light_available)
    light_quota = used + remaining
    taken |= _take_arrival(c, pool & ~taken & ~heavy, used, light_quota)
    selected = np.flatnonzero(taken)
    return selected, forced[selected]


def balance_slots(geometry: Geometry, cost: CostModel) -> int:
    """How many bins the balancer evens out per step: ranks, or rows when each row counts on
    its own (pipeline stages, or plain causal attention, `balance.assign_balanced`)."""
    if geometry.pipelined or not cost.document_masking:
        return geometry.rows
    return geometry.ranks
