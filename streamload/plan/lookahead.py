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
- **Bounded deferral.** Every item that has waited `force_age` steps or more (W by default) is
  taken now, whatever it costs. Layers are completed around the forced heavy documents.
- **Exact quotas.** Step 0 takes each source's quota in tokens, like single-step selection: light
  documents in arrival order fill what the forced and heavy ones left, so each source is within
  one item of its target every step, and therefore over every window too.

The step's items then go to `assign_balanced` with the forced ones marked. Only step 0 is ever
committed: the next step plans again over its own window (a rolling horizon), so the later
virtual steps never need to be spelled out.
"""
from __future__ import annotations

import numpy as np

from .balance import item_costs
from .cost import CostModel
from .select import select
from .types import Candidates, Geometry

HEAVY_SHARE = 0.25   # a document is heavy from this fraction of a rank's fair cost per step


def step_quotas(targets: np.ndarray, available: np.ndarray) -> np.ndarray:
    """Per-source token quotas for one step: the targets, with the shortfall of sources that
    have less than their target moved to the others in proportion to their targets (the same
    rule `select` applies)."""
    targets = np.maximum(np.asarray(targets, dtype=np.float64), 0.0).copy()
    available = np.asarray(available, dtype=np.float64)
    for _ in range(targets.size):
        short = (targets > available) & (targets > 0)
        if not short.any():
            break
        surplus = float((targets[short] - available[short]).sum())
        targets[short] = available[short]
        open_ = available > targets
        if not open_.any():
            break
        share = targets[open_] if targets[open_].sum() > 0 else np.ones(int(open_.sum()))
        targets[open_] += surplus * share / share.sum()
    return targets


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


def select_lookahead(c: Candidates, targets: np.ndarray, geometry: Geometry, cost: CostModel, *,
                     window: int, force_age: int) -> tuple[np.ndarray, np.ndarray]:
    """This step's items out of a `window`-step lookahead. Returns (selected, forced)."""
    R = geometry.ranks
    S = c.num_sources
    targets = np.maximum(np.asarray(targets, dtype=np.float64), 0.0)
    pool = select(c, targets * window, max_age=force_age)
    if pool.size == 0:
        return pool, np.zeros(0, dtype=bool)
    pool = np.sort(pool)                             # candidate order: (source, rank, position)
    length = c.length[pool].astype(np.int64)
    source = c.source[pool].astype(np.int64)
    age = c.age[pool]
    weight = item_costs(c, pool, cost)
    forced = age >= force_age
    available = np.bincount(source, weights=length, minlength=S)
    quota = step_quotas(targets, available)
    step_tokens = float(quota.sum())
    pool_tokens = float(length.sum())
    fair = float(weight.sum()) / pool_tokens * step_tokens / R      # a rank's fair cost per step
    heavy = (weight >= HEAVY_SHARE * fair) & (length <= geometry.capacity)

    used = np.bincount(source[forced], weights=length[forced], minlength=S).astype(np.float64)
    chosen = [np.flatnonzero(forced)]

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
        within = _take_quota(cand, length[cand], source[cand], used.copy(), quota)
        within = cand[np.isin(cand, within)]                          # back to priority order
        if within.size >= want or forced_heavy % R:
            picked = within[:want]
            np.add.at(used, source[picked], length[picked])
            chosen.append(picked)
        else:
            # Not enough for the wanted layers: take the whole layers that are there.
            n = (within.size + forced_heavy) // R * R - forced_heavy
            picked = within[:max(n, 0)]
            np.add.at(used, source[picked], length[picked])
            chosen.append(picked)
    taken = np.zeros(pool.size, dtype=bool)
    taken[np.concatenate(chosen)] = True

    # Light documents fill the quotas in arrival order (round-robin over ranks by position).
    light = np.flatnonzero(~taken & ~heavy)
    light = light[np.lexsort((c.rank[pool[light]], c.position[pool[light]], source[light]))]
    taken[_take_quota(light, length[light], source[light], used, quota)] = True
    # A source made only of heavy documents still gets its quota (quotas stay exact).
    rest = np.flatnonzero(~taken & heavy)
    rest = rest[np.lexsort((rest, -age[rest]))]
    taken[_take_quota(rest, length[rest], source[rest], used, quota)] = True

    selected = np.flatnonzero(taken)
    return pool[selected], forced[selected]
