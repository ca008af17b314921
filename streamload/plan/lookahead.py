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

HEAVY_SHARE = 0.25   # a document is heavy from this fraction of a rank's fair cost per step


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
    R = geometry.ranks
    S = c.num_sources
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
    fair = float(weight[pool].sum()) / pool_tokens * step_tokens / R   # a rank's fair cost
    heavy = pool & (weight >= HEAVY_SHARE * fair) & (length <= geometry.capacity)

    used = np.bincount(source[forced], weights=length[forced], minlength=S).astype(np.float64)
    taken = forced.copy()

    # Heavy documents: whole layers of R, as many as the window's rate asks for.
    forced_heavy = int((forced & heavy).sum())
    rate = float(heavy.sum()) * step_tokens / pool_tokens
    layers = max(-(-forced_heavy // R), int(np.floor(rate / R + 0.5)))
    want = layers * R - forced_heavy
    if want > 0:
        cand = np.flatnonzero(heavy & ~forced)
        # Oldest first (they are the next to be forced), then heaviest, then arrival order.
        cand = cand[np.lexsort((cand, -weight[cand], -age[cand]))]
        # Respect each source's quota (one item of overshoot, as everywhere else).
        src = source[cand].astype(np.int64)
        within = _take_quota(cand, length[cand], src, used.copy(), quota)
        within = cand[np.isin(cand, within)]                          # back to priority order
        if within.size < want and forced_heavy % R == 0:
            # Not enough for the wanted layers: take the whole layers that are there.
            want = max((within.size + forced_heavy) // R * R - forced_heavy, 0)
        picked = within[:want]
        used += np.bincount(source[picked], weights=length[picked], minlength=S)
        taken[picked] = True

    # Light documents fill the quotas in arrival order (round-robin over ranks by position).
    taken |= _take_arrival(c, pool & ~taken & ~heavy, used, quota)
    # A source made only of heavy documents still gets its quota (quotas stay exact).
    taken |= _take_arrival(c, pool & ~taken & heavy, used, quota)
    selected = np.flatnonzero(taken)
    return selected, forced[selected]
