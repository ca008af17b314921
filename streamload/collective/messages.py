"""Encode what ranks tell each other each step as flat int64 arrays.

* A *summary* is one rank's head windows: for every source, the items' lengths, ages and ids
  (shard, record, chunk), and whether the window holds the rest of the epoch. Rank 0 plans from
  the lengths and ages; every rank learns every id, so each can track the whole job's progress
  (resumable state) and receive exchanged samples without sending ids again.
* A *plan* is the assignment rank 0 broadcasts.
* Both start with a status word (`protocol.py`), so a rank that failed can still take part in
  the collective and tell every other rank why, instead of leaving them waiting until a timeout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..plan.cost import STEP_COSTS_FIELDS, StepCosts
from ..plan.types import Assignment, Candidates, window_columns
from .protocol import OK

ID_FIELDS = 3   # shard, record, chunk (-1 for a whole document; else see `pieces`)


@dataclass(frozen=True)
class SourceWindow:
    lengths: np.ndarray   # int64 [n]
    ages: np.ndarray      # int64 [n]
    ids: np.ndarray       # int64 [n, 3]
    exhausted: bool       # the window holds the rest of this epoch for this source
    extra_cost: np.ndarray = None   # float64 [n], from the source's sample-cost hook (or zeros)
    # int64 [2, n]: each item's images and encoder patches (an image source; None: text), for
    # the caps per row (`plan/caps.py`)
    visual: np.ndarray = None


@dataclass(frozen=True)
class Summaries:
    """Every rank's windows. `ids` rows line up with `candidates`."""
    candidates: Candidates
    ids: np.ndarray          # int64 [n, 3]
    exhausted: np.ndarray    # bool [rank, source]


def encode_summary(windows: list[SourceWindow]) -> np.ndarray:
    """One int64 array, written column by column: [OK], then per source [n, flags], lengths,
    ages, ids (n x 3, row-major), extra costs (float64 bits; zeros when None) and, when flags
    has bit 1 (bit 0: exhausted), the window's images and patches per item (2 x n)."""
    sizes = [w.lengths.shape[0] for w in windows]
    out = np.empty(1 + sum(2 + (3 + ID_FIELDS) * n + (0 if w.visual is None else 2 * n)
                           for w, n in zip(windows, sizes)), np.int64)
    out[0] = OK
    at = 1
    for w, n in zip(windows, sizes):
        out[at], out[at + 1] = n, int(w.exhausted) | (0 if w.visual is None else 2)
        at += 2
        out[at:at + n] = w.lengths
        out[at + n:at + 2 * n] = w.ages
        out[at + 2 * n:at + (2 + ID_FIELDS) * n] = w.ids.reshape(-1)
        costs = out[at + (2 + ID_FIELDS) * n:at + (3 + ID_FIELDS) * n].view(np.float64)
        if w.extra_cost is None:
            costs.fill(0.0)
        else:
            costs[:] = w.extra_cost
        at += (3 + ID_FIELDS) * n
        if w.visual is not None:
            out[at:at + 2 * n] = np.asarray(w.visual, np.int64).reshape(-1)
            at += 2 * n
    return out


