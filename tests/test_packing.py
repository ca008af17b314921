"""pack_rows against a plain reference, with the token dtypes items really hold."""
from __future__ import annotations

import numpy as np
import pytest

from streamload import pieces

from streamload.formats.base import RawRecord
from streamload.pipeline.transform import records_to_block, utf8_bytes
from streamload.plan.packing import IGNORE_INDEX, pack_rows, row_memory_words, split_row_memory


def reference_pack(token_arrays, rows, num_rows, capacity=None, pad_id=0):
    """Row by row, item by item: what pack_rows must produce (padded to `capacity` if given)."""
    out = []
    for row in range(num_rows):
        members = [i for i, r in enumerate(rows) if r == row]
        segments = [[int(t) for t in token_arrays[i]] for i in members]
        segments = [s for s in segments if s]          # an empty item is no segment
        pad = capacity - sum(map(len, segments)) if capacity is not None else 0
        tokens = [t for s in segments for t in s] + [pad_id] * pad
        positions = [p for s in segments for p in range(len(s))] + list(range(pad))
        labels = [t for s in segments for t in s[1:] + [-100]] + [-100] * pad
        cu = np.cumsum([0] + [len(token_arrays[i]) for i in members] + ([pad] if pad else []))
        longest = max([len(s) for s in segments] + [pad, 0])
        out.append((tokens, positions, labels, cu.tolist(), members, longest, pad))
    return out


@pytest.mark.core
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_pack_rows_matches_the_reference_for_mixed_dtypes(seed, reuse, pad):
    rng = np.random.default_rng(seed)
    num_rows, n_items, capacity = 4, int(rng.integers(0, 30)), 400
    dtypes = [np.uint8, np.int32, np.int64]
    arrays = [rng.integers(0, 200, size=int(rng.integers(0, 40))).astype(dtypes[k % 3])
              for k in range(n_items)]
    rows = rng.integers(0, num_rows - 1, size=n_items)   # the last row stays empty
    if pad and n_items:   # one row exactly full: no padding segment
        arrays.append(np.arange(capacity - sum(len(a) for a, r in zip(arrays, rows) if r == 0)))
        rows = np.append(rows, 0)
    # Reused memory holds whatever the last step left there: none of it may show.
    out = None
    if reuse:
        memory = np.full(row_memory_words(num_rows * capacity), -7, np.int64)
        out = split_row_memory(memory, num_rows * capacity)
    # A caller's own 0, 1, 2, ... for the positions, as the loader keeps one (a short one is
    # made anew)
    counting = np.arange(capacity if seed % 2 else 5) if reuse else None
    packed = pack_rows(arrays, rows, num_rows, capacity=capacity, out=out,
                       pad_to_capacity=pad, pad_token_id=3, counting=counting)
    assert len(packed) == num_rows
    expected = reference_pack(arrays, rows, num_rows, capacity if pad else None, pad_id=3)
    for row, (tokens, positions, labels, cu, members, longest, padding) in zip(packed, expected):
        assert row.tokens.dtype == np.int64 and row.tokens.tolist() == tokens
        assert row.position_ids.dtype == np.int64 and row.position_ids.tolist() == positions
        assert row.labels.dtype == np.int64 and row.labels.tolist() == labels
        assert row.loss_mask.dtype == np.float32
        assert row.loss_mask.tolist() == [float(label != IGNORE_INDEX) for label in labels]
        assert row.cu_seqlens.dtype == np.int32 and row.cu_seqlens.tolist() == cu
        assert row.item_indices.tolist() == members
        assert row.max_seqlen == longest and row.padding == padding
        if pad:
            assert row.tokens.shape[0] == capacity and cu[-1] == capacity


@pytest.mark.core
def test_padded_rows_are_consecutive_slices_of_the_step_arrays():
    arrays = [np.arange(1, 6), np.arange(1, 4), np.arange(1, 5)]
    memory = np.zeros(row_memory_words(3 * 10), np.int64)
    packed = pack_rows(arrays, np.array([0, 2, 0]), 3, capacity=10,
                       out=split_row_memory(memory, 30), pad_to_capacity=True)
    tokens = memory[:30]
    for r, row in enumerate(packed):
        assert np.shares_memory(row.tokens, tokens) and row.tokens.base is memory
        assert row.tokens.ctypes.data == tokens[r * 10:].ctypes.data
        assert row.loss_mask.base is memory
    assert [row.cu_seqlens.tolist() for row in packed] == [[0, 5, 9, 10], [0, 10], [0, 3, 10]]
    assert packed[0].labels.tolist() == [2, 3, 4, 5, -100, 2, 3, 4, -100, -100]
    assert packed[0].max_seqlen == 5 and packed[1].max_seqlen == 10 and packed[2].max_seqlen == 7


