"""Plain data passed between the coordinator and the planner. NumPy only, no I/O.

The planner sees every rank's *head window* of every source's buffer, flattened into one
struct-of-arrays (`Candidates`), and returns an `Assignment`: which candidates to take this
step and the (rank, row) each one goes to. Candidates it does not take stay in their buffers,
in order, and are offered again next step with `age + 1`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Geometry:
    ranks: int            # R: data-parallel world size
    micro_batches: int    # M: rows per rank per step
    capacity: int         # C: tokens per row

    @property
    def rows(self) -> int:
        return self.ranks * self.micro_batches

    @property
    def step_tokens(self) -> int:
        return self.rows * self.capacity


@dataclass(frozen=True)
class Candidates:
    """Every rank's head window of every source, flattened. All arrays have one entry per item.

    Items are ordered by (source, rank, position): position 0 is the oldest item of that
    rank's buffer for that source. Every length is in 1..capacity (long documents were already
    split, truncated or dropped upstream).
    """
    length: np.ndarray      # int64 tokens
    source: np.ndarray      # int32 source index
    rank: np.ndarray        # int32 rank that holds the item (that fetched it)
    position: np.ndarray    # int32 index in that rank's window of that source
    age: np.ndarray         # int32 steps this item has already been offered and not taken
    extra_cost: np.ndarray  # float64 per-sample cost added by the source's cost hook (often 0)
    num_sources: int
    num_ranks: int
    # bool: a piece of a document longer than C, which the planner may cut to fill a row (the
    # rest stays in its buffer). Whole documents are never cut. None: no item is.
    divisible: np.ndarray | None = None

    def __post_init__(self):
        if self.divisible is None:
            object.__setattr__(self, "divisible", np.zeros(self.length.shape[0], dtype=bool))

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @staticmethod
    def from_windows(windows: list[list[np.ndarray]], ages: list[list[np.ndarray]] | None = None,
                     extra_costs: list[list[np.ndarray]] | None = None,
                     divisible: list[list[np.ndarray]] | None = None) -> "Candidates":
        """Build from windows[rank][source] -> int lengths (ages / extra costs / divisible
        flags alike, optional)."""
        num_ranks = len(windows)
        num_sources = len(windows[0]) if windows else 0
        parts: dict[str, list[np.ndarray]] = {k: [] for k in
                                              ("length", "source", "rank", "position", "age", "extra",
                                               "divisible")}
        for s in range(num_sources):
            for r in range(num_ranks):
                lengths = np.asarray(windows[r][s], dtype=np.int64)
                n = lengths.shape[0]
                parts["length"].append(lengths)
                parts["source"].append(np.full(n, s, np.int32))
                parts["rank"].append(np.full(n, r, np.int32))
                parts["position"].append(np.arange(n, dtype=np.int32))
                parts["age"].append(np.zeros(n, np.int32) if ages is None
                                    else np.asarray(ages[r][s], dtype=np.int32))
                parts["extra"].append(np.zeros(n, np.float64) if extra_costs is None
                                      else np.asarray(extra_costs[r][s], dtype=np.float64))
                parts["divisible"].append(np.zeros(n, bool) if divisible is None
                                          else np.asarray(divisible[r][s], dtype=bool))

        def cat(key, dtype):
            return np.concatenate(parts[key]).astype(dtype, copy=False) if parts[key] \
                else np.zeros(0, dtype)

        return Candidates(cat("length", np.int64), cat("source", np.int32), cat("rank", np.int32),
                          cat("position", np.int32), cat("age", np.int32), cat("extra", np.float64),
                          num_sources, num_ranks, cat("divisible", bool))


@dataclass(frozen=True)
class Assignment:
    """The planner's answer for one step.

    take[i] is an index into Candidates; it goes to row `row[i]` of rank `rank[i]`, with
    `length[i]` of its tokens: all of them, or the first ones of a divisible item the planner
    cut to fill a row (the rest stays in its buffer). Within a row, items are packed in the
    order they appear here. Every (rank, row) sums to at most capacity tokens. `rank_cost` is
    the predicted cost of each rank under the cost model.
    """
    take: np.ndarray        # int64
    rank: np.ndarray        # int32
    row: np.ndarray         # int32
    rank_cost: np.ndarray   # float64 [R]
    length: np.ndarray      # int64: tokens taken of each item

    def __len__(self) -> int:
        return int(self.take.shape[0])
