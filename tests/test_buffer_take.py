"""`SourceBuffer.take` on blocks: a block the step takes nothing from stays as it is, its window
items aged in place, its items beyond the window not; a block whose live items hold little of
its token buffer is copied into a buffer of its own (`ItemBlock.compacted`), every item keeping
its tokens, whatever the gaps (items taken), zero-length items and offsets."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from streamload.pipeline.buffer import ItemBlock, SourceBuffer

pytestmark = pytest.mark.core


@pytest.mark.parametrize("seed", range(8))
def test_compacted_keeps_every_item(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n = int(rng.integers(1, 60))
        length = rng.integers(0, 3000, n).astype(np.int64)
        length[rng.random(n) < 0.1] = 0   # zero-length items, in runs and at gaps
        gaps = np.where(rng.random(n) < 0.4, rng.integers(1, 500, n), 0)
        start = int(rng.integers(0, 100)) + np.concatenate(([0], np.cumsum(length + gaps)[:-1]))
        tokens = rng.integers(0, 256, int(start[-1] + length[-1]) + 1_000_000).astype(np.uint8)
        block = ItemBlock(0, tokens, start, length, np.arange(n), np.full(n, -1))
        small = block.compacted()
        assert small is not block and small.tokens.shape[0] == int(length.sum())
        for k in range(n):
            assert np.array_equal(small.item_tokens(k), block.item_tokens(k))


def test_take_compacts_what_stays():
    """Taking most of a range's items leaves the rest compacted, with their own tokens."""
    lengths = [5000 + 37 * k for k in range(100)]
    arrays = [np.full(n, k % 251, np.uint8) for k, n in enumerate(lengths)]
    block = ItemBlock.of_arrays(0, arrays, record=np.arange(100))
    buffer = SourceBuffer(10**8, 10**7)
    asyncio.run(buffer.put([block]))
    window = buffer.window()
    n = int(window.lengths.shape[0])
    taken = np.array([k for k in range(n) if k % 10 != 3], np.int64)   # 90 of 100 go
    out = buffer.take(taken, n)
    assert [int(a[0]) for a in out.tokens] == [k % 251 for k in taken.tolist()]
    rest = buffer.window()
    assert rest.ids[:, 1].tolist() == [k for k in range(100) if k % 10 == 3]
    head = buffer._entries[0]
    assert head.tokens.shape[0] == head.total   # copied: the range's buffer is let go
    for k, record in enumerate(rest.ids[:, 1].tolist()):
        assert np.array_equal(head.item_tokens(k), arrays[record])


def test_take_ages_the_window_of_untouched_blocks():
    """Three blocks of 4 items; the window holds 10 (the third block's first 2). A step takes
    from the first block only: the second block is the same object, all of it aged once, and
    the third block's window items are aged, its last two not. A second step ages them again."""
    blocks = [ItemBlock.of_arrays(b, [np.full(10, b, np.uint8)] * 4, record=np.arange(4))
              for b in range(3)]
    buffer = SourceBuffer(10**6, 100)
    asyncio.run(buffer.put(blocks))
    assert buffer.window().lengths.shape[0] == 10
    buffer.take(np.array([0, 2]), 10)
    ages = buffer.window().ages.tolist()   # first block: items 1, 3 stay
    assert buffer._entries[1] is blocks[1]
    assert ages == [1, 1, 1, 1, 1, 1, 1, 1, 0, 0][:len(ages)]
    assert np.concatenate([b.age for b in buffer._entries]).tolist() == \
        [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    buffer.take(np.array([], np.int64), 10)
    assert np.concatenate([b.age for b in buffer._entries]).tolist() == \
        [2, 2, 2, 2, 2, 2, 2, 2, 1, 1]


def test_take_a_cut_item_leaves_its_rest_aged():
    """The plan takes the head of item 1 (30 of its 100 tokens) and all of item 2: item 1's
    rest stays in place (chunk moved on by 30, its tokens the last 70), aged with the window;
    a block that only has a cut item taken from it is rebuilt too."""
    arrays = [np.arange(k * 100, (k + 1) * 100, dtype=np.int32) for k in range(4)]
    blocks = [ItemBlock.of_arrays(0, arrays[:3], record=np.arange(3), chunk=[0, 0, 0]),
              ItemBlock.of_arrays(1, arrays[3:], record=[0], chunk=[0])]
    buffer = SourceBuffer(10**6, 400)
    asyncio.run(buffer.put(blocks))
    out = buffer.take(np.array([1, 2, 3]), 4, cut={1: 30, 3: 10})
    assert [a.tolist() for a in out.tokens] == [list(range(100, 130)), list(range(200, 300)),
                                                 list(range(300, 310))]
    window = buffer.window()
    assert window.lengths.tolist() == [100, 70, 90]
    assert window.ids[:, 2].tolist() == [0, 30, 10]
    assert window.ages.tolist() == [1, 1, 1]
    rests = [buffer._entries[0].item_tokens(1), buffer._entries[1].item_tokens(0)]
    assert [r.tolist() for r in rests] == [list(range(130, 200)), list(range(310, 400))]