@pytest.mark.core
def test_pack_rows_rejects_a_row_over_capacity():
    arrays = [np.ones(6, np.uint8), np.ones(5, np.int32)]
    with pytest.raises(AssertionError, match="row 1 holds 11 tokens > capacity 10"):
        pack_rows(arrays, np.array([1, 1]), 2, capacity=10)


@pytest.mark.core
def test_byte_tokens_are_uint8_and_split_chunks_keep_the_bytes():
    text = "naïve Zürich 東京 " * 20
    data = text.encode("utf-8")
    assert utf8_bytes(text).dtype == np.uint8 and utf8_bytes(text).tobytes() == data
    block, counts = records_to_block([RawRecord(7, text), RawRecord(8, "")], shard=0,
                                     capacity=100, long_documents="split")
    assert block.tokens.dtype == np.uint8
    assert b"".join(block.item_tokens(k).tobytes() for k in range(len(block))) == data
    assert block.chunk.tolist() == [pieces.piece(k) for k in range(-(-len(data) // 100))]
    assert counts.tokens == len(data) and counts.samples == len(block) and counts.empty == 1


@pytest.mark.core
def test_recycler_reuses_an_array_only_once_nothing_refers_to_it():
    import torch

    from streamload.pipeline.recycle import ArrayRecycler
    memory = ArrayRecycler(1000, np.int64, keep=2)
    first = memory.take()
    address = first.ctypes.data
    del first
    assert memory.take().ctypes.data == address and memory.allocated == 1   # free: reused
    held = memory.take()
    row = torch.from_numpy(held[10:20])           # what a micro-batch keeps of it: a tensor
    del held
    other = memory.take()                          # the tensor pins the first array
    assert other.ctypes.data != address and memory.allocated == 2
    del other
    third = memory.take()                          # the second array is free again
    assert third.ctypes.data != address and memory.allocated == 2
    extra = memory.take()                          # both pinned, keep=2: a new one, not kept
    assert memory.allocated == 3 and len(memory._arrays) == 2
    del row, third, extra
    assert memory.take().ctypes.data == address    # the tensor is gone: reused


def test_batches_the_trainer_keeps_are_never_written_again(tmp_path):
    """The loader packs into reused memory: every batch held to the end (whole, or a tensor of
    one micro-batch) must still hold its own documents' bytes."""
    import streamload as sl
    from streamload.formats import write_jsonl
    rng = np.random.default_rng(3)
    docs = ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(n)))
            for n in rng.integers(5, 60, 400)]
    write_jsonl(tmp_path / "a.jsonl", docs)
    kept = []
    with sl.Loader([sl.Source(str(tmp_path / "a.jsonl"))], micro_batch_tokens=64,
                   micro_batches=2, epochs=1, prefetch_steps=1) as loader:
        for step, batch in enumerate(loader):
            for mb in batch.micro_batches:
                # Alternate: keep the micro-batch, or only a tensor slice of its tokens.
                kept.append((mb.sample_ids, mb.cu_seqlens.numpy().copy(),
                             mb.tokens if step % 2 else mb.tokens[:]))
        recycler = loader._runtime.delivery._row_memory
    assert len(kept) > 2 * (recycler.keep + 1)    # more steps than arrays the recycler keeps
    got = {}
    for ids, cu, tokens in kept:
        for k, sid in enumerate(ids):
            got[sid] = bytes(tokens.numpy()[cu[k]:cu[k + 1]].astype(np.uint8)).decode()
    assert got == {f"a/a.jsonl/{i}": d for i, d in enumerate(docs)}


def test_batches_the_trainer_drops_are_written_again(tmp_path):
    import streamload as sl
    from streamload.formats import write_jsonl
    write_jsonl(tmp_path / "a.jsonl", ["abcdefghij" * 3] * 600)
    with sl.Loader([sl.Source(str(tmp_path / "a.jsonl"))], micro_batch_tokens=64,
                   micro_batches=2, epochs=1, prefetch_steps=1) as loader:
        steps = sum(1 for _ in loader)
        recycler = loader._runtime.delivery._row_memory
    assert steps > 100 and recycler.allocated <= recycler.keep + 1, (steps, recycler.allocated)
