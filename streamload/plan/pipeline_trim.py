"""Under 1F1B, the ranks that wait on one heavy row shed light items (issue 20, pp512).

A rank's step under P pipeline stages takes (sum + (P - 1) * max) / P of its rows' costs
(`cost.pipeline_time`). When a step holds a heavy item the window could not give peers (an
overdue document of a level no other item reaches: 128k, P = 4, R = 512, one 99k document in
a step of light ones), its rank pays the heavy row P times over and its other rows once more:
m + (sum of the others) / P, and the step waits on it. Every row of light items costs about
the same, so no exchange of rows helps; what does is less light work on that rank: each token
taken off its heavy row lowers the rank's time by its cost, each token off its other rows by
a P-th of it. So the slowest rank sheds items one at a time, the most time saved per token
first (the slowest rank taken again after each): to a row with room of another rank that
stays below the slowest rank's new time (a step at `fill.FULL` has a percent of its tokens
free, spread over the rows), else out of the step while it keeps FULL of its tokens. The
changes are kept up to the one where the epoch gained most (`fill.deferral_gain`'s terms: the
step's time saved, less the work and steps the items left out cost later). Items the step
must take (overdue, or taken early for the deferral bound), items cut to fit (a head of a
split document) and items near their bound stay where they are; the items left out wait in
their windows, as the top-up's refusals do, and come in the next steps.

Runs only where rows are the balancer's bins under a pipeline (document masking, P > 1,
M > 1), no caps per row on an image step, and `pipeline_moves` does not run (`Planner.assign` runs one of them: its moves and the
trim together lost at 128k, P = 4, R = 64: seeds 0-2 0.9685 / 0.9544 / 0.9682 with the moves
alone, 0.9568 / 0.9558 / 0.9689 with both), and when the slowest rank is `FROM` above the
step's even time (the work spread over every row: no plan goes below it). At most
`MAX_REMOVALS` rounds a step (each O(R·M)). Deterministic: ties go to the lowest index.
"""
from __future__ import annotations

import numpy as np

from .caps import RowCaps
from .cost import CostModel, pipeline_time
from .fill import FULL
from .types import Candidates, Geometry

FROM = 0.05          # trim only when the slowest rank passes the even time by this share
MAX_REMOVALS = 256   # rounds per step at most (each moves, leaves out or passes over an item)
PATIENCE = 32        # stop after this many changes that did not raise the epoch's gain
NEAR_BOUND = 4       # items within this many steps of the deferral bound stay


def applies(c: Candidates, geometry: Geometry, cost: CostModel, caps: RowCaps = RowCaps()
            ) -> bool:
    """Rows as bins under 1F1B (see the module), and no caps per row to keep on an image step
    (its moves fill rows by tokens: a capped row could pass its images' cap, as
    `pipeline_moves` could)."""
    return (geometry.ranks > 1 and geometry.pipelined and cost.document_masking
            and not (caps.active and c.images is not None))


def trim_slowest(c: Candidates, take: np.ndarray, rank: np.ndarray, row: np.ndarray,
                 length: np.ndarray, geometry: Geometry, cost: CostModel, overhead: float,
                 must: np.ndarray, force_age: int | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stay, rank, row): which of the plan's items stay (bool over `take`) and where. `must`:
    the candidates the step must take (the forced ones, indices); `length`: the tokens taken of
    each item."""
    stay = np.ones(take.size, dtype=bool)
    if take.size == 0:
        return stay, rank, row
    R, M, P, C = geometry.ranks, geometry.micro_batches, geometry.pipeline_stages, \
        geometry.capacity
    budget = max(float(length.sum()) - FULL * geometry.step_tokens, 0.0)
    weight = cost.doc_cost(length.astype(np.float64))
    if c.has_extra_cost:
        weight = weight + c.extra_cost[take]
    cell = rank.astype(np.int64) * M + row
    rc = np.bincount(cell, weights=weight, minlength=R * M).reshape(R, M)
    times = pipeline_time(rc, P)
    even = float(weight.sum()) / R * geometry.work_time
    start = float(times.max())
    if start <= (1 + FROM) * even:
        return stay, rank, row
    room = C - np.bincount(cell, weights=length, minlength=R * M)
    forced = np.zeros(len(c), dtype=bool)
    forced[must] = True
    movable = ~forced[take] & (length == c.length[take])
    if force_age is not None:
        movable &= c.age[take] < force_age - NEAR_BOUND
    order = np.argsort(rank, kind="stable")
    bounds = np.searchsorted(rank[order], np.arange(R + 1))
    work_per = geometry.work_time / R
    rank_of_cell = np.arange(R * M) // M
    flat = rc.reshape(-1)                                      # a view: cells
    rank_sum, rank_max = rc.sum(axis=1), rc.max(axis=1)        # kept for the ranks changed
    done, best, best_gain, work, tokens = [], 0, 0.0, 0.0, 0.0
    for _ in range(MAX_REMOVALS):
        top = int(np.argmax(times))
        items = order[bounds[top]:bounds[top + 1]]
        items = items[movable[items] & stay[items]]
        if items.size == 0:
            break
        rows = rc[top]
        first = int(np.argmax(rows))
        second = float(np.max(np.delete(rows, first), initial=0.0))
        j = row[items]
        w = weight[items]
        other = np.where(j == first, second, rows[first])     # the rank's max without row j
        new = (rows.sum() - w + (P - 1) * np.maximum(rows[j] - w, other)) / P
        saved = (times[top] - new) / length[items]
        pick = int(np.argmax(saved))
        if saved[pick] <= 0:
            break
        i, wi, li = int(items[pick]), float(w[pick]), float(length[items[pick]])
        # A row of another rank with room takes it where that rank stays below the top's new
        # time (the item stays in the step); else it leaves the step, within the budget.
        fits = np.flatnonzero((room >= li) & (rank_of_cell != top))
        to = -1
        if fits.size:
            dest = rank_of_cell[fits]
            after = (rank_sum[dest] + wi +
                     (P - 1) * np.maximum(rank_max[dest], flat[fits] + wi)) / P
            k = int(np.argmin(after))
            if after[k] <= new[pick]:
                to = int(fits[k])
        if to < 0:
            if li > budget - tokens:
                movable[i] = False
                continue
            stay[i] = False
            work += wi
            tokens += li
        else:
            d = to // M
            rc[d, to % M] += wi
            room[to] -= li
            times[d] = pipeline_time(rc[d], P)
            rank_sum[d], rank_max[d] = rc[d].sum(), rc[d].max()
        rc[top, row[i]] -= wi
        rank_sum[top], rank_max[top] = rc[top].sum(), rc[top].max()
        room[top * M + row[i]] += li
        times[top] = new[pick]
        movable[i] = False
        done.append((i, to))
        gain = start - float(times.max()) - work * work_per - overhead * tokens / \
            geometry.step_tokens
        if gain > best_gain:
            best, best_gain = len(done), gain
        elif len(done) - best >= PATIENCE:
            break
    stay = np.ones(take.size, dtype=bool)
    rank, row = rank.copy(), row.copy()
    for i, to in done[:best]:
        if to < 0:
            stay[i] = False
        else:
            rank[i], row[i] = to // M, to % M
    return stay, rank, row
