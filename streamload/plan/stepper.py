"""The step machine: what the job does each step, decided from the gathered head windows.

One `Stepper` per job, built once from (config, sources, mixture, world). It owns everything
that must evolve identically on every rank, and in the dry run: the mixer's carried deficits and
schedule position, the step and epoch counters, which ranks still hold data of each source, and
the head-window sizes that follow from it. Pure NumPy, no I/O; the loader's `Runtime` and the
dry run (`commands/dryrun/simulate.py`) both drive it, and differ only in where the windows'
lengths come from (buffers filled by fetchers, or scanned lengths).

    stepper = Stepper.build(config, sources, mixture, world)
    stepper.start_epoch(holding)                    # [R, S]: ranks dealt data of each source
    step = stepper.begin(candidates, exhausted)     # every rank: the outcome and the quota
    assignment = stepper.assign(step)               # one rank (rank 0), or the dry run
    stepper.commit(step, take, length)              # every rank: what the step took
    stepper.end_epoch()                             # after an "end_epoch" outcome

`begin` returns outcome "continue" (plan the step), "end_epoch" (every finite source ran out:
call `end_epoch`, then `finished` says whether the run ends) or "stop" (a source with
on_exhausted="stop" ran out: the run ends).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from .caps import RowCaps
from .cost import CostModel
from .memory import MemoryPlan, SourceBudget, source_token_bytes
from .planner import Planner
from .quota_mixer import MixtureState, QuotaMixer, StepQuota
from .types import Assignment, Candidates, Geometry

if TYPE_CHECKING:
    from ..config import LoaderConfig, Source
    from .mix_spec import Mixture


@dataclass(frozen=True)
class Step:
    """One step begun: the outcome and, to continue, the quota (on the step's candidates)."""
    index: int
    outcome: str                     # "continue" | "end_epoch" | "stop"
    candidates: Candidates
    exhausted: np.ndarray            # bool [R, S]: the window holds the rest of the epoch
    quota: Optional[StepQuota]       # None unless outcome == "continue"


@dataclass(frozen=True)
class StepParts:
    """What steps are made with, without the job's [R, S] state: the geometry, the planner (and
    its cost model), the mixer and the memory plan. A rank that does not step the job keeps
    these alone (`job.RankShare`)."""
    geometry: Geometry
    planner: Planner
    mixer: QuotaMixer
    memory: MemoryPlan

    @classmethod
    def build(cls, config: "LoaderConfig", sources: Sequence["Source"],
              mixture: Optional["Mixture"], world: int) -> "StepParts":
        geometry = Geometry(world, config.micro_batches, config.micro_batch_tokens,
                            config.pipeline_stages or 1)
        cost = CostModel(config.cost_a, config.cost_b, config.document_masking)
        planner = Planner(geometry, cost, method=config.planner, seed=config.seed,
                          max_age=config.max_deferral, lookahead=config.lookahead,
                          step_overhead=config.step_overhead,
                          caps=RowCaps(config.max_images_per_row, config.max_patches_per_row))
        mixer = QuotaMixer.from_sources(mixture, sources, capacity=config.micro_batch_tokens)
        # Built here, so a budget too small for the geometry fails when the Loader is built.
        memory = MemoryPlan(config, mixer.max_shares(), [s.name for s in sources], world,
                            source_token_bytes(sources))
        return cls(geometry, planner, mixer, memory)

    @property
    def cost(self) -> CostModel:
        return self.planner.cost


class Stepper:
    def __init__(self, geometry: Geometry, planner: Planner, mixer: QuotaMixer, memory: MemoryPlan,
                 epochs: Optional[int] = None):
        self.geometry, self.planner, self.mixer, self.memory = geometry, planner, mixer, memory
        self.epochs = epochs            # None: as many as the data has
        self.step = 0                   # steps taken, over all epochs (the schedule's clock)
        self.epoch = 0
        self.holding = np.ones((geometry.ranks, mixer.num_sources), dtype=bool)   # [R, S]
        self.reads = np.ones_like(self.holding)      # [R, S]: rank r reads source s at all
        self._sized_for: Optional[bytes] = None      # (holding, shares) the budgets are for
        self._budgets: list[list[SourceBudget]] = []  # [R][S], for `_sized_for`

    @classmethod
    def build(cls, config: "LoaderConfig", sources: Sequence["Source"],
              mixture: Optional["Mixture"], world: int) -> "Stepper":
        parts = StepParts.build(config, sources, mixture, world)
        return cls(parts.geometry, parts.planner, parts.mixer, parts.memory, config.epochs)

    @property
    def cost(self) -> CostModel:
        return self.planner.cost

    # -- resumption ------------------------------------------------------------------------------
    def restore(self, epoch: int, step: int, mixture: Optional[MixtureState],
                holding: Optional[np.ndarray]) -> None:
        """Continue from a saved state (`holding`: None when saved at another world size; then
        `start_epoch` sets it from the layouts)."""
        self.epoch, self.step = epoch, step
        if mixture is not None:
            self.mixer.load_state(mixture)
        if holding is not None:
            self.holding = np.asarray(holding, dtype=bool).reshape(self.holding.shape)

    def set_readers(self, reads: np.ndarray) -> None:
        """[R, S]: which ranks read each source (`plan/readers.py`): a rank that does not
        gets no buffer for it (`MemoryPlan.budgets`)."""
        self.reads = np.asarray(reads, dtype=bool).reshape(self.holding.shape)
        self._sized_for = None

    # -- the step ----------------------------------------------------------------------------------
    def start_epoch(self, holding: np.ndarray) -> None:
        """An epoch's start: `holding[r, s]`, rank r was dealt data of source s."""
        self.holding = np.asarray(holding, dtype=bool).reshape(self.holding.shape)

    def begin(self, candidates: Candidates, exhausted: np.ndarray) -> Step:
        has_data = np.bincount(candidates.source, minlength=self.mixer.num_sources) > 0
        outcome = self.mixer.outcome(has_data, exhausted)
        quota = None
        if outcome == "continue":   # every rank: the quota moves the schedule and the carries
            quota = self.mixer.quota(candidates, self.geometry.step_tokens, self.step)
        return Step(self.step, outcome, candidates, np.asarray(exhausted, dtype=bool), quota)

    def assign(self, step: Step) -> Assignment:
        """Select and place the step's items (the planner). Deterministic: any rank would get the
        same answer, so one rank computes it and tells the others."""
        return self.planner.assign_quota(step.quota, step.index,
                                         rest_of_epoch=bool(step.exhausted.all()))

    def commit(self, step: Step, take: np.ndarray, length: np.ndarray) -> np.ndarray:
        """The step took candidates `take`, `length` tokens of each (fewer than the item holds:
        cut, its rest stays in its window). Returns the realized units per source."""
        units = self.mixer.update(step.quota, take, length)
        whole = take[length == step.candidates.length[take]]
        self.holding = self.holding_after(step.candidates, whole, step.exhausted)
        self.step += 1
        return units

    def end_epoch(self) -> None:
        self.epoch += 1
        self.mixer.new_epoch()

    @property
    def finished(self) -> bool:
        """The run has done its `epochs`."""
        return self.epochs is not None and self.epoch >= self.epochs

    @staticmethod
    def holding_after(c: Candidates, take: np.ndarray, done: np.ndarray) -> np.ndarray:
        """[R, S]: after a step that took `take`, which ranks still hold data of each source:
        items left in the window, or more to come (`done[r, s]` false). Both are functions of
        the gathered windows and the plan, so every rank derives the same answer."""
        R, S = done.shape
        left = np.ones(len(c), dtype=bool)
        left[take] = False
        remaining = np.bincount(c.rank[left].astype(np.int64) * S + c.source[left],
                                minlength=R * S).reshape(R, S)
        return (remaining > 0) | ~np.asarray(done, dtype=bool)

    # -- head windows ------------------------------------------------------------------------------
    def budgets(self, rank: int) -> list[SourceBudget]:
        """Rank `rank`'s buffers for the next step (`MemoryPlan`): from the mix's shares and the
        ranks holding data, worked out again only when either changed (most steps, neither)."""
        return self._all_budgets()[rank]

    def window_tokens(self) -> np.ndarray:
        """int64 [R, S]: every rank's head window for the next step."""
        return np.array([[b.window_tokens for b in rank] for rank in self._all_budgets()],
                        dtype=np.int64).reshape(self.holding.shape)

    def _all_budgets(self) -> list[list[SourceBudget]]:
        shares = self.mixer.shares_at(self.holding.any(axis=0))
        key = self.holding.tobytes() + shares.tobytes()
        if key != self._sized_for:
            self._sized_for = key
            holders = self.holding.sum(axis=0)
            # Ranks holding (reading) the same sources get the same budgets: each distinct row once.
            S = self.holding.shape[1]
            # (rows packed into bytes: np.unique over [R, 2S] bools took 0.4 s at R=4,096, S=300)
            both = np.concatenate([self.holding, self.reads], axis=1)
            packed = np.ascontiguousarray(np.packbits(both, axis=1))
            keys = packed.view(np.dtype((np.void, packed.shape[1]))).reshape(-1)
            _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
            sized = [self.memory.budgets(shares, holders, both[i, :S], both[i, S:])
                     for i in first.tolist()]
            self._budgets = [sized[i] for i in np.asarray(inverse).reshape(-1)]
        return self._budgets
