"""pack_rows against a plain reference, with the token dtypes items really hold."""
from __future__ import annotations

import numpy as np
import pytest

from streamload.formats.base import RawRecord
from streamload.pipeline.transform import records_to_items, utf8_bytes
from streamload.plan.packing import pack_rows


def reference_pack(token_arrays, rows, num_rows):
    """Row by row, item by item: what pack_rows must produce."""
    out = []
    for row in range(num_rows):
        members = [i for i, r in enumerate(rows) if r == row]
        tokens = [int(t) for i in members for t in token_arrays[i]]
        positions = [p for i in members for p in range(len(token_arrays[i]))]
        cu = np.cumsum([0] + [len(token_arrays[i]) for i in members])
        out.append((tokens, positions, cu.tolist(), members))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_pack_rows_matches_the_reference_for_mixed_dtypes(seed):
    rng = np.random.default_rng(seed)
    num_rows, n_items = 4, int(rng.integers(0, 30))
    dtypes = [np.uint8, np.int32, np.int64]
    arrays = [rng.integers(0, 200, size=int(rng.integers(0, 40))).astype(dtypes[k % 3])
              for k in range(n_items)]
    rows = rng.integers(0, num_rows - 1, size=n_items)   # the last row stays empty
    packed = pack_rows(arrays, rows, num_rows, capacity=10_000)
    assert len(packed) == num_rows
    for row, (tokens, positions, cu, members) in zip(packed, reference_pack(arrays, rows, num_rows)):
        assert row.tokens.dtype == np.int64 and row.tokens.tolist() == tokens
        assert row.position_ids.dtype == np.int64 and row.position_ids.tolist() == positions
        assert row.cu_seqlens.dtype == np.int32 and row.cu_seqlens.tolist() == cu
        assert row.item_indices.tolist() == members


def test_pack_rows_rejects_a_row_over_capacity():
    arrays = [np.ones(6, np.uint8), np.ones(5, np.int32)]
    with pytest.raises(AssertionError, match="row 1 holds 11 tokens > capacity 10"):
        pack_rows(arrays, np.array([1, 1]), 2, capacity=10)


def test_byte_tokens_are_uint8_and_split_chunks_keep_the_bytes():
    text = "naïve Zürich 東京 " * 20
    data = text.encode("utf-8")
    assert utf8_bytes(text).dtype == np.uint8 and utf8_bytes(text).tobytes() == data
    items, counts = records_to_items([RawRecord(7, text), RawRecord(8, "")], shard=0,
                                     tokenizer=None, capacity=100, long_documents="split")
    assert b"".join(item.tokens.tobytes() for item in items) == data
    assert [item.chunk for item in items] == list(range(-(-len(data) // 100)))
    assert counts.tokens == len(data) and counts.samples == len(items) and counts.empty == 1
