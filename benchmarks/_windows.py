"""The coordinator loop without processes, shared by the planner and mixing benchmarks:
per-(rank, source) FIFO windows, refilled from length streams, flattened into Candidates each
step; untaken items stay, one step older."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamload.plan.types import Candidates, Geometry

FIELDS = ("length", "source", "rank", "seq", "age")


@dataclass(frozen=True)
class SourceSpec:
    name: str
    weight: float
    median: float                     # lognormal document lengths
    sigma: float
    total_tokens: float = np.inf      # finite: the source runs out


# The multi-source body both benchmarks use.
BODY = (SourceSpec("web", 0.45, 600, 1.0), SourceSpec("code", 0.25, 1200, 1.3),
        SourceSpec("books", 0.15, 6000, 1.0), SourceSpec("chat", 0.15, 300, 0.8))


def split_at_capacity(docs: np.ndarray, capacity: int) -> np.ndarray:
    """Document lengths -> item lengths, as the loader splits documents longer than a row."""
    pieces = -(-docs // capacity)
    lengths = np.full(int(pieces.sum()), capacity, dtype=np.int64)
    last = np.cumsum(pieces) - 1
    lengths[last] = docs - (pieces - 1) * capacity
    return lengths


class FifoWindows:
    def __init__(self, geometry: Geometry, streams, depth: np.ndarray):
        """`streams[s].take(tokens)` gives the next document lengths of source s (at least
        `tokens` of them); `depth[s]` is the tokens each rank's window of s is kept at."""
        self.geometry, self.streams, self.depth = geometry, streams, np.asarray(depth, float)
        empty = np.zeros(0, dtype=np.int64)
        for name in FIELDS:
            setattr(self, name, empty)
        self.next_seq = 0
        self.refill()

    def refill(self) -> None:
        R, S = self.geometry.ranks, len(self.streams)
        have = np.bincount(self.source * R + self.rank, weights=self.length,
                           minlength=S * R).reshape(S, R)
        parts = [[self.length], [self.source], [self.rank]]
        for s in range(S):
            deficit = np.maximum(self.depth[s] - have[s], 0.0)
            if not (deficit > 0).any():
                continue
            ends = np.cumsum(deficit)
            lengths = self.streams[s].take(float(ends[-1]))
            starts = np.cumsum(lengths) - lengths
            # Consecutive documents go to one rank until it has its deficit (one item over).
            owner = np.minimum(np.searchsorted(ends, starts, side="right"), R - 1)
            parts[0].append(lengths)
            parts[1].append(np.full(lengths.size, s, dtype=np.int64))
            parts[2].append(owner.astype(np.int64))
        added = sum(p.size for p in parts[0][1:])
        self.length = np.concatenate(parts[0])
        self.source = np.concatenate(parts[1])
        self.rank = np.concatenate(parts[2])
        self.seq = np.concatenate([self.seq, np.arange(self.next_seq, self.next_seq + added)])
        self.age = np.concatenate([self.age, np.zeros(added, dtype=np.int64)])
        self.next_seq += added

    def candidates(self) -> Candidates:
        order = np.lexsort((self.seq, self.rank, self.source))
        for name in FIELDS:
            setattr(self, name, getattr(self, name)[order])
        group = self.source * self.geometry.ranks + self.rank
        position = np.arange(group.size) - np.searchsorted(group, group, side="left")
        return Candidates(self.length.copy(), self.source.astype(np.int32),
                          self.rank.astype(np.int32), position.astype(np.int32),
                          self.age.astype(np.int32), np.zeros(group.size), len(self.streams),
                          self.geometry.ranks)

    def commit(self, take: np.ndarray) -> None:
        keep = np.ones(self.length.size, dtype=bool)
        keep[take] = False
        for name in FIELDS:
            setattr(self, name, getattr(self, name)[keep])
        self.age = self.age + 1
        self.refill()
