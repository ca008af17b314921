"""Resume checks shared by the resume tests: stop anywhere, resume from the state, compare."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


def flat(batch):
    """A batch as plain data: per micro-batch, its sample ids and token sum."""
    return [(tuple(mb.sample_ids), int(mb.tokens.sum())) for mb in batch.micro_batches]


@dataclass
class Resumed:
    full: list             # the uninterrupted run's batches (`flat`)
    head: list             # the first `stop` of them, from a run stopped there
    tail: list             # the rest, from a fresh loader resumed from that run's state
    full_stats: dict       # stats() of the uninterrupted run, and of the resumed one
    resumed_stats: dict


def full_run(make_loader: Callable) -> tuple[list, dict]:
    with make_loader() as loader:
        return [flat(b) for b in loader], loader.stats()


def stop_and_resume(make_loader: Callable, stop: int, full=None,
                    on_resume: Optional[Callable[[], None]] = None) -> Resumed:
    """Run `stop` batches, take the state, resume a fresh loader from it to the end.
    `full`: the uninterrupted run's (batches, stats), when already known; `on_resume` is called
    just before the resumed loader is built."""
    full, full_stats = full or full_run(make_loader)
    with make_loader() as loader:
        head = [flat(b) for _, b in zip(range(stop), loader)]
        state = loader.state_dict()
    if on_resume is not None:
        on_resume()
    with make_loader() as loader:
        loader.load_state_dict(state)
        tail = [flat(b) for b in loader]
        return Resumed(full, head, tail, full_stats, loader.stats())


def resume_divergence(make_loader: Callable, stops) -> tuple[int, dict]:
    """Per stop k: the first k batches, then a fresh loader resumed from the state; compare with
    an uninterrupted run. Returns (steps of the full run, {stop: first differing step})."""
    full = full_run(make_loader)
    diverged = {}
    for stop in stops:
        run = stop_and_resume(make_loader, stop, full)
        if run.head + run.tail != run.full:
            diverged[stop] = next(i for i, (a, b) in enumerate(zip(run.full, run.head + run.tail))
                                  if a != b)
    return len(full[0]), diverged