def decode_summaries(gathered: list[np.ndarray], num_sources: int) -> Summaries:
    """Every rank's summary (`encode_summary`) as the step's candidates, their ids and which
    windows hold the rest of the epoch. The headers are read window by window; each column
    is then one gather over all the windows, in the candidates' order (`window_columns`)."""
    R, S = len(gathered), num_sources
    flat = gathered[0] if R == 1 else np.concatenate(gathered)
    offsets = np.zeros((R, S), np.int64)   # where each window's lengths begin in `flat`
    sizes = np.zeros((R, S), np.int64)
    visual = np.zeros((R, S), bool)
    exhausted = np.zeros((R, S), dtype=bool)
    base = 0
    for r, array in enumerate(gathered):
        for s, (at, n, flags) in enumerate(_headers(array, S)):
            offsets[r, s], sizes[r, s] = base + at, n
            exhausted[r, s], visual[r, s] = flags & 1, flags & 2
        base += array.shape[0]
    source, rank, position = window_columns(sizes)
    per_window = sizes.T.reshape(-1)   # the windows' sizes, in the candidates' order
    n_of = np.repeat(per_window, per_window)   # each item's window size
    at = np.repeat(offsets.T.reshape(-1), per_window) + position
    lengths, ages = flat[at], flat[at + n_of]
    # ids [n, 3] are row-major after the ages: item k's at lengths' start + 2n + 3k
    ids = flat[(at + 2 * n_of + 2 * position)[:, None] + np.arange(ID_FIELDS)]
    extra = flat[at + (2 + ID_FIELDS) * n_of].view(np.float64)
    images = patches = None
    if visual.any():   # a text window among image ones: no images, no patches
        has = np.repeat(visual.T.reshape(-1), per_window)
        first = at + (3 + ID_FIELDS) * n_of
        images = np.where(has, flat[np.where(has, first, 0)], 0)
        patches = np.where(has, flat[np.where(has, first + n_of, 0)], 0)
    c = Candidates(lengths, source, rank, position, ages.astype(np.int32), extra, S, R,
                   ids[:, 2] >= 0, images, patches)   # a piece (chunk >= 0) may be cut
    return Summaries(c.known_windows(sizes), ids, exhausted)


def _headers(array: np.ndarray, num_sources: int):
    """(where its lengths begin, n, flags) of each window of one rank's summary, in source
    order."""
    at = 1
    for _ in range(num_sources):
        n, flags = int(array[at]), int(array[at + 1])
        yield at + 2, n, flags
        at += 2 + (3 + ID_FIELDS) * n + (2 * n if flags & 2 else 0)


OUTCOMES = ("continue", "end_epoch", "stop")   # what the job does after this plan


def plan_size(num_candidates: int) -> int:
    """The longest plan message for a step with this many candidates (each is taken at most
    once). Every rank knows the candidates, so the broadcast needs no size of its own."""
    return 3 + 4 * num_candidates


def encode_plan(assignment: Optional[Assignment], outcome: int) -> np.ndarray:
    if assignment is None:
        return np.array([OK, outcome, 0], dtype=np.int64)
    k = len(assignment)
    return np.concatenate([np.array([OK, outcome, k], dtype=np.int64),
                           assignment.take.astype(np.int64), assignment.rank.astype(np.int64),
                           assignment.row.astype(np.int64), assignment.length.astype(np.int64)])


@dataclass(frozen=True)
class PlanMessage:
    outcome: int          # index into OUTCOMES
    take: np.ndarray
    rank: np.ndarray
    row: np.ndarray
    length: np.ndarray    # tokens taken of each item (fewer than it holds: cut to fill a row)


def decode_plan(array: np.ndarray) -> PlanMessage:
    outcome, k = int(array[1]), int(array[2])
    body = array[3:]
    return PlanMessage(outcome, body[:k], body[k:2 * k], body[2 * k:3 * k],
                       body[3 * k:4 * k])


# -- control_plane="gather": each rank's own part of the plan ------------------------------------

@dataclass(frozen=True)
class StepTotals:
    """What a step did over the whole job, which a rank given only its own part of the plan
    cannot count itself (the Batch's and `stats()`'s job-wide figures). The per-rank arrays
    are every rank's on rank 0 ([R], [R, M]); in another rank's reply, its own rank's alone
    ([1], [1, M]), so that a reply does not grow with R: `costs` has the job-wide figures."""
    rank_tokens: np.ndarray     # float64 [R] (a weighted bincount, as the Batch has it)
    row_cost: np.ndarray        # float64 [R, M]
    source_tokens: np.ndarray   # int64 [S]
    exchanged: int              # tokens moved to another rank
    deferral_max: int           # the most steps a taken item had waited
    deferral_sum: int
    delivered: int              # items taken
    pieces_cut: int
    cut_work: float
    # float64 [R, M]: the vision encoder's part of `row_cost` (the extra cost of the samples of
    # image sources balanced under image_cost="hybrid"); zeros without one
    encoder_cost: Optional[np.ndarray] = None
    costs: Optional[StepCosts] = None    # the step's job-wide cost figures


