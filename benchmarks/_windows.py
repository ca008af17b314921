"""The loader's head windows over length streams, shared by the planner and mixing benchmarks:
one `plan.windows.ItemQueue` per (rank, source), the loader's own head-window rule and aging
(`plan.windows`, which `SourceBuffer` and the dry run apply too), each fed from its source's
stream of lengths. Untaken items stay at the head of their window, one step older."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamload.plan.types import Candidates, Geometry
from streamload.plan.windows import Block, ItemQueue, Offer, Windows


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


class StreamWindows:
    def __init__(self, geometry: Geometry, streams, depth: np.ndarray):
        """`streams[s].take(tokens)` gives the next item lengths of source s (at least `tokens`
        of them; none once it ran out); `depth[s]` is the tokens of each rank's head window of
        s (`head_window`)."""
        self.geometry, self.streams, self.depth = geometry, streams, np.asarray(depth, float)
        R, S = geometry.ranks, len(streams)
        self.windows = Windows([[ItemQueue(self._feed(s)) for s in range(S)] for _ in range(R)])
        self.offer: Offer | None = None

    def _feed(self, s: int):
        def feed(tokens: int):   # what the window lacks, one item over (as FifoWindows drew)
            lengths = self.streams[s].take(float(tokens))
            return Block.of(lengths) if lengths.size else None
        return feed

    def refill(self) -> None:
        """Nothing to do: the windows draw on their streams as they are offered."""

    def candidates(self) -> Candidates:
        tokens = np.broadcast_to(np.ceil(self.depth).astype(np.int64),
                                 (self.geometry.ranks, len(self.streams)))
        self.offer = self.windows.offer(tokens)
        return self.offer.candidates

    def commit(self, take: np.ndarray, length: np.ndarray | None = None) -> None:
        c = self.offer.candidates
        take = np.asarray(take, dtype=np.int64)
        self.windows.commit(self.offer, take, c.length[take] if length is None else length)

    def held(self) -> np.ndarray:
        """Tokens per source in the windows' queues (offered or not)."""
        out = np.zeros(len(self.streams))
        for rank in self.windows.queues:
            for s, q in enumerate(rank):
                out[s] += float((q.head >> 1).sum() + (q.codes[q.ptr:] >> 1).sum())
        return out

    def has_items(self) -> bool:
        """Items left in the windows or the streams (without drawing any: a queue asked
        whether it holds items draws one, which would deal the streams' tails differently)."""
        return bool(self.held().sum() > 0 or any(getattr(st, "left", 1) > 0
                                                 for st in self.streams))
