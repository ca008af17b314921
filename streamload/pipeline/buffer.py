"""Per-source ordered bounded buffer, in columns.

Items arrive in a deterministic order (shard by shard, record by record) and are consumed from
the *head window*: the shortest prefix holding at least `window_tokens` tokens, or everything up
to the end-of-epoch marker. The window is a deterministic function of what has arrived, because
the step loop waits (`wait_ready`) until that prefix is complete; that is what makes plans
independent of fetch timing.

Items travel as `ItemBlock`s, one per decoded byte range: NumPy columns (where each item starts in
the range's one token buffer, its length, record, chunk and age) and no Python object per item.
The window (`Window`) is the head blocks' columns concatenated, and `take` is a few masks and
gathers over them; only the tokens of the items a step takes become array views, for the
exchange and packing.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from typing import Callable, Iterable, NamedTuple, Optional, Sequence

import numpy as np

from ..plan.windows import head_window
from ..vision.cost import visual_counts
from .changes import Changes

_EMPTY = np.zeros(0, np.int64)
# A block whose live items hold less than this share of its token buffer is copied into a
# buffer of its own (`ItemBlock.compacted`): a few long-deferred items must not pin a whole range.
_COMPACT_BELOW = 0.25
_COMPACT_MIN_BYTES = 1 << 16


class ItemBlock:
    """A run of one shard's items in stream order, as columns over one token buffer (a range's
    tokens): item k is `tokens[start[k]:start[k] + length[k]]`, its id (shard, record[k],
    chunk[k]) (`pieces` says what chunk holds), offered age[k] times and not taken. `images`:
    per item, its images (an image source's `ImageRef`s), else None. `cost`: per item, a
    float64 extra cost fixed when the block entered its buffer (`SourceBuffer`'s `item_cost`:
    the vision encoder's), else None. `visual`: int64 [2, n], each item's images and patches
    (what the caps per row count), worked out once from `images`, else None. Columns are
    int64; once in a buffer, only `age` changes
    (in place, when a step takes nothing from the block); `take` makes new blocks of the
    others."""
    __slots__ = ("shard", "tokens", "start", "length", "record", "chunk", "age", "images",
                 "total", "cost", "visual")

    def __init__(self, shard: int, tokens: np.ndarray, start: np.ndarray, length: np.ndarray,
                 record: np.ndarray, chunk: np.ndarray, age: Optional[np.ndarray] = None,
                 images: Optional[list] = None, visual: Optional[np.ndarray] = None):
        self.shard, self.tokens = shard, tokens
        self.start, self.length, self.record, self.chunk = start, length, record, chunk
        self.age = np.zeros(length.shape[0], np.int64) if age is None else age
        self.images = images
        self.visual = visual if visual is not None or images is None else visual_counts(images)
        self.total = int(length.sum())   # tokens in the block's items
        self.cost: Optional[np.ndarray] = None

    @classmethod
    def of_arrays(cls, shard: int, arrays: Sequence[np.ndarray], record, chunk=None,
                  images: Optional[list] = None) -> "ItemBlock":
        """A block from one token array per item (copied into one buffer): for callers that
        make items one by one (image samples, tests)."""
        length = np.fromiter((a.shape[0] for a in arrays), np.int64, len(arrays))
        start = np.zeros(len(arrays), np.int64)
        np.cumsum(length[:-1], out=start[1:])
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        record = np.asarray(record, np.int64).reshape(-1)
        chunk = np.full(len(arrays), -1, np.int64) if chunk is None else \
            np.asarray(chunk, np.int64).reshape(-1)
        return cls(shard, tokens, start, length, record, chunk, images=images)

    def __len__(self) -> int:
        return self.length.shape[0]

    def item_tokens(self, k: int) -> np.ndarray:
        """Item k's tokens (a view of the block's buffer)."""
        s = int(self.start[k])
        return self.tokens[s:s + int(self.length[k])]

    def subset(self, index: np.ndarray) -> "ItemBlock":
        """The items at `index` (a bool mask or positions, in order), the same buffer."""
        block = ItemBlock(self.shard, self.tokens, self.start[index], self.length[index],
                          self.record[index], self.chunk[index], self.age[index],
                          None if self.images is None else
                          [self.images[k] for k in np.arange(len(self))[index].tolist()],
                          None if self.visual is None else self.visual[:, index])
        block.cost = None if self.cost is None else self.cost[index]
        return block

    def compacted(self) -> "ItemBlock":
        """This block, its items' tokens copied into a buffer of their own when they hold
        little of the one it shares (one concatenation)."""
        if self.tokens.nbytes < _COMPACT_MIN_BYTES or \
                self.total >= _COMPACT_BELOW * self.tokens.shape[0]:
            return self
        tokens = self.tokens   # (few items: a concatenation of views beats an index gather)
        kept = np.concatenate([tokens[s:s + n] for s, n in
                               zip(self.start.tolist(), self.length.tolist())])
        start = np.zeros(len(self), np.int64)
        np.cumsum(self.length[:-1], out=start[1:])
        block = ItemBlock(self.shard, kept, start, self.length, self.record, self.chunk,
                          self.age, self.images, self.visual)
        block.cost = self.cost
        return block

    @property
    def nbytes(self) -> int:
        """Memory the block holds: its token buffer and its columns."""
        return self.tokens.nbytes + 5 * 8 * len(self)


class Window(NamedTuple):
    """A source's head window as columns (`SourceBuffer.window`): per item, its length, age
    and id (shard, record, chunk) [n, 3]; `done`: it holds the rest of the epoch. `images`:
    per item, its images (an image source), else None. `cost`: per item, the extra cost fixed
    when it entered the buffer (float64; `SourceBuffer`'s `item_cost`), else None. `visual`:
    int64 [2, n], each item's images and patches (an image source), else None."""
    lengths: np.ndarray
    ages: np.ndarray
    ids: np.ndarray
    done: bool
    images: Optional[list] = None
    cost: Optional[np.ndarray] = None
    visual: Optional[np.ndarray] = None


class Taken(NamedTuple):
    """What `SourceBuffer.take` removed, in the order asked: each item's tokens (views) and,
    for an image source, its images."""
    tokens: list
    images: Optional[list] = None


MAX_PENDING_EPOCHS = 2   # end-of-epoch markers a producer may put ahead of the steps


class EndOfEpoch:
    __slots__ = ("epoch",)

    def __init__(self, epoch: int):
        self.epoch = epoch


def _columns(blocks: Sequence[ItemBlock], at_hand: np.ndarray, n: int):
    """The first `n` items of `blocks` (whose lengths are `at_hand`), as columns of their own:
    lengths, ages, ids [n, 3], images (or None), extra costs (or None), images and patches
    [2, n] (or None)."""
    if not blocks:
        return _EMPTY, _EMPTY, np.zeros((0, 3), np.int64), None, None, None
    lengths = at_hand[:n].copy() if len(blocks) == 1 else at_hand[:n]   # a block's: copied
    ids = np.empty((n, 3), np.int64)
    if len(blocks) == 1:   # the window in one block (most steps): slices, no concatenations
        b = blocks[0]
        ids[:, 0] = b.shard
        ids[:, 1] = b.record[:n]
        ids[:, 2] = b.chunk[:n]
        return (lengths, b.age[:n].copy(), ids, None if b.images is None else b.images[:n],
                None if b.cost is None else b.cost[:n].copy(),
                None if b.visual is None else b.visual[:, :n].copy())
    ages = np.concatenate([b.age for b in blocks])[:n]
    ids[:, 0] = np.repeat([b.shard for b in blocks], [len(b) for b in blocks])[:n]
    ids[:, 1] = np.concatenate([b.record for b in blocks])[:n]
    ids[:, 2] = np.concatenate([b.chunk for b in blocks])[:n]
    images = None
    if any(b.images is not None for b in blocks):
        images = [refs for b in blocks for refs in (b.images or [()] * len(b))][:n]
    cost = None
    if any(b.cost is not None for b in blocks):
        cost = np.concatenate([np.zeros(len(b)) if b.cost is None else b.cost
                               for b in blocks])[:n]
    visual = None
    if any(b.visual is not None for b in blocks):
        visual = np.concatenate([np.zeros((2, len(b)), np.int64) if b.visual is None else
                                 b.visual for b in blocks], axis=1)[:, :n]
    return lengths, ages, ids, images, cost, visual


class SourceBuffer:
    def __init__(self, capacity_tokens: int, window_tokens: int,
                 item_cost: Optional[Callable[[ItemBlock], np.ndarray]] = None):
        """`item_cost(block)`: each item's extra cost (float64 [n]), worked out once as the
        block comes in and kept as its `cost` column (the window's `cost`)."""
        self._item_cost = item_cost
        self._entries: deque = deque()   # Blocks and EndOfEpoch markers, in order
        self._tokens = 0          # tokens held, all epochs
        self._head_tokens = 0     # tokens before the first end-of-epoch marker
        self._items = 0           # items held, all epochs
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
    async def put(self, blocks: Iterable[ItemBlock]) -> None:
        """Append blocks of items in order; waits while the buffer is at capacity. As if item
        by item: an item goes in while the buffer holds less than its capacity, so it never
        holds more than that plus one item (a block is split where the capacity falls)."""
        for block in blocks:
            if self._item_cost is not None and len(block):   # once, for the whole block
                block.cost = np.asarray(self._item_cost(block), np.float64)
            while len(block):
                if self._tokens >= self.capacity_tokens:
                    self._changes.notify()   # what is appended so far may complete a window
                    started = time.perf_counter()
                    while self._tokens >= self.capacity_tokens and self._error is None:
                        await self._changes.wait()
                    self.blocked_s += time.perf_counter() - started
                self._raise_if_failed()
                room = self.capacity_tokens - self._tokens
                if block.total <= room:
                    part, block = block, block.subset(slice(0, 0))
                else:   # the items that start below the capacity go now, the rest wait
                    before = np.cumsum(block.length) - block.length
                    n = int(np.searchsorted(before, room, side="left"))
                    part, block = block.subset(slice(0, n)), block.subset(slice(n, None))
                self._append(part)
        self._changes.notify()

    def _append(self, block: ItemBlock) -> None:
        self._entries.append(block)
        self._tokens += block.total
        self._items += len(block)
        if self._markers == 0:
            self._head_tokens += block.total

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

    def _head(self, items: Optional[int] = None) -> tuple[list[ItemBlock], bool]:
        """The head blocks: those holding the first `items` items, or (None) those the window
        can reach (up to `window_tokens` tokens, or the marker); and whether a marker ends
        them."""
        blocks, count, tokens = [], 0, 0
        for entry in self._entries:
            if isinstance(entry, EndOfEpoch):
                return blocks, True
            if (count >= items) if items is not None else (tokens >= self.window_tokens):
                break   # enough at hand: the rest cannot be in it
            blocks.append(entry)
            count += len(entry)
            tokens += entry.total
        return blocks, False

    def window(self) -> Window:
        """The head window (call after wait_ready), and whether it holds the rest of the epoch:
        `plan.windows.head_window` over the items before the first marker."""
        blocks, ended = self._head()
        at_hand = _EMPTY if not blocks else blocks[0].length if len(blocks) == 1 else \
            np.concatenate([b.length for b in blocks])
        n, done = head_window(at_hand, self.window_tokens, ended) or (at_hand.shape[0], False)
        lengths, ages, ids, images, cost, visual = _columns(blocks, at_hand, n)
        return Window(lengths, ages, ids, done, images, cost, visual)

    def take(self, positions: np.ndarray, window_size: int,
             cut: Optional[dict[int, int]] = None) -> Taken:
        """Remove window items at `positions` (ascending), age the rest of the window.
        `cut`: position -> tokens, for items the plan takes only the head of; the rest stays in
        its place, as the remainder of its piece (`pieces`), aged like the rest of the window.

        Block by block, in Python over the few items a step takes from each (a source gives a
        step tens of items, from one to three blocks): a block the step takes nothing from
        keeps its columns, its window items aged in place; one whose leaving items are its
        first ones (a planner takes the oldest first, by age or by arrival) keeps views of its
        columns past them; any other is rebuilt from the items that stay (gathers)."""
        positions = np.asarray(positions, np.int64)
        blocks, _ = self._head(window_size)
        if not blocks:
            assert positions.size == 0 and window_size == 0, "took past the buffered items"
            return Taken([], None)
        wanted = positions.tolist()
        cut = cut or {}
        with_images = any(b.images is not None for b in blocks)
        out: list = []
        images: Optional[list] = [] if with_images else None
        kept = []
        removed = lo = i = 0
        for block in blocks:
            hi = lo + len(block)
            j = bisect.bisect_left(wanted, hi, i)   # wanted[i:j]: this block's
            aged = min(hi, window_size) - lo   # its window items (the window is a prefix)
            if i == j:   # nothing taken: the same columns, the window items aged in place
                if aged > 0:
                    block.age[:aged] += 1
                kept.append(block)
                lo = hi
                continue
            local = positions[i:j] - lo
            here = local.tolist()
            starts = block.start[local].tolist()
            lengths = block.length[local].tolist()
            cuts = [(k, q) for k, q in enumerate(here) if q + lo in cut]
            for k, q in cuts:   # the head of a cut item leaves; the rest stays
                lengths[k] = cut[q + lo]
            tokens = block.tokens
            out.extend([tokens[s:s + n] for s, n in zip(starts, lengths)])
            if with_images:
                refs = block.images
                images.extend([refs[q] if refs is not None else () for q in here])
            removed += sum(lengths)
            gone = [q for q in here if q + lo not in cut] if cuts else here
            m = len(gone)
            if m and gone[-1] == m - 1:   # the block's first m items leave: views past them
                rest = block.subset(slice(m, None))
                at = [q - m for _, q in cuts]
            else:
                stays = np.ones(len(block), bool)
                stays[gone] = False
                rest = block.subset(stays)   # new columns (gathers)
                at = [q - bisect.bisect_left(gone, q) for _, q in cuts]
            # Every taken item lies in the window, so the window items that stay are the
            # first of those that stay.
            if aged - m > 0:
                rest.age[:aged - m] += 1
            for (k, _), r in zip(cuts, at):   # a cut item's rest: its tokens after the head
                n = lengths[k]
                rest.start[r] += n
                rest.length[r] -= n
                rest.chunk[r] += n
                rest.total -= n
            if len(rest):
                kept.append(rest.compacted())
            i, lo = j, hi
        for _ in blocks:
            self._entries.popleft()
        self._entries.extendleft(reversed(kept))
        self._items -= positions.size - len(cut)
        self._tokens -= removed
        self._head_tokens -= removed
        self._changes.notify()
        return Taken(out, images)

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
            head += entry.total
        self._head_tokens = head
        self._changes.notify()

    @property
    def tokens(self) -> int:
        return self._tokens

    def __len__(self) -> int:
        return self._items


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

    def window(self) -> Window:
        return Window(_EMPTY, _EMPTY, np.zeros((0, 3), np.int64), True)

    def take(self, positions: np.ndarray, window_size: int, cut=None) -> Taken:
        assert len(positions) == 0 and window_size == 0, "a plan took from an unread source"
        return Taken([], None)

    def next_epoch(self) -> None:
        pass

    def __len__(self) -> int:
        return 0
