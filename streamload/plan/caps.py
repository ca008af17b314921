"""Caps per row on what a row feeds the vision encoder: at most `images` images and `patches`
patches in any (rank, row) of a plan (OmniBal's caps per packed group, e.g. 9 images; the
tokens are capped already, at C). They bound the encoder's memory per micro-batch: its
activations grow with the patches, its attention with the patches per image squared.

Pure NumPy. Every planning method plans by tokens and cost; `enforce` then makes the plan obey
the caps, changing it only where a row is over one:

1. rows over a cap give up items, the ones with the most of the capped quantity first, young
   before overdue (an item that waited `force_age` steps stays where it can), until the row
   obeys;
2. each item given up goes to the row with the most room (tokens, images, patches) that takes
   it, of its rank first, then any rank (first fit over rows sorted by their load);
3. an item no row takes stays in its buffer, offered again next step with age + 1, like any
   item the plan leaves out.

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
            force_age: Optional[int] = None):
    """(take, rank, row, length) obeying `caps` (see the module): unchanged when no row is
    over a cap."""
    take = np.asarray(take, np.int64)
    if not caps.active or take.size == 0 or (c.images is None and c.patches is None):
        return take, rank, row, length
    R, M, C = geometry.ranks, geometry.micro_batches, geometry.capacity
    limit = caps.limits()
    visual = item_visual(c)[take].astype(np.float64)
    slot = np.asarray(rank, np.int64) * M + np.asarray(row, np.int64)
    load = np.stack([np.bincount(slot, visual[:, k], minlength=R * M) for k in range(2)], 1)
    over = np.flatnonzero((load > limit).any(axis=1))
    if over.size == 0:
        return take, rank, row, length
    length = np.asarray(length, np.int64)
    tokens = np.bincount(slot, length, minlength=R * M).astype(np.int64)
    overdue = np.zeros(take.size, bool) if force_age is None else c.age[take] >= force_age
    # Share of each cap an item takes: the row gives up its largest shares first.
    share = np.where(np.isfinite(limit), visual / np.where(np.isfinite(limit), limit, 1), 0)
    keep = np.ones(take.size, bool)
    moved = []
    for s in over.tolist():
        members = np.flatnonzero(slot == s)
        order = members[np.lexsort((-share[members].max(axis=1), overdue[members]))]
        for i in order.tolist():
            if (load[s] <= limit).all() or keep[members].sum() <= 1:
                break
            keep[i] = False
            load[s] -= visual[i]
            tokens[s] -= length[i]
            moved.append(i)
    # Re-place what the over rows gave up: most overdue and largest first, into the row with
    # the most token room that obeys every cap with it, its own rank first.
    moved.sort(key=lambda i: (not overdue[i], -share[i].max(), -length[i], i))
    new_slot = slot.copy()
    holder = c.rank[take].astype(np.int64)
    for i in moved:
        fits = (tokens + length[i] <= C) & ((load + visual[i]) <= limit).all(axis=1)
        if not fits.any():
            continue
        home = fits & (np.arange(R * M) // M == holder[i])
        pool = np.flatnonzero(home) if home.any() else np.flatnonzero(fits)
        target = int(pool[np.argmin(tokens[pool])])
        keep[i] = True
        new_slot[i] = target
        load[target] += visual[i]
        tokens[target] += length[i]
    return (take[keep], (new_slot[keep] // M).astype(np.int32),
            (new_slot[keep] % M).astype(np.int32), length[keep])
