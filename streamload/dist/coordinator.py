"""Encode what ranks tell each other each step as flat int64 arrays.

* A *summary* is one rank's head windows: for every source, the item lengths, their ages and
  whether the window holds the rest of the epoch. Rank 0 plans from all of them.
* A *plan* is the assignment rank 0 broadcasts.
* Both start with a status word, so a rank that failed can still take part in the collective
  and tell every other rank why, instead of leaving them waiting until a timeout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import DistributedError
from ..plan.types import Assignment, Candidates

OK, FAILED = 0, 1


def encode_failure(error: BaseException) -> np.ndarray:
    message = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[:4000]
    return np.concatenate([[FAILED], np.frombuffer(message, dtype=np.uint8).astype(np.int64)])


def raise_on_failure(gathered: list[np.ndarray], rank: int, local_error: Optional[BaseException]):
    """Every rank raises if any rank failed: its own error if it failed, else a named one."""
    if local_error is not None:
        raise local_error
    for other, array in enumerate(gathered):
        if array.shape[0] and array[0] == FAILED:
            message = bytes(array[1:].astype(np.uint8)).decode("utf-8", "replace")
            raise DistributedError(f"rank {other} failed, so rank {rank} stops too: {message}")


@dataclass(frozen=True)
class SourceWindow:
    lengths: np.ndarray   # int64
    ages: np.ndarray      # int64
    exhausted: bool       # the window holds the rest of this epoch for this source


def encode_summary(windows: list[SourceWindow]) -> np.ndarray:
    parts = [np.array([OK], dtype=np.int64)]
    for w in windows:
        parts.append(np.array([w.lengths.shape[0], int(w.exhausted)], dtype=np.int64))
        parts.append(w.lengths.astype(np.int64))
        parts.append(w.ages.astype(np.int64))
    return np.concatenate(parts)


def decode_summaries(gathered: list[np.ndarray], num_sources: int) -> tuple[Candidates, np.ndarray]:
    """-> (candidates over all ranks, exhausted[rank, source])."""
    lengths = [[None] * num_sources for _ in gathered]
    ages = [[None] * num_sources for _ in gathered]
    exhausted = np.zeros((len(gathered), num_sources), dtype=bool)
    for r, array in enumerate(gathered):
        at = 1
        for s in range(num_sources):
            n, done = int(array[at]), bool(array[at + 1])
            lengths[r][s] = array[at + 2:at + 2 + n]
            ages[r][s] = array[at + 2 + n:at + 2 + 2 * n]
            exhausted[r, s] = done
            at += 2 + 2 * n
    return Candidates.from_windows(lengths, ages), exhausted


def encode_plan(assignment: Optional[Assignment], end_of_epoch: bool) -> np.ndarray:
    if assignment is None:
        return np.array([OK, int(end_of_epoch), 0], dtype=np.int64)
    k = len(assignment)
    return np.concatenate([np.array([OK, int(end_of_epoch), k], dtype=np.int64),
                           assignment.take.astype(np.int64), assignment.rank.astype(np.int64),
                           assignment.row.astype(np.int64)])


@dataclass(frozen=True)
class PlanMessage:
    end_of_epoch: bool
    take: np.ndarray
    rank: np.ndarray
    row: np.ndarray


def decode_plan(array: np.ndarray) -> PlanMessage:
    end_of_epoch, k = bool(array[1]), int(array[2])
    body = array[3:]
    return PlanMessage(end_of_epoch, body[:k], body[k:2 * k], body[2 * k:3 * k])
