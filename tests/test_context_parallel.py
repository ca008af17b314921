"""Property tests of the context-parallel split of packed rows (`plan.context_parallel`).

Definition under test (Megatron-LM's THD split, `get_thd_batch_on_this_cp_rank` with Transformer
Engine's `thd_get_partitioned_indices`): every document is padded at its end to a multiple of
2·cp and cut into 2·cp equal chunks of m slots; CP rank r keeps chunks r and 2·cp−1−r.

Checked over random rows (documents of 1..5000 tokens, cp in 1, 2, 4, 8):
- the ranks' parts reassemble exactly into the row, every real token kept by exactly one rank;
- every rank holds the same number of slots, cu_seqlens_padded[-1] / cp, with the same local
  cu_seqlens (padded_len / cp per document);
- causal attention work, a query at offset p of its document costing p + 1 keys:
  counting padding slots, chunk c of a document costs m²·c + m(m+1)/2, so the pair
  {r, 2·cp−1−r} costs m²·(2·cp−1) + m(m+1) for every r and the ranks' work is EXACTLY equal;
  counting real tokens only, a rank's work is that minus the cost of its padding slots (each
  ≤ padded_len, fewer than 2·cp per document), so any two ranks differ by at most
  Σ_d pad_d · padded_len_d;
- the vectorized split equals an independent per-document loop written from the definition,
  and a per-token transcription of TE's kernel (local token → document → half → chunk);
- where megatron-core can be imported, Megatron's own zigzag selection (the per-sequence
  `get_batch_on_this_cp_rank`, applied to each padded document) gives the same tokens;
- cp = 1 is the identity.
"""
from __future__ import annotations

import bisect
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamload.errors import ConfigError
from streamload.plan.context_parallel import (
    cp_partition,
    cp_reassemble,
    cp_split,
    pad_documents,
)

