"""A buffer's per-item extra cost (an image source's encoder cost) is worked out once, as a
block comes in, and travels with its items: through windows, takes (what stays, aged), and the
summary that carries it to the planner."""
from __future__ import annotations

import asyncio

import numpy as np

from streamload.collective.messages import SourceWindow, decode_summaries, encode_summary
from streamload.pipeline.buffer import ItemBlock, SourceBuffer

import pytest

pytestmark = pytest.mark.core


def block(shard: int, lengths: list[int]) -> ItemBlock:
    return ItemBlock.of_arrays(shard, [np.full(n, shard, np.int32) for n in lengths],
                               record=np.arange(len(lengths)))


def test_cost_is_computed_once_per_block_and_follows_its_items():
    calls = []

    def item_cost(b: ItemBlock) -> np.ndarray:   # a cost that names the item: shard, record
        calls.append(len(b))
        return 1000.0 * b.shard + b.record.astype(np.float64)

    async def run():
        buffer = SourceBuffer(10 ** 6, 25, item_cost)
        await buffer.put([block(1, [10, 10, 10]), block(2, [10, 10])])
        assert calls == [3, 2]
        first = buffer.window()
        assert first.cost.tolist() == [1000.0, 1001.0, 1002.0]   # 3 items hold 25 tokens
        assert buffer.window().cost.tolist() == first.cost.tolist()
        buffer.take(np.array([1]), first.lengths.shape[0])   # item (1, 1) goes; the others are aged
        second = buffer.window()
        assert second.ids[:, :2].tolist() == [[1, 0], [1, 2], [2, 0]]
        assert second.cost.tolist() == [1000.0, 1002.0, 2000.0]
        assert second.ages.tolist() == [1, 1, 0]
        assert calls == [3, 2]   # nothing worked out again

    asyncio.run(run())


def test_a_buffer_without_item_costs_sends_zeros():
    async def run():
        buffer = SourceBuffer(10 ** 6, 15)
        await buffer.put([block(0, [10, 10, 10])])
        return buffer.window()

    window = asyncio.run(run())
    assert window.cost is None
    summary = encode_summary([SourceWindow(window.lengths, window.ages, window.ids, window.done,
                                           window.cost),
                              SourceWindow(window.lengths, window.ages, window.ids, True,
                                           np.array([0.5, 2.5]))])
    decoded = decode_summaries([summary], 2)
    c = decoded.candidates
    assert c.length.tolist() == [10, 10, 10, 10]
    assert c.extra_cost.tolist() == [0.0, 0.0, 0.5, 2.5]
    assert decoded.ids[:, 1].tolist() == [0, 1, 0, 1]
    assert decoded.exhausted.tolist() == [[False, True]]
