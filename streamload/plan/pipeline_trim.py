"""Under 1F1B, the ranks that wait on one heavy row give up light items (issue 20, pp512).

A rank's step under P pipeline stages takes (sum + (P - 1) * max) / P of its rows' costs
(`cost.pipeline_time`). When a step holds a heavy item the window could not give peers (an
overdue document of a level no other item reaches: 128k, P = 4, R = 512, one 99k document in
a step of light ones), its rank pays the heavy row P times over and its other rows once more:
m + (sum of the others) / P, and the step waits on it. No move of whole items helps
(`pipeline_moves.py`): every row of light items costs about the same. What does help is the
light work on that rank: each token taken off its heavy row lowers the rank's time by its
cost, each token taken off its other rows by a P-th of it. So the slowest ranks give up items
(the best time saved per token first) while the step still holds FULL of its tokens
(`fill.FULL`: a step stays full), and the trim is kept only as far as the epoch gains
(`fill.deferral_gain`: the step's time saved, less the work and steps the items cost later).
Items the step must take (overdue or taken early for the deferral bound), items cut to fit
(a head of a split document) and items near their bound stay; the rest are left in their
windows, as the top-up leaves items out, and come in the next steps.

Runs only where rows are the balancer's bins under a pipeline (document masking, P > 1,
M > 1) and the slowest rank is `FROM` above the step's even time (the work spread over every
row: no plan goes below it). Deterministic: ties go to the lowest index.
"""
from __future__ import annotations

import numpy as np

from .cost import CostModel, pipeline_time
from .fill import FULL
from .types import Candidates, Geometry

FROM = 0.05          # trim only when the slowest rank passes the even time by this share
MAX_REMOVALS = 256   # items given up per step at most
PATIENCE = 32        # stop after this many removals that did not raise the epoch's gain
NEAR_BOUND = 4       # items within this many steps of the deferral bound stay


def applies(geometry: Geometry, cost: CostModel) -> bool:
    """Rows as bins under 1F1B (see the module)."""
    return geometry.ranks > 1 and geometry.pipelined and cost.document_masking


def trim_slowest(c: Candidates, take: np.ndarray, rank: np.ndarray, row: np.ndarray,
                 length: np.ndarray, geometry: Geometry, cost: CostModel, overhead: float,
                 must: np.ndarray, force_age: int | None) -> np.ndarray:
    """Which of the plan's items stay (bool over `take`). `must`: the candidates the step must
    take (the forced ones, indices); `length`: the tokens taken of each item."""
    stay = np.ones(take.size, dtype=bool)
    budget = float(length.sum()) - FULL * geometry.step_tokens
    if budget <= 0 or take.size == 0:
        return stay
    R, M, P = geometry.ranks, geometry.micro_batches, geometry.pipeline_stages
    weight = cost.doc_cost(length.astype(np.float64))
    if c.has_extra_cost:
        weight = weight + c.extra_cost[take]
    cell = rank.astype(np.int64) * M + row
    rc = np.bincount(cell, weights=weight, minlength=R * M).reshape(R, M)
    times = pipeline_time(rc, P)
    even = float(weight.sum()) / R * geometry.work_time
    start = float(times.max())
    if start <= (1 + FROM) * even:
        return stay
    forced = np.zeros(len(c), dtype=bool)
    forced[must] = True
    movable = ~forced[take] & (length == c.length[take])
    if force_age is not None:
        movable &= c.age[take] < force_age - NEAR_BOUND
    order = np.argsort(rank, kind="stable")
    bounds = np.searchsorted(rank[order], np.arange(R + 1))
    work_per = geometry.work_time / R
    removed, best, best_gain, work, tokens = [], 0, 0.0, 0.0, 0.0
    for _ in range(MAX_REMOVALS):
        top = int(np.argmax(times))
        items = order[bounds[top]:bounds[top + 1]]
        items = items[movable[items] & stay[items] & (length[items] <= budget - tokens)]
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
        i = int(items[pick])
        stay[i] = False
        removed.append(i)
        rc[top, row[i]] -= weight[i]
        times[top] = new[pick]
        work += float(weight[i])
        tokens += float(length[i])
        gain = start - float(times.max()) - work * work_per - overhead * tokens / \
            geometry.step_tokens
        if gain > best_gain:
            best, best_gain = len(removed), gain
        elif len(removed) - best >= PATIENCE:
            break
    stay[removed[best:]] = True
    return stay
