"""Head windows: the one rule of what a (rank, source) buffer offers the planner, and buffers as
plain arrays for the runs that have lengths instead of tokens (the dry run, the benchmarks, the
job model's tests).

    n, done = head_window(lengths, window_tokens, ended)   # the rule (None: not ready yet)
    queue = ItemQueue(feed)          # one (rank, source) buffer, fed block by block
    grid = Windows(queues)           # [R][S] of them: a step's candidates, a plan applied
    offer = grid.offer(window_tokens)                      # Candidates, ids, exhausted
    delays = grid.commit(offer, take, length, step)        # taken items leave, the rest age

The rule: a window is the shortest prefix of the buffer holding at least `window_tokens`
tokens, or everything up to the end-of-epoch marker (then it is *done*: it holds the rest of
the epoch). A window complete by its tokens is not done, whether or not the marker follows it,
so `done` never depends on fetch timing. `pipeline/buffer.py`'s `SourceBuffer` (real tokens,
filled by fetchers) applies the same function; `ItemQueue` applies it to lengths, and takes
the plan's items the way `SourceBuffer.take` does (tests/test_dryrun.py compares the two).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from .types import Candidates, flatten_windows

ID_FIELDS = 3   # shard, record, chunk (`pieces`)


def head_window(lengths: np.ndarray, window_tokens: int, ended: bool
                ) -> Optional[tuple[int, bool]]:
    """The head window over `lengths`, the items at hand before the next end-of-epoch marker,
    in order (`ended`: the marker follows them). Returns (n, done): the window is lengths[:n],
    and done says it holds the rest of the epoch; or None while the items at hand hold fewer
    than `window_tokens` tokens and no marker follows (not ready: wait for more)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if window_tokens <= 0 and ended and not lengths.shape[0]:   # a source not read here
        return 0, True
    before = np.cumsum(lengths) - lengths
    n = int(np.searchsorted(before, window_tokens, side="left"))
    if n < lengths.shape[0] or int(lengths.sum()) >= window_tokens:
        return n, False
    return (n, True) if ended else None


@dataclass(frozen=True)
class Block:
    """Items appended to a queue at once (a shard, a pass): lengths, ids [n, 3], whether each is
    a piece of a split document (the planner may cut those) and ages (a resumed item's, as saved;
    None: all 0)."""
    lengths: np.ndarray
    ids: np.ndarray
    divisible: np.ndarray
    ages: Optional[np.ndarray] = None

    @staticmethod
    def of(lengths, ids=None, divisible=None) -> "Block":
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        n = lengths.shape[0]
        if ids is None:
            ids = np.stack([np.zeros(n, np.int64), np.arange(n, dtype=np.int64),
                            np.full(n, -1, np.int64)], axis=1)
        divisible = np.zeros(n, bool) if divisible is None else np.asarray(divisible, bool)
        return Block(lengths, np.asarray(ids, np.int64).reshape(n, ID_FIELDS), divisible)


# The next block of a pass, given how many more tokens the window needs (a hint: a shard's feed
# gives the whole shard, a stream's just that, one item over); None: the pass (epoch) ends.
Feed = Callable[[int], Optional[Block]]


def _empty_ids() -> np.ndarray:
    return np.zeros((0, ID_FIELDS), np.int64)


