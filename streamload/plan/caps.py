"""Caps per row on what a row feeds the vision encoder: at most `images` images and `patches`
patches in any (rank, row) of a plan (OmniBal's caps per packed group, e.g. 9 images; the
tokens are capped already, at C). They bound the encoder's memory per micro-batch: its
activations grow with the patches, its attention with the patches per image squared.

Pure NumPy. Every planning method plans by tokens and cost; `enforce` then makes the plan obey
the caps, changing it only where a row is over one:

1. rows over a cap give up items, the ones with the most of the capped quantity first, young
   before overdue (an item that waited `force_age` steps stays where it can), until the row
   obeys;
2. each item given up goes to a row of its rank that takes it (tokens, images, patches), else
   to the least loaded rank's (under the planner's cost model): the plan's balance kept;
3. an overdue item no row takes as it is takes the place of young items: a row whose overdue
   items leave room for it (its rank's, else the least loaded rank's) gives up young items,
   largest share first, which are re-placed like the rest;
4. a young item no row takes stays in its buffer, offered again next step with age + 1, like
   any item the plan leaves out;
5. the rows then take, up to the tokens the caps took out, the windows' other whole items
   (oldest first), each on the least loaded rank whose row takes it: the step stays about as
   full as the plan made it.

The deferral bound under caps: an overdue item is left out only when every row's overdue items
alone leave it no room (tokens, images or patches), i.e. when the step's overdue items do not
pack into the rows under the caps; it is then offered next step, still overdue, and placed
oldest first. In particular at most R*M overdue items per step (each within the caps, as every
item is) always keep their place: one row at least holds no other overdue item.

A row keeps at least its last item, and every single item obeys the caps (a sample that alone
exceeds one is refused when it is read, `pipeline/images.py`), so a plan never goes empty. The
step may end under FULL by the items left out: caps bound memory, they come before full steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .types import Candidates, Geometry


@dataclass(frozen=True)
class RowCaps:
    images: Optional[int] = None    # images per row (None: no cap)
    patches: Optional[int] = None   # encoder patches per row (None: no cap)

    @property
    def active(self) -> bool:
        return self.images is not None or self.patches is not None

    def limits(self) -> np.ndarray:
        """float64 [2]: (images, patches); inf where not capped."""
        return np.array([np.inf if self.images is None else self.images,
                         np.inf if self.patches is None else self.patches], dtype=np.float64)


def item_visual(c: Candidates) -> np.ndarray:
    """int64 [n, 2]: each candidate's (images, patches); zeros for text items."""
    n = len(c)
    images = np.zeros(n, np.int64) if c.images is None else c.images.astype(np.int64)
    patches = np.zeros(n, np.int64) if c.patches is None else c.patches.astype(np.int64)
    return np.stack([images, patches], axis=1)


def row_visual(c: Candidates, take, rank, row, geometry: Geometry) -> np.ndarray:
    """int64 [R, M, 2]: each row's images and patches under a plan."""
    R, M = geometry.ranks, geometry.micro_batches
    slot = np.asarray(rank, np.int64) * M + np.asarray(row, np.int64)
    visual = item_visual(c)[np.asarray(take, np.int64)]
    out = np.stack([np.bincount(slot, visual[:, k], minlength=R * M) for k in range(2)], axis=1)
    return out.astype(np.int64).reshape(R, M, 2)


