"""A coordinator loop over fixed windows, for planner tests: every item is offered every step
until taken, and what a step leaves ages by one (as the loader's buffers do)."""
from __future__ import annotations

import numpy as np

from streamload.plan.types import Candidates


def offer_steps(corpus, ages, planner, targets, steps: int) -> list:
    """corpus[r][s]: lists of lengths, ages alike (both changed in place); returns (candidates,
    plan) per step."""
    plans = []
    for step in range(steps):
        c = Candidates.from_windows([[np.array(x, np.int64) for x in rank] for rank in corpus],
                                    [[np.array(x, np.int64) for x in rank] for rank in ages])
        a = planner.assign(c, targets, step)
        plans.append((c, a))
        gone, i = set(a.take.tolist()), 0
        for s in range(c.num_sources):
            for r in range(c.num_ranks):
                keep = [k for k in range(len(corpus[r][s])) if i + k not in gone]
                i += len(corpus[r][s])
                corpus[r][s] = [corpus[r][s][k] for k in keep]
                ages[r][s] = [ages[r][s][k] + 1 for k in keep]
    return plans
