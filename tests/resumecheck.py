"""Resume checks shared by the resume tests: stop anywhere, resume from the state, compare."""
from __future__ import annotations

from typing import Callable


def flat(batch):
    """A batch as plain data: per micro-batch, its sample ids and token sum."""
    return [(tuple(mb.sample_ids), int(mb.tokens.sum())) for mb in batch.micro_batches]


def resume_divergence(make_loader: Callable, stops) -> tuple[int, dict]:
    """Per stop k: the first k batches, then a fresh loader resumed from the state; compare with
    an uninterrupted run. Returns (steps of the full run, {stop: first differing step})."""
    with make_loader() as loader:
        full = [flat(b) for b in loader]
    diverged = {}
    for stop in stops:
        with make_loader() as loader:
            head = [flat(b) for _, b in zip(range(stop), loader)]
            state = loader.state_dict()
        with make_loader() as loader:
            loader.load_state_dict(state)
            tail = [flat(b) for b in loader]
        if head + tail != full:
            diverged[stop] = next(i for i, (a, b) in enumerate(zip(full, head + tail)) if a != b)
    return len(full), diverged