def enforce(c: Candidates, take, rank, row, length, geometry: Geometry, caps: RowCaps,
            force_age: Optional[int] = None, cost=None, eligible: Optional[np.ndarray] = None):
    """(take, rank, row, length) obeying `caps` (see the module): unchanged when no row is
    over a cap. `cost` (the planner's CostModel): moves and the refill go to the least loaded
    rank that takes them (None: the row with the most room). `eligible` (bool per source): the
    sources the refill may take from (None: all)."""
    take = np.asarray(take, np.int64)
    if not caps.active or take.size == 0 or (c.images is None and c.patches is None):
        return take, rank, row, length
    R, M, C = geometry.ranks, geometry.micro_batches, geometry.capacity
    limit = caps.limits()
    all_visual = item_visual(c).astype(np.float64)
    visual = all_visual[take]
    slot = np.asarray(rank, np.int64) * M + np.asarray(row, np.int64)
    load = np.stack([np.bincount(slot, visual[:, k], minlength=R * M) for k in range(2)], 1)
    over = np.flatnonzero((load > limit).any(axis=1))
    if over.size == 0:
        return take, rank, row, length
    length = np.asarray(length, np.int64)
    tokens = np.bincount(slot, length, minlength=R * M).astype(np.int64)
    weight = (cost.doc_cost(c.length) + c.extra_cost) if cost is not None else \
        c.length.astype(np.float64)
    rank_load = np.bincount(slot // M, weight[take], minlength=R).astype(np.float64)
    overdue = np.zeros(take.size, bool) if force_age is None else c.age[take] >= force_age
    # Share of each cap an item takes: the row gives up its largest shares first.
    share = np.where(np.isfinite(limit), visual / np.where(np.isfinite(limit), limit, 1), 0)
    keep = np.ones(take.size, bool)

    def shift(i: int, s: int, sign: int) -> None:
        """Item i's images and patches, tokens and cost into (+1) or out of (-1) slot s."""
        load[s] += sign * visual[i]
        tokens[s] += sign * length[i]
        rank_load[s // M] += sign * weight[take[i]]

    moved = []
    for s in over.tolist():
        members = np.flatnonzero(slot == s)
        order = members[np.lexsort((-share[members].max(axis=1), overdue[members]))]
        for i in order.tolist():
            if (load[s] <= limit).all() or keep[members].sum() <= 1:
                break
            keep[i] = False
            shift(i, s, -1)
            moved.append(i)
    removed = int(length[~keep].sum())

    def place(v, n, w, home: Optional[int]) -> int:
        """The slot for an item of visual `v`, `n` tokens, cost `w`: a row of rank `home` that
        takes it, else the least loaded rank's; -1: none takes it."""
        fits = (tokens + n <= C) & ((load + v) <= limit).all(axis=1)
        if not fits.any():
            return -1
        if home is not None and fits[home * M:(home + 1) * M].any():
            pool = home * M + np.flatnonzero(fits[home * M:(home + 1) * M])
        else:
            pool = np.flatnonzero(fits)
            pool = pool[rank_load[pool // M] == rank_load[pool // M].min()]
        target = int(pool[np.argmin(tokens[pool])])
        load[target] += v
        tokens[target] += n
        rank_load[target // M] += w
        return target

    def evict_for(i: int, home: int) -> Optional[tuple]:
        """Make a row take overdue item i by giving up young items (largest share first): the
        row of rank `home`, else of the least loaded rank, that needs the fewest tokens out.
        Returns (the row, the items given up), the row's load updated for i too, or None when
        no row's overdue items leave room for i."""
        held = keep & (np.arange(take.size) != i)
        fixed = held & overdue
        fixed_load = np.stack([np.bincount(new_slot[fixed], visual[fixed, k], minlength=R * M)
                               for k in range(2)], 1)
        fixed_tokens = np.bincount(new_slot[fixed], length[fixed], minlength=R * M)
        room = (fixed_tokens + length[i] <= C) & ((fixed_load + visual[i]) <= limit).all(axis=1)
        if not room.any():
            return None
        slots = np.flatnonzero(room)
        at_home = slots[slots // M == home]
        if at_home.size:
            slots = at_home
        else:
            slots = slots[rank_load[slots // M] == rank_load[slots // M].min()]
        need = np.maximum(tokens[slots] + length[i] - C, 0)
        target = int(slots[np.argmin(need)])
        young = np.flatnonzero(held & ~overdue & (new_slot == target))
        young = young[np.lexsort((-length[young], -share[young].max(axis=1)))]
        out = []
        for j in young.tolist():
            if tokens[target] + length[i] <= C and (load[target] + visual[i] <= limit).all():
                break
            keep[j] = False
            shift(j, target, -1)
            out.append(j)
        shift(i, target, 1)
        return target, out

    # Re-place what the over rows gave up: overdue (oldest first) and largest first, in a row
    # of the same rank when one takes it (the plan's balance kept), else on the least loaded
    # rank.
    age = c.age[take]
    moved.sort(key=lambda i: (not overdue[i], -int(age[i]) if overdue[i] else 0,
                              -share[i].max(), -length[i], i))
    new_slot = slot.copy()
    for i in moved:
        target = place(visual[i], length[i], weight[take[i]], int(slot[i]) // M)
        if target >= 0:
            keep[i] = True
            new_slot[i] = target
            removed -= int(length[i])
        elif overdue[i]:
            # No row takes an overdue item as it is: a row gives up young items for it (the
            # deferral bound kept), and they go where a row takes them, else back to their
            # buffer. Only when every row's overdue items leave no room does it wait a step.
            made = evict_for(i, int(slot[i]) // M)
            if made is None:
                continue
            keep[i] = True
            new_slot[i], evicted = made
            removed -= int(length[i])
            for j in evicted:
                target = place(visual[j], length[j], weight[take[j]], None)
                if target >= 0:
                    keep[j] = True
                    new_slot[j] = target
                else:
                    removed += int(length[j])
    take, new_slot, length = take[keep], new_slot[keep], length[keep]
    # Refill, up to the tokens the caps took out: the windows' other items in order (oldest
    # first), whole, on the least loaded rank whose row takes them.
    if removed > 0:
        free = np.ones(len(c), bool)
        free[take] = False
        if eligible is not None:
            free &= np.asarray(eligible, bool)[c.source]
        free &= ~c.divisible
        extra_take, extra_slot = [], []
        for i in np.flatnonzero(free)[np.argsort(-c.age[free], kind="stable")].tolist():
            if c.length[i] > removed:
                continue
            target = place(all_visual[i], int(c.length[i]), float(weight[i]), None)
            if target < 0:
                continue
            extra_take.append(i)
            extra_slot.append(target)
            removed -= int(c.length[i])
            if removed <= 0:
                break
        if extra_take:
            take = np.concatenate([take, np.asarray(extra_take, np.int64)])
            new_slot = np.concatenate([new_slot, np.asarray(extra_slot, np.int64)])
            length = np.concatenate([length, c.length[extra_take]])
    return (take, (new_slot // M).astype(np.int32), (new_slot % M).astype(np.int32), length)
