"""The epoch's last steps: once the head windows hold the rest of the epoch, the heaviest
items go first and the lightest are kept for the last step (issue 20, the epoch's tail).

Why: the lookahead holds a heavy document back until the window gives it peers (a layer,
`lookahead.heavy_layer`). At the epoch's end no peer will come: the held documents are taken
together by the last step, which holds only the remainder of the epoch's tokens. A step of a
few heavy rows is slow whatever the packing: with P pipeline stages a rank's step takes its
costliest row in full, however empty its other rows are (the Loader at 128k, P = 4, R = 4:
the last step held four documents of 117-126k and two of 45k, 0.46 efficient, 16% of the
epoch's loss). A step is even when its rows are alike, so the last steps sort the items:

- **The last step.** Of the `steps_left` steps that the rest needs, all but the last are full,
  so the last holds what is left past them: the lightest items of that many tokens are
  *kept* for it, light items spread evenly over every row.
- **Heaviest first.** Every other step takes its heaviest items first (those kept last),
  each where it fits a row (best fit: `_pack`), whatever their source: all of them must go
  within these steps, and a heavy item of a source with a small quota left for the last step
  would make it a step of one heavy row (the Loader at 128k, R = 4, corpus seed 2: a 120k
  document alone, 0.14 efficient, when the steps took per source within its quota). So the
  heavy documents meet in the first of the last steps, the documents of middling length in
  the next, rows alike in both. The packing stops at `fill.FULL` of the step (the top-up
  fills the rest, as in any step) and looks at `PACK_STEPS` steps' worth of items at most.
  The balancer then places them; where it would leave some out (they would make a step of
  their own at the very end), the packing is the plan (`Planner.assign`), and the moves
  after the plan even it out (`pipeline_moves`, `swaps`).

What it keeps: the overdue items and those that must go now to keep the deferral bound
(`lookahead.bounded_forced`) are taken first; every item of the rest is taken within
`steps_left` steps, so no other item waits longer than the bound allows (an item kept for the
last step that comes due before is forced then); the step's tokens (full steps, the last one
the remainder). Not the mixer's quota per step: these steps deliver all that is left of every
source, so the epoch's mix is the same, only its order within the last steps changes (the
mixer's carry sees what was taken). It runs only where the windows hold the rest
(`Planner.assign`'s `rest_of_epoch`: every window exhausted), and only for the last
`LAST_STEPS` steps: the rest of an epoch that a window holds from its start (a small corpus)
is planned by the lookahead as ever, until its last steps.

Planner CPU: one sort of the candidates and a Python loop over the items packed; the long
tail's corpus at 128k, P = 4, 2.5 steps left: 0.09 s at R = 512, 1.3 s at R = 4,096, for the
(at most `LAST_STEPS`) last steps of an epoch only.
"""
from __future__ import annotations

import bisect
import math

import numpy as np

from .balance import item_costs
from .cost import CostModel
from .fill import FULL
from .lookahead import bounded_forced
from .types import Candidates, Geometry

LAST_STEPS = 4   # the rest of the epoch is sorted when it needs at most this many steps
MAX_ROWS = 256   # R * M at most: measured where it gains (the Loader, R = 2 and 4); a dry run
                 # whose whole corpus is its windows (R = 4,096, 128k, P = 4: 4 steps) fell
                 # from 0.986 to 0.826, mix 0.13, 1.7 s a step: the per-item packing loop
PACK_STEPS = 2   # the packing looks at this many steps' worth of the heaviest items at most


def steps_left(c: Candidates, geometry: Geometry, pool: np.ndarray) -> int:
    """How many steps the items of `pool` need at least, every step full."""
    return math.ceil(float(c.length[pool].sum()) / geometry.step_tokens)


def select_last_steps(c: Candidates, geometry: Geometry, cost: CostModel,
                      force_age: int | None, eligible: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(selected, forced, cell) for a step whose candidates are the rest of the epoch, as the
    module says, with `cell` (rank * M + row per selected item) a packing that places every
    one of them; None where it does not apply (more than `MAX_ROWS` rows, the rest needs
    more than `LAST_STEPS` steps, or an overdue item finds no row). `eligible` (bool per
    source; None: all): the sources the schedule gives a share now (the others' items wait,
    as they do in the top-up, but those the deferral bound forces, as in the lookahead)."""
    if geometry.rows > MAX_ROWS:
        return None
    forced = bounded_forced(c, force_age, geometry.step_tokens // 2) if force_age is not None \
        else np.zeros(len(c), dtype=bool)
    pool = forced | (True if eligible is None else np.asarray(eligible, dtype=bool)[c.source])
    left = steps_left(c, geometry, pool)
    if not 1 <= left <= LAST_STEPS:
        return None
    step_tokens = float(geometry.step_tokens)
    weight = item_costs(c, None, cost)
    rest = np.flatnonzero(pool & ~forced)
    if left > 1:   # the lightest items wait for the last step: what the full steps leave
        keep = float(c.length[pool].sum()) - (left - 1) * step_tokens
        rest = rest[~np.isin(rest, _kept_last(c, rest, weight, keep))]
    must = np.flatnonzero(forced)
    rest = rest[np.lexsort((rest, -weight[rest]))]
    # The packing looks at `PACK_STEPS` steps' worth of them at most: rows with room after
    # those take what is left in the top-up, as in any step (3·10^6 items in Python: seconds).
    rest = rest[np.cumsum(c.length[rest]) - c.length[rest] < PACK_STEPS * step_tokens]
    order = np.concatenate([must[np.lexsort((must, -c.length[must]))], rest])
    cell = _pack(c, order, forced, geometry)
    if cell is None:
        return None
    selected = np.flatnonzero(cell >= 0)
    return selected, forced[selected], cell[selected]


def _kept_last(c: Candidates, items: np.ndarray, weight: np.ndarray, keep: float
               ) -> np.ndarray:
    """Of `items`, the lightest whose tokens stay within `keep`."""
    light_first = items[np.argsort(weight[items], kind="stable")]   # ties: index order
    return light_first[np.cumsum(c.float_length[light_first]) <= max(keep, 0.0)]


def _pack(c: Candidates, order: np.ndarray, forced: np.ndarray, geometry: Geometry
          ) -> np.ndarray | None:
    """Per candidate, the row (rank * M + row) it goes to, -1 for those left: `order`'s items
    in turn, each to the row with the least room that holds it (best fit: the rows' costs are
    the balancer's to even out, this is only which items fit). None when a forced item finds
    no row."""
    R, M, C = geometry.ranks, geometry.micro_batches, geometry.capacity
    cell = np.full(len(c), -1, dtype=np.int64)
    rooms = [(C, r) for r in range(R * M)]            # (room, row), ascending
    # Done once the step is full (the top-up tops it up), or no row has room for the shortest
    # item left (at R = 4096 the order holds 10^5 items of which 3·10^4 fit).
    shortest = np.minimum.accumulate(c.length[order][::-1])[::-1].tolist()
    full, total = FULL * R * M * C, 0
    for k, i in enumerate(order.tolist()):
        if not forced[i] and (total >= full or rooms[-1][0] < shortest[k]):
            break
        n = int(c.length[i])
        at = bisect.bisect_left(rooms, (n, -1))
        if at == len(rooms):
            if forced[i]:
                return None
            continue
        room, r = rooms.pop(at)
        bisect.insort(rooms, (room - n, r))
        cell[i] = r
        total += n
    return cell