class ItemQueue:
    """One (rank, source) buffer as arrays: the items offered before and left (the *head*, with
    their ages), then the items fed but not yet offered. Items are kept *coded*,
    `length * 2 + divisible`. `feed(tokens)` gives the next block, or None where the epoch ends
    (the marker); `next_epoch(feed)` goes on with the next epoch's items after what is still
    there."""

    def __init__(self, feed: Optional[Feed]):
        self.head = np.zeros(0, np.int64)
        self.head_ids = _empty_ids()
        self.head_age = np.zeros(0, np.int64)
        # The step from which each head item was deferred: a later item of this window was
        # taken while it stayed (-1: never). Its delay, when taken, counts from there.
        self.head_skipped = np.zeros(0, np.int64)
        self._feed, self.ended = feed, feed is None
        self.codes, self.ids = np.zeros(0, np.int64), _empty_ids()
        self.ages = np.zeros(0, np.int64)
        self.prefix = np.zeros(1, np.int64)   # tokens in codes[:j]
        self.ptr = 0
        self.offered = self.fresh = 0         # head and fed items in this step's window
        self.divisible = np.zeros(0, bool)    # of this step's window

    def next_epoch(self, feed: Optional[Feed]) -> None:
        """The next epoch's items, after what is still queued (the marker is dropped)."""
        self._feed, self.ended = feed, feed is None

    def _pull(self, need: int = 1) -> bool:
        """One more block from the feed (`need`: the tokens the window still lacks); False at
        the marker."""
        block = None if self.ended else self._feed(max(int(need), 1))
        if block is None:
            self.ended = True
            return False
        self.codes = np.concatenate([self.codes[self.ptr:], block.lengths * 2 + block.divisible])
        self.ids = np.concatenate([self.ids[self.ptr:], block.ids])
        self.ages = np.concatenate([self.ages[self.ptr:], np.zeros(block.lengths.shape[0], np.int64)
                                    if block.ages is None else block.ages])
        self.prefix = np.concatenate([[0], np.cumsum(self.codes >> 1)])
        self.ptr = 0
        return True

    def window(self, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """This step's window of `tokens` tokens (`head_window`): (lengths, ages, ids, done).
        Which of its items are divisible: `self.divisible`."""
        head_lengths = self.head >> 1
        need = tokens - int(head_lengths.sum())
        fresh = 0
        if tokens <= 0:   # a source this rank does not read (`plan/readers.py`): no window;
            while self.ptr == self.codes.shape[0] and self._pull():   # its feed says it ended
                pass
        if need > 0:   # the head is short: fed items, as many as start before `tokens`
            while self.prefix[-1] - self.prefix[self.ptr] < need and \
                    self._pull(need - (self.prefix[-1] - self.prefix[self.ptr])):
                pass
            start = self.prefix[self.ptr]
            fresh = int(np.searchsorted(self.prefix[self.ptr:-1], start + need, side="left"))
        lengths = np.concatenate([head_lengths, self.codes[self.ptr:self.ptr + fresh] >> 1])
        at_marker = self.ended and self.ptr + fresh == self.codes.shape[0]
        n, done = head_window(lengths, tokens, at_marker) or (lengths.shape[0], False)
        self.offered = min(n, self.head.shape[0])
        self.fresh = n - self.offered
        codes = np.concatenate([self.head[:self.offered],
                                self.codes[self.ptr:self.ptr + self.fresh]])
        self.divisible = (codes & 1).astype(bool)
        ids = np.concatenate([self.head_ids[:self.offered],
                              self.ids[self.ptr:self.ptr + self.fresh]])
        ages = np.concatenate([self.head_age[:self.offered],
                               self.ages[self.ptr:self.ptr + self.fresh]])
        return codes >> 1, ages, ids, done

    def commit(self, taken: np.ndarray, lengths: np.ndarray, ages: np.ndarray, ids: np.ndarray,
               taken_lengths: Optional[np.ndarray] = None, step: int = 0) -> np.ndarray:
        """Remove the taken window positions (`taken_lengths`: tokens taken of each; an item cut
        short keeps its rest in place, its id's chunk moved on by what was taken, `pieces`);
        the rest of the window ages one step. Returns [2, n]: the delays of the taken items
        that had been deferred (steps since a later item of this window went ahead of them)
        and their tokens."""
        taken = np.asarray(taken, dtype=np.int64)
        keep = np.ones(lengths.size, dtype=bool)
        keep[taken] = False
        skipped = np.concatenate([self.head_skipped[:self.offered],
                                  np.full(lengths.size - self.offered, -1, np.int64)])
        whole = taken[np.asarray(taken_lengths) >= lengths[taken]] \
            if taken_lengths is not None else taken
        late = whole[skipped[whole] >= 0]
        delays = np.stack([step - skipped[late], np.asarray(lengths, np.int64)[late]])
        if whole.size:   # a later item went ahead of what stays before it
            overtaken = keep & (np.arange(lengths.size) < int(whole.max())) & (skipped < 0)
            skipped[overtaken] = step
        lengths = np.asarray(lengths, dtype=np.int64).copy()
        ids = np.asarray(ids, dtype=np.int64)
        if taken_lengths is not None:
            cut = np.asarray(taken_lengths) < lengths[taken]
            if cut.any():
                rest = taken[cut]
                lengths[rest] -= np.asarray(taken_lengths)[cut]
                keep[rest] = True
                ids = ids.copy()
                ids[rest, 2] += np.asarray(taken_lengths)[cut]
        codes = lengths * 2 + self.divisible
        self.head = np.concatenate([codes[keep], self.head[self.offered:]])
        self.head_ids = np.concatenate([ids[keep], self.head_ids[self.offered:]])
        self.head_age = np.concatenate([ages[keep] + 1, self.head_age[self.offered:]])
        self.head_skipped = np.concatenate([skipped[keep], self.head_skipped[self.offered:]])
        self.ptr += self.fresh
        self.offered = self.fresh = 0
        return delays

    @property
    def has_items(self) -> bool:
        """Anything left before the marker (pulls a block to know)."""
        while self.ptr >= self.codes.shape[0] and self._pull():
            pass
        return self.head.shape[0] > 0 or self.ptr < self.codes.shape[0]


@dataclass(frozen=True)
class Offer:
    """A step's windows over the grid: the candidates, their ids, which windows are done."""
    candidates: Candidates
    ids: np.ndarray          # int64 [n, 3], in the candidates' order
    exhausted: np.ndarray    # bool [R, S]
    windows: list            # per rank, per source: (lengths, ages, ids) as offered


class Windows:
    """Every (rank, source) queue of a job: `queues[r][s]`."""

    def __init__(self, queues: Sequence[Sequence[ItemQueue]]):
        self.queues = [list(q) for q in queues]
        self.ranks = len(self.queues)
        self.sources = len(self.queues[0]) if self.queues else 0

    def holding(self) -> np.ndarray:
        """bool [R, S]: which queues have items before their marker."""
        return np.array([[q.has_items for q in rank] for rank in self.queues],
                        dtype=bool).reshape(self.ranks, self.sources)

    def offer(self, window_tokens: np.ndarray,
              attributes: Optional[Callable[[int, np.ndarray], tuple]] = None) -> Offer:
        """This step's windows as candidates. `attributes(source, ids)` -> (extra cost,
        images, patches) of the items with those ids (an image source's encoder cost and
        what the caps per row count); None: lengths only."""
        views = [[q.window(int(window_tokens[r, s])) for s, q in enumerate(rank)]
                 for r, rank in enumerate(self.queues)]
        extra = images = patches = None
        if attributes is not None:
            found = [[attributes(s, v[2]) for s, v in enumerate(rank)] for rank in views]
            extra, images, patches = ([[a[k] for a in rank] for rank in found]
                                      for k in range(3))
        c = Candidates.from_windows([[v[0] for v in rank] for rank in views],
                                    [[v[1] for v in rank] for rank in views], extra,
                                    [[q.divisible for q in rank] for rank in self.queues],
                                    images, patches)
        ids = flatten_windows([[v[2] for v in rank] for rank in views], np.int64)
        exhausted = np.array([[v[3] for v in rank] for rank in views],
                             dtype=bool).reshape(self.ranks, self.sources)
        return Offer(c, ids.reshape(-1, ID_FIELDS), exhausted, views)

    def commit(self, offer: Offer, take: np.ndarray, length: np.ndarray, step: int = 0
               ) -> np.ndarray:
        """The plan took candidates `take`, `length` tokens of each. Returns [2, n]: the taken
        items' delays and tokens (`ItemQueue.commit`)."""
        c = offer.candidates
        taken = np.zeros(len(c), dtype=np.int64)   # tokens taken of each candidate
        taken[np.asarray(take, dtype=np.int64)] = length
        delays = [np.zeros((2, 0), np.int64)]
        starts = np.concatenate([[0], np.cumsum([[len(offer.windows[r][s][0])
                                                  for r in range(self.ranks)]
                                                 for s in range(self.sources)])])
        for s in range(self.sources):
            for r in range(self.ranks):
                window = slice(int(starts[s * self.ranks + r]), int(starts[s * self.ranks + r + 1]))
                lengths, ages, ids, _ = offer.windows[r][s]
                if window.stop == window.start:   # nothing offered, nothing to take
                    continue
                positions = np.flatnonzero(taken[window])
                delays.append(self.queues[r][s].commit(positions, lengths, ages, ids,
                                                       taken[window][positions], step))
        return np.concatenate(delays, axis=1)