def step_totals(c: Candidates, plan: "PlanMessage", cost, geometry,
                encoder_sources: Optional[np.ndarray] = None) -> StepTotals:
    """The job-wide figures of a step, from every rank's windows and the whole plan.
    `encoder_sources`: bool [S], the sources whose extra cost is the vision encoder's."""
    R, M, S = geometry.ranks, geometry.micro_batches, c.num_sources
    lengths, holder = plan.length, c.rank[plan.take]
    whole = c.length[plan.take]
    cut = lengths < whole
    ages = c.age[plan.take]
    slots = plan.rank * M + plan.row
    extra = c.extra_cost[plan.take]
    encoder = np.zeros(R * M)
    if encoder_sources is not None and np.any(encoder_sources) and extra.size:
        weights = np.where(np.asarray(encoder_sources, bool)[c.source[plan.take]], extra, 0.0)
        encoder = np.bincount(slots, weights=weights, minlength=R * M)
    rank_tokens = np.bincount(plan.rank, weights=lengths, minlength=R)
    row_cost = cost.row_costs(lengths, slots, R * M, extra_cost=extra).reshape(R, M)
    encoder = encoder.reshape(R, M)
    return StepTotals(
        rank_tokens, row_cost,
        np.bincount(c.source[plan.take], weights=lengths, minlength=S).astype(np.int64),
        int(lengths[holder != plan.rank].sum()), int(ages.max()) if ages.size else 0,
        int(ages.sum()), int(ages.size), int(cut.sum()),
        float(cost.cut_savings(whole[cut], lengths[cut])) if cut.any() else 0.0,
        encoder, StepCosts.of(rank_tokens, row_cost.sum(axis=1), row_cost,
                              geometry.pipeline_stages, encoder.sum(axis=1)))


ENTRY_FIELDS = 12   # holder, dest, row, source, position, whole length, length, shard, record,
                    # chunk, age, extra cost (float64 bits)


@dataclass(frozen=True)
class LocalPlan:
    """One rank's reply from rank 0: the step's outcome, the plan entries this rank takes from
    its buffers or receives (in plan order, as `Summaries` and `PlanMessage` over just them, so
    `Delivery` and `exchange_tokens` work on them as on the whole plan), the job-wide totals,
    the mix, and this rank's buffers for the next step when they changed. (The state travels
    on the side of the round: `state_relay`.)"""
    outcome: int
    finished: bool
    epoch: int
    step: int
    summaries: Optional[Summaries]
    plan: Optional[PlanMessage]
    totals: Optional[StepTotals]
    units: Optional[np.ndarray]          # float64 [S]: the mixer's realized units
    mix: Optional[tuple]                 # (target [S] or None, tail, ran_out [S])
    budgets: Optional[np.ndarray]        # int64 [S, 3]: capacity, window, in flight


def _f64(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float64).reshape(-1).view(np.int64)


def encode_local_plan(outcome: int, epoch: int, step: int, *, finished: bool = False,
                      c: Optional[Candidates] = None, ids: Optional[np.ndarray] = None,
                      plan: Optional[PlanMessage] = None, entries: Optional[np.ndarray] = None,
                      totals: Optional[StepTotals] = None, rank: int = 0, units=None,
                      mix=None, budgets=None) -> np.ndarray:
    """Rank 0: one rank's reply. `entries`: the plan entries (indices into `plan`) it needs;
    of `totals`' per-rank figures, only `rank`'s go, with the job-wide `costs`."""
    n = 0 if entries is None else entries.shape[0]
    parts = [np.array([OK, outcome, int(finished), epoch, step, n, int(budgets is not None),
                       int(totals is not None)],
                      dtype=np.int64)]
    if n:
        take = plan.take[entries]
        parts.append(np.stack([c.rank[take], plan.rank[entries], plan.row[entries],
                               c.source[take], c.position[take], c.length[take],
                               plan.length[entries], ids[take, 0], ids[take, 1], ids[take, 2],
                               c.age[take], _f64(c.extra_cost[take])],
                              axis=1).astype(np.int64).reshape(-1))
    if totals is not None:
        t = totals
        encoder = t.encoder_cost if t.encoder_cost is not None else np.zeros(t.row_cost.shape)
        parts += [_f64(t.rank_tokens[rank:rank + 1]), _f64(t.row_cost[rank]),
                  _f64(encoder[rank]), _f64(t.costs.to_array()), t.source_tokens,
                  _f64(units),
                  np.array([t.exchanged, t.deferral_max, t.deferral_sum, t.delivered,
                            t.pieces_cut], np.int64), _f64([t.cut_work]),
                  np.array([int(mix.target is not None), int(mix.tail)], np.int64),
                  _f64(mix.target if mix.target is not None else np.zeros(units.shape[0])),
                  np.asarray(mix.ran_out, np.int64)]
    if budgets is not None:
        parts.append(np.asarray(budgets, np.int64).reshape(-1))
    return np.concatenate(parts)


