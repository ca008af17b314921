"""One entry point for planning a step: select by quota, then assign to (rank, row).

Methods:
- ``naive``: arrival order, about equal tokens per rank (the baseline that loaders use today).
- ``balanced``: the same selection, assigned to minimize the largest per-rank cost
  (`balance.assign_balanced`).
- ``lookahead``: selection over a window of `lookahead` steps so that documents costlier than a
  rank's share land in steps where they balance (`lookahead.select_lookahead`), then assigned
  like ``balanced``. No item waits more than 2·`lookahead` steps (or `max_age`, when smaller).
  In an epoch's last steps, once the windows hold the rest, the heaviest items go first and
  the lightest wait for the last step (`epoch_end.select_last_steps`).

On one rank every method plans as ``naive`` does (`Planner.effective_method`): there is nothing
to balance. Every method fills its steps (`fill.top_up`): full steps are the loader's guarantee.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .balance import assign_balanced
from .caps import RowCaps, enforce
from .cost import CostModel
from .epoch_end import select_last_steps
from .fill import FULL, Leftovers, epoch_cost, step_overhead_cost, top_up
from .lookahead import select_lookahead
from .naive import assign_naive, finish
from .pipeline_moves import applies as moves_apply, pipeline_moves
from .pipeline_trim import applies as trim_applies, trim_slowest
from .select import select
from .swaps import applies as swaps_apply, refine_swaps
from .types import Assignment, Candidates, Geometry

# The planning methods: the one list of them. `LoaderConfig.planner` has this type and is
# validated there, once; the planner trusts it.
PlannerMethod = Literal["naive", "balanced", "lookahead"]
METHODS: tuple[str, ...] = typing.get_args(PlannerMethod)
NAIVE_CHECK_ITEMS = 64   # up to this many items, a cost-aware plan is never worse than naive
# The lookahead's deferral bound, in windows of W steps. Its windows hold W steps of each
# source's share, so with exact consumption the last item of a window already waits W steps:
# a bound of one window left no slack, the overdue items outgrew the step (the bound did not
# hold: ages of 7 at W = 4) and, taken past their quotas, pushed the mix off by 0.02-0.03.
DEFERRAL_WINDOWS = 2
SWAPS = True   # ranks as bins: `swaps.refine_swaps` after the caps (False: the plan as made)
PIPELINE_MOVES = True   # rows as bins under 1F1B: `pipeline_moves` after the caps (False: as made)
EPOCH_END = True    # the lookahead sorts the epoch's last steps (`epoch_end.py`; False: as ever)
PIPELINE_TRIM = True    # under 1F1B the slowest ranks give up light items (`pipeline_trim`, last)


def overdue_first(c: Candidates, selected: np.ndarray, force_age: int | None) -> np.ndarray:
    """`selected` with the overdue items (age >= `force_age`) moved to the front, longest first
    (first-fit-decreasing places them all while they take at most half the step), the rest in
    their order. `select` puts overdue items first within their source only, so an arrival-order
    fill could fill a row with another source's item first and leave an overdue one out."""
    if force_age is None or selected.size == 0:
        return selected
    overdue = c.age[selected] >= force_age
    if not overdue.any():
        return selected
    first = selected[overdue]
    first = first[np.argsort(-c.length[first], kind="stable")]
    return np.concatenate([first, selected[~overdue]])


