"""A coordinator loop over fixed windows, for planner tests: every item is offered every step
until taken, and what a step leaves ages by one (as the loader's buffers do)."""
from __future__ import annotations

import numpy as np

from streamload.plan.types import Candidates


def offer_steps(corpus, ages, planner, targets, steps: int) -> list:
    """corpus[r][s]: lists of lengths, ages alike (both changed in place); returns (candidates,
    plan) per step."""
    return offer_loop(corpus, ages, lambda c, step: planner.assign(c, targets, step),
                      lambda a: a.take, steps)


def offer_loop(corpus, ages, choose, taken_of, steps: int) -> list:
    """The loop of `offer_steps` for any chooser: choose(candidates, step) gives a result whose
    taken items are taken_of(result); returns (candidates, result) per step."""
    out = []
    for step in range(steps):
        c = Candidates.from_windows([[np.array(x, np.int64) for x in rank] for rank in corpus],
                                    [[np.array(x, np.int64) for x in rank] for rank in ages])
        result = choose(c, step)
        out.append((c, result))
        gone, i = set(taken_of(result).tolist()), 0
        for s in range(c.num_sources):
            for r in range(c.num_ranks):
                keep = [k for k in range(len(corpus[r][s])) if i + k not in gone]
                i += len(corpus[r][s])
                corpus[r][s] = [corpus[r][s][k] for k in keep]
                ages[r][s] = [ages[r][s][k] + 1 for k in keep]
    return out