def decode_local_plan(array: np.ndarray, num_sources: int, ranks: int,
                      micro_batches: int) -> LocalPlan:
    """A rank's reply; its totals hold its own rank's figures ([1], [1, M]) and `costs`."""
    S, R, M = num_sources, ranks, micro_batches
    _, outcome, finished, epoch, step, n, has_budgets, has_totals = (int(v) for v in array[:8])
    at = 8
    summaries = plan = totals = units = mix = budgets = None
    if n:
        rows = array[at:at + n * ENTRY_FIELDS].reshape(n, ENTRY_FIELDS)
        at += n * ENTRY_FIELDS
        extra = np.ascontiguousarray(rows[:, 11]).view(np.float64)
        ids = np.ascontiguousarray(rows[:, 7:10])
        c = Candidates(rows[:, 5].copy(), rows[:, 3].astype(np.int32),
                       rows[:, 0].astype(np.int32), rows[:, 4].astype(np.int32),
                       rows[:, 10].astype(np.int32), extra, S, R, ids[:, 2] >= 0)
        summaries = Summaries(c, ids, None)
        plan = PlanMessage(outcome, np.arange(n, dtype=np.int64), rows[:, 1].copy(),
                           rows[:, 2].copy(), rows[:, 6].copy())
    if has_totals:
        def take(k):
            nonlocal at
            out = array[at:at + k]
            at += k
            return out
        rank_tokens = np.ascontiguousarray(take(1)).view(np.float64)
        row_cost = np.ascontiguousarray(take(M)).view(np.float64).reshape(1, M)
        encoder_cost = np.ascontiguousarray(take(M)).view(np.float64).reshape(1, M)
        costs = StepCosts.from_array(np.ascontiguousarray(take(STEP_COSTS_FIELDS))
                                     .view(np.float64))
        source_tokens = take(S).copy()
        units = np.ascontiguousarray(take(S)).view(np.float64)
        exchanged, deferral_max, deferral_sum, delivered, pieces_cut = (int(v) for v in take(5))
        cut_work = float(np.ascontiguousarray(take(1)).view(np.float64)[0])
        has_target, tail = (int(v) for v in take(2))
        target = np.ascontiguousarray(take(S)).view(np.float64)
        ran_out = take(S).astype(bool)
        totals = StepTotals(rank_tokens, row_cost, source_tokens, exchanged, deferral_max,
                            deferral_sum, delivered, pieces_cut, cut_work, encoder_cost,
                            costs)
        mix = (target if has_target else None, bool(tail), ran_out)
    if has_budgets:
        budgets = array[at:at + 3 * S].reshape(S, 3)
        at += 3 * S
    if plan is None and outcome == 0:   # a step that took nothing from or for this rank
        c = Candidates(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32),
                       np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0), S, R)
        summaries = Summaries(c, np.zeros((0, ID_FIELDS), np.int64), None)
        plan = PlanMessage(outcome, np.zeros(0, np.int64), np.zeros(0, np.int64),
                           np.zeros(0, np.int64), np.zeros(0, np.int64))
    return LocalPlan(outcome, bool(finished), epoch, step, summaries, plan, totals, units, mix,
                     budgets)