pytestmark = pytest.mark.core
EXAMPLES = int(os.environ.get("CP_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FILL = {"tokens": -7, "labels": -100, "loss_mask": 0}
CPS = [1, 2, 4, 8]


def multiple(cp):
    """What documents are padded to: 2·cp, and nothing (1) for cp = 1, the identity."""
    return 2 * cp if cp > 1 else 1


def make_row(lengths, seed=0):
    """A packed row of documents with the given lengths: tokens, labels, loss_mask, per-document
    position_ids (starting anywhere, as a document cut by an earlier step would) and cu_seqlens."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    cu = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    n = int(cu[-1])
    starts = rng.integers(0, 3, size=lengths.size) * rng.integers(0, 1000, size=lengths.size)
    positions = np.concatenate([s + np.arange(k) for s, k in zip(starts.tolist(),
                                                                lengths.tolist())]
                               + [np.zeros(0, np.int64)]).astype(np.int64)
    arrays = {"tokens": rng.integers(0, 50000, size=n, dtype=np.int64),
              "position_ids": positions,
              "labels": rng.integers(-100, 50000, size=n, dtype=np.int64),
              "loss_mask": rng.integers(0, 2, size=n).astype(np.float32)}
    return arrays, cu


@st.composite
def rows(draw, max_docs=12):
    """Documents of 1..5000 tokens: mostly short, some long, some just off a multiple of 2·cp."""
    count = draw(st.integers(1, max_docs))
    kind = draw(st.sampled_from(["short", "long", "mixed", "near_multiple"]))
    if kind == "short":
        length = st.integers(1, 40)
    elif kind == "long":
        length = st.integers(1000, 5000)
    elif kind == "near_multiple":
        length = st.integers(1, 300).map(lambda q: max(1, 16 * q + (q % 3) - 1))
    else:
        length = st.one_of(st.integers(1, 40), st.integers(1, 5000))
    lengths = draw(st.lists(length, min_size=count, max_size=count))
    return lengths, draw(st.integers(0, 2 ** 32 - 1))


# ----------------------------------------------------------------------------- references

def reference_partition(cu, cp, r):
    """Per-document loop, straight from the definition: pad each document with -1 to a multiple
    of 2·cp, cut it into 2·cp chunks, keep chunks r and 2·cp−1−r."""
    index, local_lengths, padded_lengths = [], [], []
    for d in range(len(cu) - 1):
        doc = list(range(int(cu[d]), int(cu[d + 1])))
        if cp == 1:
            index += doc
            local_lengths.append(len(doc))
            padded_lengths.append(len(doc))
            continue
        while len(doc) % (2 * cp):
            doc.append(-1)
        m = len(doc) // (2 * cp)
        chunks = [doc[c * m:(c + 1) * m] for c in range(2 * cp)]
        index += chunks[r] + chunks[2 * cp - 1 - r]
        local_lengths.append(2 * m)
        padded_lengths.append(len(doc))
    return (np.asarray(index, dtype=np.int64), np.cumsum([0] + local_lengths),
            np.cumsum([0] + padded_lengths))


def reference_split(arrays, cu, cp, r, fill):
    """Per-document loop for the values, with position_ids continuing past a document's end."""
    out = {name: [] for name in arrays}
    for d in range(len(cu) - 1):
        a, b = int(cu[d]), int(cu[d + 1])
        padded = -(-(b - a) // (2 * cp)) * 2 * cp
        m = padded // (2 * cp)
        kept = list(range(r * m, (r + 1) * m)) + list(range((2 * cp - 1 - r) * m, (2 * cp - r) * m))
        for offset in (range(b - a) if cp == 1 else kept):
            for name, array in arrays.items():
                if offset < b - a:
                    out[name].append(array[a + offset])
                elif name in fill:
                    out[name].append(fill[name])
                else:   # position_ids
                    out[name].append(array[b - 1] + offset - (b - a) + 1)
    return {name: np.asarray(values, dtype=arrays[name].dtype).reshape(-1)
            for name, values in out.items()}


def te_kernel_indices(cu_padded, cp, r):
    """A transcription of TE's thd_partition_indices_kernel semantics, one local token at a time:
    indices into the PADDED stream. Local document bounds are cu_padded / cp; a local token in
    the first half of its document comes from chunk r, in the second from chunk 2·cp−1−r (the
    kernel writes that as i + (2·cp−2−r)·m, i counting from the local document's start)."""
    local_cu = [int(c) // cp for c in cu_padded]
    out = []
    for token in range(local_cu[-1]):
        seq = bisect.bisect_right(local_cu, token) - 1
        seq_len = local_cu[seq + 1] - local_cu[seq]
        i = token - local_cu[seq]
        offset = r if i < seq_len // 2 else 2 * cp - 2 - r
        out.append(i + local_cu[seq] * cp + seq_len // 2 * offset)
    return np.asarray(out, dtype=np.int64)


def padded_stream_to_row(cu, cu_padded):
    """For each slot of the padded stream, the index into the unpadded row, or -1 for a pad."""
    out = np.full(int(cu_padded[-1]), -1, dtype=np.int64)
    for d in range(len(cu) - 1):
        length = int(cu[d + 1] - cu[d])
        out[int(cu_padded[d]):int(cu_padded[d]) + length] = np.arange(cu[d], cu[d + 1])
    return out


def within_doc_offsets(cu):
    return np.concatenate([np.arange(k) for k in np.diff(cu).tolist()]
                          + [np.zeros(0, np.int64)]).astype(np.int64)


# ----------------------------------------------------------------------------- properties

@SETTINGS
@given(rows(), st.sampled_from(CPS))
def test_parts_reassemble_exactly_into_the_row(row, cp):
    lengths, seed = row
    arrays, cu = make_row(lengths, seed)
    parts = [cp_split(arrays, cu, cp, r, FILL)[0] for r in range(cp)]
    rebuilt = cp_reassemble(parts, cu, cp)
    assert set(rebuilt) == set(arrays)
    for name in arrays:
        assert rebuilt[name].dtype == arrays[name].dtype
        np.testing.assert_array_equal(rebuilt[name], arrays[name])
    # every real token is kept by exactly one rank, every padding slot is marked -1
    kept = np.concatenate([cp_partition(cu, cp, r)[0] for r in range(cp)])
    real = np.sort(kept[kept >= 0])
    np.testing.assert_array_equal(real, np.arange(int(cu[-1])))
    assert (kept < 0).sum() == int(pad_documents(cu, multiple(cp))[-1] - cu[-1])


@SETTINGS
@given(rows(), st.sampled_from(CPS))
def test_every_rank_gets_the_same_number_of_slots(row, cp):
    lengths, seed = row
    arrays, cu = make_row(lengths, seed)
    padded = pad_documents(cu, multiple(cp))
    padded_lengths = np.diff(padded)
    assert np.all(padded_lengths % multiple(cp) == 0)
    assert np.all(padded_lengths - np.diff(cu) < multiple(cp))
    assert np.all(padded_lengths >= np.diff(cu))
    expected_local = np.concatenate([[0], np.cumsum(padded_lengths // cp)])
    real_counts = []
    for r in range(cp):
        index, local_cu, padded_cu = cp_partition(cu, cp, r)
        local, split_cu, max_seqlen = cp_split(arrays, cu, cp, r, FILL)
        np.testing.assert_array_equal(padded_cu, padded)
        np.testing.assert_array_equal(local_cu, expected_local)
        np.testing.assert_array_equal(split_cu, expected_local)
        assert index.size == int(padded[-1]) // cp
        assert max_seqlen == int((padded_lengths // cp).max())
        for name in arrays:
            assert local[name].shape[0] == index.size
        real_counts.append(int((index >= 0).sum()))
    # real tokens differ only by the padding, fewer than 2·cp per document
    assert max(real_counts) - min(real_counts) <= int(padded[-1] - cu[-1])


@SETTINGS
@given(rows(), st.sampled_from(CPS))
def test_causal_attention_work_is_balanced(row, cp):
    lengths, seed = row
    _, cu = make_row(lengths, seed)
    padded = pad_documents(cu, multiple(cp))
    padded_lengths = np.diff(padded)
    if cp == 1:
        per_rank_exact = int(np.sum(padded_lengths * (padded_lengths + 1) // 2))
    else:
        m = padded_lengths // (2 * cp)
        per_rank_exact = int(np.sum(m * m * (2 * cp - 1) + m * (m + 1)))
    # offsets within the padded document of every local slot: position_ids that count from 0 in
    # each document, continued through the padding (no fill given for position_ids)
    offsets = {"position_ids": within_doc_offsets(cu)}
    padded_work, real_work = [], []
    for r in range(cp):
        local, _, _ = cp_split(offsets, cu, cp, r, {})
        index = cp_partition(cu, cp, r)[0]
        cost = local["position_ids"] + 1          # a query at offset p sees p + 1 keys
        padded_work.append(int(cost.sum()))
        real_work.append(int(cost[index >= 0].sum()))
    assert padded_work == [per_rank_exact] * cp
    bound = int(np.sum((padded_lengths - np.diff(cu)) * padded_lengths))
    assert max(real_work) - min(real_work) <= bound
    total_real = int(np.sum(np.diff(cu) * (np.diff(cu) + 1) // 2))
    assert sum(real_work) == total_real


@SETTINGS
@given(rows(), st.sampled_from(CPS))
def test_matches_the_per_document_reference(row, cp):
    lengths, seed = row
    arrays, cu = make_row(lengths, seed)
    for r in range(cp):
        index, local_cu, padded_cu = cp_partition(cu, cp, r)
        ref_index, ref_local, ref_padded = reference_partition(cu, cp, r)
        np.testing.assert_array_equal(index, ref_index)
        np.testing.assert_array_equal(local_cu, ref_local)
        np.testing.assert_array_equal(padded_cu, ref_padded)
        local, _, _ = cp_split(arrays, cu, cp, r, FILL)
        expected = reference_split(arrays, cu, cp, r, FILL)
        for name in arrays:
            np.testing.assert_array_equal(local[name], expected[name], err_msg=name)


@settings(max_examples=max(10, EXAMPLES // 3), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rows(max_docs=6), st.sampled_from([2, 4, 8]))
def test_matches_te_partitioned_indices(row, cp):
    """TE returns indices into the padded stream (cu_seqlens_padded); mapped back to the row
    they are cp_partition's index, -1 at padding."""
    lengths, seed = row
    _, cu = make_row(lengths, seed)
    padded = pad_documents(cu, 2 * cp)
    to_row = padded_stream_to_row(cu, padded)
    for r in range(cp):
        np.testing.assert_array_equal(cp_partition(cu, cp, r)[0],
                                      to_row[te_kernel_indices(padded, cp, r)])


@SETTINGS
@given(rows())
def test_cp_one_is_the_identity(row):
    lengths, seed = row
    arrays, cu = make_row(lengths, seed)
    index, local_cu, padded_cu = cp_partition(cu, 1, 0)
    np.testing.assert_array_equal(index, np.arange(int(cu[-1])))
    np.testing.assert_array_equal(local_cu, cu)
    np.testing.assert_array_equal(padded_cu, cu)
    local, split_cu, max_seqlen = cp_split(arrays, cu, 1, 0, FILL)
    for name in arrays:
        np.testing.assert_array_equal(local[name], arrays[name])
    np.testing.assert_array_equal(split_cu, cu)
    assert max_seqlen == int(np.diff(cu).max())


# ----------------------------------------------------------------------------- examples

def test_worked_example():
    """Documents of 5, 3 and 12 tokens, cp = 2: padded to 8, 4 and 12 (multiples of 4)."""
    cu = np.array([0, 5, 8, 20], dtype=np.int32)
    np.testing.assert_array_equal(pad_documents(cu, 4), [0, 8, 12, 24])
    index0, local_cu, _ = cp_partition(cu, 2, 0)
    index1, _, _ = cp_partition(cu, 2, 1)
    # doc 0: chunks [0 1][2 3][4 -][- -]; doc 1: [5][6][7][-]; doc 2: [8 9 10]...[17 18 19]
    np.testing.assert_array_equal(index0, [0, 1, -1, -1, 5, -1, 8, 9, 10, 17, 18, 19])
    np.testing.assert_array_equal(index1, [2, 3, 4, -1, 6, 7, 11, 12, 13, 14, 15, 16])
    np.testing.assert_array_equal(local_cu, [0, 4, 6, 12])
    positions = np.array([0, 1, 2, 3, 4, 0, 1, 2] + list(range(12)))
    local, _, max_seqlen = cp_split({"position_ids": positions, "tokens": np.arange(20) + 100},
                                    cu, 2, 0, {"tokens": 0})
    # padding positions continue the document: 4 -> 5, 6, 7 (slots 6 and 7 here); 2 -> 3
    np.testing.assert_array_equal(local["position_ids"], [0, 1, 6, 7, 0, 3, 0, 1, 2, 9, 10, 11])
    np.testing.assert_array_equal(local["tokens"], [100, 101, 0, 0, 105, 0, 108, 109, 110,
                                                    117, 118, 119])
    assert max_seqlen == 6
    local, _, _ = cp_split({"position_ids": positions}, cu, 2, 0, {"position_ids": 0})
    np.testing.assert_array_equal(local["position_ids"], [0, 1, 0, 0, 0, 0, 0, 1, 2, 9, 10, 11])


def test_thousands_of_documents():
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 17, size=4000)
    arrays, cu = make_row(lengths, seed=3)
    for cp in (2, 8):
        for r in (0, cp - 1):
            index = cp_partition(cu, cp, r)[0]
            np.testing.assert_array_equal(index, reference_partition(cu, cp, r)[0])
        parts = [cp_split(arrays, cu, cp, r, FILL)[0] for r in range(cp)]
        rebuilt = cp_reassemble(parts, cu, cp)
        for name in arrays:
            np.testing.assert_array_equal(rebuilt[name], arrays[name])


def test_empty_documents_and_empty_rows():
    cu = np.array([0, 0, 3, 3, 3, 10, 10])
    arrays, _ = make_row(np.diff(cu), seed=1)
    for cp in CPS:
        parts = [cp_split(arrays, cu, cp, r, FILL) for r in range(cp)]
        for _, local_cu, _ in parts:
            assert np.all(np.diff(local_cu)[[0, 2, 3, 5]] == 0)
        rebuilt = cp_reassemble([p[0] for p in parts], cu, cp)
        for name in arrays:
            np.testing.assert_array_equal(rebuilt[name], arrays[name])
    empty = {name: a[:0] for name, a in arrays.items()}
    local, local_cu, max_seqlen = cp_split(empty, np.array([0]), 4, 3, FILL)
    assert all(a.size == 0 for a in local.values())
    np.testing.assert_array_equal(local_cu, [0])
    assert max_seqlen == 0
    assert cp_reassemble([local] * 4, np.array([0]), 4)["tokens"].size == 0


def test_multidimensional_arrays_and_extra_fill_keys():
    """Per-token arrays may carry trailing axes (e.g. 3-axis rope positions); `fill` may name
    fields the caller does not have (stage_view passes the same fill to every stage)."""
    cu = np.array([0, 3, 9])
    pos3 = np.stack([within_doc_offsets(cu)] * 3, axis=1) + np.array([0, 10, 20])
    local, _, _ = cp_split({"position_ids": pos3}, cu, 2, 0, {"labels": -100})
    # doc 0 (3 -> 4, m = 1): chunks 0 and 3 = [0] [pad: 3]; doc 1 (6 -> 8, m = 2): [0 1] [6 7]
    np.testing.assert_array_equal(local["position_ids"][:, 0], [0, 3, 0, 1, 6, 7])
    np.testing.assert_array_equal(local["position_ids"][:, 2], [20, 23, 20, 21, 26, 27])
    parts = [cp_split({"position_ids": pos3}, cu, 2, r, {})[0] for r in range(2)]
    np.testing.assert_array_equal(cp_reassemble(parts, cu, 2)["position_ids"], pos3)


def test_bad_arguments():
    arrays, cu = make_row([5, 7])
    with pytest.raises(ConfigError, match="fill"):
        cp_split(arrays, cu, 2, 0, {"tokens": 0})
    with pytest.raises(ConfigError, match="tokens"):
        cp_split({"tokens": arrays["tokens"][:-1]}, cu, 2, 0, FILL)
    with pytest.raises(ConfigError, match="cp_rank"):
        cp_partition(cu, 2, 2)
    with pytest.raises(ConfigError, match="cp"):
        cp_partition(cu, 0, 0)
    with pytest.raises(ConfigError, match="cu_seqlens"):
        cp_partition(np.array([0, 5, 3]), 2, 0)
    with pytest.raises(ConfigError, match="parts"):
        cp_reassemble([cp_split(arrays, cu, 2, 0, FILL)[0]], cu, 2)


# ----------------------------------------------------------------------------- Megatron

def _megatron_zigzag():
    """Megatron's per-sequence zigzag (`get_batch_on_this_cp_rank` in megatron/core/utils.py,
    chunks r and 2·cp−1−r of one [1, L] sequence), callable without a process group, or None.
    Its THD path needs Transformer Engine's CUDA `thd_get_partitioned_indices`, so on CPU the
    comparison applies Megatron's selection to each padded document, which is what TE's kernel
    does for the packed row (the TE-kernel test above checks that side)."""
    try:
        import megatron.core.utils as mcu
        import torch
    except Exception:  # noqa: BLE001  (absent, or failing to import without a GPU)
        return None

    class Group:
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def rank(self):
            return self._rank

    def zigzag(values, cp, r, patch):
        batch = {"tokens": torch.from_numpy(values).reshape(1, -1).clone()}
        group = Group(cp, r)
        if hasattr(mcu, "_get_batch_on_this_cp_rank_per_sequence_balancing"):
            patch.setattr(torch.distributed, "get_world_size", lambda g=None: g.size())
            patch.setattr(torch.distributed, "get_rank", lambda g=None: g.rank())
            out = mcu._get_batch_on_this_cp_rank_per_sequence_balancing(batch, cp_group=group)
        else:
            patch.setattr(mcu, "get_pg_size", lambda g=None: g.size())
            patch.setattr(mcu, "get_pg_rank", lambda g=None: g.rank())
            out = mcu.get_batch_on_this_cp_rank(batch, cp_group=group)
        return out["tokens"].reshape(-1).numpy()

    return zigzag


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_matches_megatron_zigzag(cp, monkeypatch):
    zigzag = _megatron_zigzag()
    if zigzag is None:
        pytest.skip("megatron-core is not importable here")
    rng = np.random.default_rng(cp)
    lengths = np.concatenate([rng.integers(1, 40, size=20), rng.integers(1000, 5000, size=3)])
    arrays, cu = make_row(lengths, seed=cp)
    padded = pad_documents(cu, 2 * cp)
    tokens = arrays["tokens"]
    for r in range(cp):
        expected = []
        for d in range(len(lengths)):
            doc = np.full(int(padded[d + 1] - padded[d]), FILL["tokens"], dtype=np.int64)
            doc[:lengths[d]] = tokens[cu[d]:cu[d + 1]]
            with monkeypatch.context() as patch:
                expected.append(zigzag(doc, cp, r, patch))
        local, _, _ = cp_split({"tokens": tokens}, cu, cp, r, FILL)
        np.testing.assert_array_equal(local["tokens"], np.concatenate(expected))
