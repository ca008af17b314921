"""What the `streamload` logger says about a run (quiet unless the application configures
logging; nothing per step unless something is wrong):

- INFO at start: each source's shards, how many this rank reads, its format; the memory budget.
- WARNING: a source with fewer shards than the ranks reading it; a finite source at weight 0
  that a restarting source keeps from ever being read; LOW_FILL_STREAK steps in a row
  below LOW_FILL of a full step (once per streak); each source as it runs out of data for the
  epoch, and what happens next (its on_exhausted policy); the run stopping for a "stop" source.

Loop-owned, like the Runtime that calls it.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from .collective.comm import Comm
from .config import Source
from .metrics import LOW_FILL
from .plan.types import Candidates
from .job import JobModel, RankShare

LOW_FILL_STREAK = 20      # steps in a row below LOW_FILL (metrics.py) worth a warning
NEXT = {"renormalize": "the other sources take its share", "stop": "the run stops",
        "restart": "it starts its next pass"}

log = logging.getLogger("streamload")


class RunWatch:
    def __init__(self, sources: Sequence[Source], job: "JobModel | RankShare", comm: Comm):
        self.sources, self.comm = list(sources), comm
        self.stepper, self.job = job.stepper, job
        self.short_steps = 0                 # steps in a row below LOW_FILL
        self.sources_out: set[int] = set()   # sources that ran out this epoch

    def started(self, shards: Sequence[Sequence]) -> None:
        R, memory = self.comm.world, self.stepper.memory
        for s, source in enumerate(self.sources):
            count = self.job.virtual_shards(s)
            mine = self.job.units_on(s, self.comm.rank)
            log.info("source %r (%s): %d shard(s), %d on rank %d of %d, weight %g, "
                     "format %s", source.name, source.uri, count, mine, self.comm.rank, R,
                     source.weight, shards[s][0].format.name if shards[s] else "-")
            if count < R:
                log.warning("source %r has %d shard(s) for %d ranks: %d rank(s) read "
                            "none of it and the others read its records in ranges; more shards "
                            "spread the reading", source.name, count, R, R - count)
        self._never_read()
        log.info("memory budget %d bytes per rank; buffers of %s tokens",
                 memory.budget, [b.capacity_tokens for b in self.job.budgets(self.comm.rank)])

    def _never_read(self) -> None:
        """A finite source at weight 0 is read only once the weighted sources run out; next to
        a weighted source that never does (on_exhausted="restart") at every schedule point, it
        is never read, and its epoch never ends (docs/mixing.md)."""
        table = self.stepper.mixer.schedule.table   # [points, sources]
        restart = np.array([source.on_exhausted == "restart" for source in self.sources])
        if not (table[:, restart] > 0).any(axis=1).all():
            return
        endless = [self.sources[s].name for s in np.flatnonzero(restart).tolist()]
        for s in np.flatnonzero(~restart & (table == 0).all(axis=0)).tolist():
            log.warning("source %r has weight 0 at every point of the mix while %s "
                        "never run(s) out (on_exhausted='restart'): it is never read and its "
                        "epoch never ends; give it a weight, or a schedule point that does",
                        self.sources[s].name, endless)

    def step(self, step: int, tokens: float) -> None:
        fill = tokens / self.stepper.geometry.step_tokens
        self.short_steps = self.short_steps + 1 if fill < LOW_FILL else 0
        if self.short_steps == LOW_FILL_STREAK:
            log.warning("%d steps in a row below %.0f%% full (step %d: %.2f): the "
                        "windows hold too little data for full steps; stats()['sources'] shows "
                        "which source the steps wait for (docs/metrics.md)", LOW_FILL_STREAK,
                        LOW_FILL * 100, step, fill)
        for s in np.flatnonzero(~self.stepper.holding.any(axis=0)).tolist():
            if s not in self.sources_out:
                self.sources_out.add(s)
                source = self.sources[s]
                log.warning("source %r ran out of data for epoch %d at step %d "
                            "(on_exhausted=%r): %s", source.name, self.stepper.epoch, step,
                            source.on_exhausted, NEXT[source.on_exhausted])

    def new_epoch(self) -> None:
        self.sources_out.clear()

    def stopped(self, candidates: Candidates) -> None:
        present = set(np.unique(candidates.source).tolist())
        gone = [src.name for s, src in enumerate(self.sources)
                if src.on_exhausted == "stop" and s not in present]
        log.warning("the run stops at step %d: source(s) %s ran out "
                    "(on_exhausted='stop')", self.stepper.step, gone)