@dataclass
class Planner:
    geometry: Geometry
    cost: CostModel
    method: str = "naive"
    seed: int = 0
    max_age: int | None = None   # an item offered this many steps is selected first
    lookahead: int = 8           # W: steps the lookahead method plans over
    step_overhead: float = 0.05  # per-step overhead, as a fraction of a rank's full linear step
    caps: RowCaps = RowCaps()    # images / patches per row (`caps.py`); none by default

    def __post_init__(self):
        # `method` and `lookahead` come validated from LoaderConfig (config.py).
        self.overhead = step_overhead_cost(self.step_overhead, self.geometry, self.cost)

    def _max_cost(self, c: Candidates, take, rank, row) -> float:
        return float(finish(c, take, rank, row, self.geometry, self.cost).step_time.max())

    def _epoch_cost(self, c: Candidates, take, rank, row, length) -> float:
        plan = finish(c, take, rank, row, self.geometry, self.cost, length)
        return epoch_cost(plan.step_time, float(plan.rank_cost.sum()), int(length.sum()),
                          self.geometry, self.overhead)

    def _fill(self, c: Candidates, selected, take, rank, row, eligible=None):
        """`top_up` with what the plan left: the step's leftovers, then the windows of the
        `eligible` sources (bool per source; None: all). A step already FULL is left as it is
        (and its leftovers are not looked at)."""
        length = c.length[take]
        if length.sum() >= FULL * self.geometry.step_tokens:
            return take, rank, row, length
        pool = Leftovers(c, selected, take, eligible)   # worked out as far as it is read
        return top_up(c, take, rank, row, pool, self.geometry, self.cost, overhead=self.overhead,
                      cost_aware=self.effective_method != "naive")

    @property
    def effective_method(self) -> str:
        """The method that plans: `method`, except on one rank, where there is nothing to
        balance and a slot left empty never pays (fill.py): every method plans the naive way
        there (its deferral bound kept), so balanced and lookahead cost the same as naive."""
        return "naive" if self.geometry.ranks == 1 else self.method

    @property
    def force_age(self) -> int | None:
        """Age from which an item must be taken this step (None: no bound)."""
        if self.method == "lookahead":
            bound = DEFERRAL_WINDOWS * self.lookahead
            return bound if self.max_age is None else min(self.max_age, bound)
        return self.max_age

    def assign_quota(self, quota, step: int, rest_of_epoch: bool = False) -> Assignment:
        """Plan a `QuotaMixer` step (a `StepQuota`). A mixture by samples is selected by sample
        counts, so it stays exact when overdue items jump their source's queue; the lookahead
        method plans in tokens (the quota's token targets). `rest_of_epoch`: the candidates
        are all the epoch has left (every window exhausted)."""
        # A source the schedule gives no share now sits the step out: the top-up must not
        # fill rows from it either (a curriculum's source at weight 0 waits for its stage).
        eligible = quota.shares[quota.virtual_source] > 0
        if quota.counts is not None and self.method != "lookahead":
            return self.assign(quota.candidates, quota.targets, step, counts=quota.counts,
                               eligible=eligible)
        return self.assign(quota.candidates, quota.token_targets, step, eligible=eligible,
                           rest_of_epoch=rest_of_epoch)

    def assign(self, c: Candidates, targets: np.ndarray, step: int,
               counts: np.ndarray | None = None, eligible: np.ndarray | None = None,
               rest_of_epoch: bool = False) -> Assignment:
        """`targets[s]`: tokens of source s this step; with `counts` (what each candidate counts
        toward its source's target, as in `select`), targets in that unit (naive, balanced).
        `eligible` (bool per source; None: all): the sources the top-up may fill rows from.
        `rest_of_epoch`: `c` holds all the epoch has left; the lookahead then sorts its last
        steps (`epoch_end.select_last_steps`)."""
        if counts is not None and self.method == "lookahead":
            raise ValueError("the lookahead method plans token targets only")
        method = self.effective_method
        eligible = None if eligible is None else np.asarray(eligible, dtype=bool)
        forced = last = None
        if method == "naive":
            selected = select(c, targets, max_age=self.force_age, counts=counts)
            take, rank, row = assign_naive(c, overdue_first(c, selected, self.force_age),
                                           self.geometry)
        elif method == "balanced":
            selected = select(c, targets, max_age=self.max_age, counts=counts)
            forced = None if self.max_age is None else c.age[selected] >= self.max_age
            take, rank, row = assign_balanced(c, selected, self.geometry, self.cost, forced=forced,
                                              overhead=self.overhead)
        else:   # "lookahead" (LoaderConfig.planner is one of METHODS)
            last = select_last_steps(c, self.geometry, self.cost, self.force_age,
                                     eligible) if rest_of_epoch and EPOCH_END else None
            selected, forced = last[:2] if last is not None else select_lookahead(
                c, targets, self.geometry, self.cost, window=self.lookahead,
                force_age=self.force_age, eligible=eligible)
            take, rank, row = assign_balanced(c, selected, self.geometry, self.cost, forced=forced,
                                              overhead=self.overhead)
            if last is not None and len(take) < len(selected):
                # The epoch's last steps (epoch_end.py): their packing where the balancer
                # leaves items out (those would make a step of their own at the very end).
                M = self.geometry.micro_batches
                take, rank, row = selected, (last[2] // M).astype(np.int32), \
                    (last[2] % M).astype(np.int32)
        if method != "naive" and 0 < len(take) == len(selected) <= NAIVE_CHECK_ITEMS:
            # The cost-aware heuristics can, rarely, end a little above the plain arrival-order
            # fill (hypothesis found 2014 against 1949 with 22 items). For a few dozen items
            # that fill costs little (0.2 ms): when it places everything too and its largest rank
            # cost is lower, it is the plan. (At 64 ranks and 16k items it would cost 70 ms.)
            naive = assign_naive(c, selected, self.geometry)
            if len(naive[0]) == len(selected) and self._max_cost(c, *naive) < \
                    self._max_cost(c, take, rank, row):
                take, rank, row = naive
        # Full steps: rows with room take what is left (module fill.py), unless leaving it
        # out gains the epoch.
        # Every item the method must take: the overdue ones, and those the lookahead takes a
        # step early to keep the next steps' overdue items placeable.
        must = selected[forced] if forced is not None else \
            selected[c.age[selected] >= self.force_age] if self.force_age is not None \
            else selected[:0]
        take, rank, row, length = self._fill(c, selected, take, rank, row, eligible)
        if method != "naive" and length.sum() < FULL * self.geometry.step_tokens \
                and last is None:   # (the last steps' packing is their alternative)
            # Cost-aware assignment evens out rows; with items near C that can leave no row
            # with room for what is left. The same selection packed largest first (first-fit
            # decreasing) and filled up is the alternative: the plan that costs the epoch less
            # is the plan (`fill.epoch_cost`), as long as it keeps every item it `must` take.
            largest_first = selected[np.argsort(-c.length[selected], kind="stable")]
            packed = self._fill(c, selected, *assign_naive(c, largest_first, self.geometry),
                                eligible)
            if np.isin(must, packed[0]).all() and \
                    self._epoch_cost(c, *packed) < self._epoch_cost(c, take, rank, row, length):
                take, rank, row, length = packed
        if len(take) == 0 and len(c) > 0:
            # Progress guarantee: a plan that takes nothing while candidates exist would repeat
            # forever. The oldest item of the first non-empty window (of an eligible source,
            # when there is one) fits any empty row.
            order = np.lexsort((c.position, c.rank, -c.age))
            if eligible is not None and eligible[c.source[order]].any():
                order = order[eligible[c.source[order]]]
            first = int(order[0])
            take = np.array([first], dtype=np.int64)
            rank, row = np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int32)
            length = c.length[take]
        # The caps per row last: every method plans by tokens and cost, then the rows over a
        # cap give up items (`caps.enforce`; a plan that obeys them is left as it is).
        take, rank, row, length = enforce(c, take, rank, row, length, self.geometry, self.caps,
                                          self.force_age, self.cost, eligible)
        if method != "naive" and SWAPS and swaps_apply(self.geometry, self.cost):
            # Ranks as bins: the top rank trades items with any rank (image steps), or the
            # most loaded ranks move and swap items with their partners (text, `swaps._shed`)
            # (`swaps.py`); the same items.
            rank, row = refine_swaps(c, take, rank, row, length, self.geometry, self.cost,
                                     self.caps)
        if method != "naive" and PIPELINE_MOVES and \
                moves_apply(c, self.geometry, self.cost, self.caps):
            # Rows as bins under 1F1B: the slowest rank's items move to other (rank, row)
            # slots while that lowers the step's time (`pipeline_moves.py`); the same items.
            rank, row = pipeline_moves(c, take, rank, row, length, self.geometry, self.cost)
        elif method != "naive" and PIPELINE_TRIM and \
                trim_applies(c, self.geometry, self.cost, self.caps):
            # Beyond the moves' rows: the ranks that wait on one heavy row shed light items
            # to rows with room, or out of a step kept FULL, as far as the epoch gains
            # (`pipeline_trim.py`; where the moves ran too, R = 64 at 128k, P = 4 lost).
            stay, rank, row = trim_slowest(c, take, rank, row, length, self.geometry,
                                           self.cost, self.overhead, must, self.force_age)
            if not stay.all():
                take, rank, row, length = take[stay], rank[stay], row[stay], length[stay]
        return finish(c, take, rank, row, self.geometry, self.cost, length)
