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

from ..plan.types import Assignment, Candidates, flatten_windows
from .protocol import OK

ID_FIELDS = 3   # shard, record, chunk (-1 for a whole document; else see `pieces`)


@dataclass(frozen=True)
class SourceWindow:
    lengths: np.ndarray   # int64 [n]
    ages: np.ndarray      # int64 [n]
    ids: np.ndarray       # int64 [n, 3]
    exhausted: bool       # the window holds the rest of this epoch for this source
    extra_cost: np.ndarray = None   # float64 [n], from the source's sample-cost hook (or zeros)


@dataclass(frozen=True)
class Summaries:
    """Every rank's windows. `ids` rows line up with `candidates`."""
    candidates: Candidates
    ids: np.ndarray          # int64 [n, 3]
    exhausted: np.ndarray    # bool [rank, source]


def encode_summary(windows: list[SourceWindow]) -> np.ndarray:
    parts = [np.array([OK], dtype=np.int64)]
    for w in windows:
        parts.append(np.array([w.lengths.shape[0], int(w.exhausted)], dtype=np.int64))
        extra = np.zeros(w.lengths.shape[0]) if w.extra_cost is None else w.extra_cost
        parts += [w.lengths.astype(np.int64), w.ages.astype(np.int64),
                  w.ids.astype(np.int64).reshape(-1),
                  np.ascontiguousarray(extra, dtype=np.float64).view(np.int64)]
    return np.concatenate(parts)


def decode_summaries(gathered: list[np.ndarray], num_sources: int) -> Summaries:
    lengths = [[None] * num_sources for _ in gathered]
    ages = [[None] * num_sources for _ in gathered]
    ids = [[None] * num_sources for _ in gathered]
    extra = [[None] * num_sources for _ in gathered]
    exhausted = np.zeros((len(gathered), num_sources), dtype=bool)
    for r, array in enumerate(gathered):
        at = 1
        for s in range(num_sources):
            n, done = int(array[at]), bool(array[at + 1])
            at += 2
            lengths[r][s] = array[at:at + n]
            ages[r][s] = array[at + n:at + 2 * n]
            ids[r][s] = array[at + 2 * n:at + (2 + ID_FIELDS) * n].reshape(n, ID_FIELDS)
            extra[r][s] = np.ascontiguousarray(
                array[at + (2 + ID_FIELDS) * n:at + (3 + ID_FIELDS) * n]).view(np.float64)
            exhausted[r, s] = done
            at += (3 + ID_FIELDS) * n
    # A piece of a split document (chunk >= 0, `pieces`) may be cut to fill a row.
    divisible = [[i[:, 2] >= 0 for i in per_rank] for per_rank in ids]
    return Summaries(Candidates.from_windows(lengths, ages, extra, divisible),
                     flatten_windows(ids, np.int64).reshape(-1, ID_FIELDS),
                     exhausted)


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
