"""Per-source ordered bounded buffer.

Items arrive in a deterministic order (shard by shard, record by record) and are consumed from
the *head window*: the shortest prefix holding at least `window_tokens` tokens, or everything up
to the end-of-epoch marker. The window is a deterministic function of what has arrived, because
the step loop waits (`wait_ready`) until that prefix is complete; that is what makes plans
independent of fetch timing.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Iterable, Optional

import numpy as np

from ..plan.windows import head_window
from .changes import Changes


class Item:
    """One sample: a document, or one chunk of a split document."""
    __slots__ = ("shard", "record", "chunk", "tokens", "age")

    def __init__(self, shard: int, record: int, chunk: int, tokens: np.ndarray):
        self.shard, self.record, self.chunk, self.tokens = shard, record, chunk, tokens
        self.age = 0   # steps this item was offered in a window and not taken

    def __len__(self) -> int:
        return self.tokens.shape[0]


MAX_PENDING_EPOCHS = 2   # end-of-epoch markers a producer may put ahead of the steps


class EndOfEpoch:
    __slots__ = ("epoch",)

    def __init__(self, epoch: int):
        self.epoch = epoch


class SourceBuffer:
    def __init__(self, capacity_tokens: int, window_tokens: int):
        self._entries: deque = deque()
        self._tokens = 0          # tokens held, all epochs
        self._head_tokens = 0     # tokens before the first end-of-epoch marker
        self._markers = 0
        self._changes = Changes()
        self.resize(capacity_tokens, window_tokens)
        self._error: Optional[BaseException] = None
        self.blocked_s = 0.0      # time the producer waited because the buffer was full

    def resize(self, capacity_tokens: int, window_tokens: int) -> None:
        """New sizes for the next step (`MemoryPlan.budgets`); a producer waiting for room and
        a step waiting for its window check again."""
        if capacity_tokens < window_tokens:
            raise ValueError("buffer capacity must hold at least one window")
        self.capacity_tokens = capacity_tokens
        self.window_tokens = window_tokens
        self._changes.notify()

    # -- producer side -------------------------------------------------------------------
    async def put(self, items: Iterable[Item]) -> None:
        """Append items in order; waits while the buffer is at capacity."""
        for item in items:
            if self._tokens >= self.capacity_tokens:
                self._changes.notify()   # what is appended so far may complete a window
                started = time.perf_counter()
                while self._tokens >= self.capacity_tokens and self._error is None:
                    await self._changes.wait()
                self.blocked_s += time.perf_counter() - started
            self._raise_if_failed()
            self._entries.append(item)
            self._tokens += len(item)
            if self._markers == 0:
                self._head_tokens += len(item)
        self._changes.notify()

    async def end_epoch(self, epoch: int) -> None:
        """Mark the end of `epoch`; waits while MAX_PENDING_EPOCHS ends are still unconsumed.
        A rank dealt no shard of a source ends its epochs of it without reading anything: with
        epochs=None it would append markers for ever without yielding to the loop (the job
        hung), so the producer stays at most that many epochs ahead of the steps."""
        while self._markers >= MAX_PENDING_EPOCHS and self._error is None:
            await self._changes.wait()
        self._raise_if_failed()
        self._entries.append(EndOfEpoch(epoch))
        self._markers += 1
        self._changes.notify()

    def fail(self, error: BaseException) -> None:
        """Wake every waiter with `error` (a fetcher died)."""
        self._error = error
        self._changes.notify()

    # -- consumer side -------------------------------------------------------------------
    def _raise_if_failed(self):
        if self._error is not None:
            raise self._error

    def _ready(self) -> bool:
        return self._markers > 0 or self._head_tokens >= self.window_tokens

    async def wait_ready(self) -> None:
        while not self._ready():
            self._raise_if_failed()
            await self._changes.wait()
        self._raise_if_failed()

    def window(self) -> tuple[list[Item], bool]:
        """The head window (call after wait_ready), and whether it holds the rest of the epoch:
        `plan.windows.head_window` over the items before the first marker."""
        items, ended, tokens = [], False, 0
        for entry in self._entries:
            if isinstance(entry, EndOfEpoch):
                ended = True
                break
            if tokens >= self.window_tokens:   # enough at hand: the rest cannot be in it
                break
            items.append(entry)
            tokens += len(entry)
        lengths = np.fromiter((len(i) for i in items), np.int64, len(items))
        n, done = head_window(lengths, self.window_tokens, ended) or (len(items), False)
        return items[:n], done

    def take(self, positions: np.ndarray, window_size: int,
                   cut: Optional[dict[int, int]] = None) -> list[Item]:
        """Remove window items at `positions` (ascending), age the rest of the window.
        `cut`: position -> tokens, for items the plan takes only the head of; the rest stays in
        its place, as the remainder of its piece (`pieces`), aged like the rest of the window."""
        cut = cut or {}
        taken_mask = np.zeros(window_size, dtype=bool)
        taken_mask[positions] = True
        head = [self._entries.popleft() for _ in range(window_size)]
        kept, out, removed = [], {}, 0
        for p, (item, taken) in enumerate(zip(head, taken_mask)):
            if p in cut:
                n = cut[p]
                out[p] = Item(item.shard, item.record, item.chunk, item.tokens[:n])
                item = Item(item.shard, item.record, item.chunk + n, item.tokens[n:])
                item.age = head[p].age
                taken = False
                removed += n
            elif taken:
                out[p] = item
                removed += len(item)
            if not taken:
                item.age += 1
                kept.append(item)
        self._entries.extendleft(reversed(kept))
        self._tokens -= removed
        self._head_tokens -= removed
        self._changes.notify()
        return [out[int(p)] for p in positions]

    def next_epoch(self) -> None:
        """Drop the end-of-epoch marker at the head (the window before it must be empty)."""
        marker = self._entries.popleft()
        assert isinstance(marker, EndOfEpoch), "epoch ended with items still buffered"
        self._markers -= 1
        # Tokens up to the next marker now form the head.
        head = 0
        for entry in self._entries:
            if isinstance(entry, EndOfEpoch):
                break
            head += len(entry)
        self._head_tokens = head
        self._changes.notify()

    @property
    def tokens(self) -> int:
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries) - self._markers


class UnreadBuffer:
    """The buffer of a source this rank does not read (`plan/readers.py`): no fetcher fills it,
    its window is always empty and at the epoch's end, so the planner sees nothing of the source
    here and the ranks that read it supply it (through the exchange). Holds nothing."""
    capacity_tokens = 0
    window_tokens = 0
    blocked_s = 0.0
    tokens = 0

    def resize(self, capacity_tokens: int, window_tokens: int) -> None:
        pass

    def fail(self, error: BaseException) -> None:
        pass

    async def wait_ready(self) -> None:
        pass

    def window(self) -> tuple[list[Item], bool]:
        return [], True

    def take(self, positions: np.ndarray, window_size: int, cut=None) -> list[Item]:
        assert len(positions) == 0 and window_size == 0, "a plan took from an unread source"
        return []

    def next_epoch(self) -> None:
        pass

    def __len__(self) -> int:
        return 0
