"""Trainer-ready batches: labels and loss masks of real loader batches, rows padded to capacity,
and the Megatron / torchtitan adapters."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import streamload as sl
from streamload import pieces
from streamload.batch import IGNORE_INDEX
from corpus import write_jsonl_source

pytestmark = pytest.mark.timeout(60)

C, M = 256, 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Short and long documents: some are longer than a row and arrive as pieces."""
    root = tmp_path_factory.mktemp("trainer")
    write_jsonl_source(root, "web", shards=2, per_shard=50, median=120, seed=1)
    write_jsonl_source(root, "long", shards=1, per_shard=12, median=500, sigma=0.5, seed=2)
    return [sl.Source(str(root / "web")), sl.Source(str(root / "long"))]


def run(sources, **options) -> list[sl.Batch]:
    with sl.Loader(sources, micro_batch_tokens=C, micro_batches=M, epochs=1, prefetch_steps=1,
                   **options) as loader:
        return list(loader)   # held to the end: recycled row memory must not show


def check_targets(mb) -> None:
    """Labels and loss mask against the row's own tokens, segment by segment."""
    n = mb.tokens.shape[0]
    assert mb.labels.dtype == torch.int64 and mb.labels.shape == (n,)
    assert mb.loss_mask.dtype == torch.float32 and mb.loss_mask.shape == (n,)
    tokens, labels = mb.tokens.numpy(), mb.labels.numpy()
    cu = mb.cu_seqlens.numpy()
    if mb.padding:   # the last segment is padding, all -100 (checked by the caller)
        cu = cu[:-1]
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert labels[start:end - 1].tolist() == tokens[start + 1:end].tolist()
        assert labels[end - 1] == IGNORE_INDEX   # a document's end, or a piece's
    assert mb.loss_mask.numpy().tolist() == (labels != IGNORE_INDEX).astype(np.float32).tolist()


def test_labels_and_loss_mask_follow_every_document_and_piece(corpus):
    batches = run(corpus)
    split = 0
    for batch in batches:
        for mb in batch.micro_batches:
            check_targets(mb)
            assert mb.padding == 0 and mb.num_tokens == mb.tokens.shape[0]
            cu = mb.cu_seqlens.numpy()
            assert len(cu) == len(mb.sample_ids) + 1
            for sid, start, end in zip(mb.sample_ids, cu[:-1], cu[1:]):
                if pieces.parse(sid)[1] >= 0:   # a piece of a split document
                    split += 1
                    assert mb.labels[end - 1] == IGNORE_INDEX and mb.loss_mask[end - 1] == 0
                    assert (mb.loss_mask[start:end - 1] == 1).all()
    assert split > 0, "the corpus should hold documents longer than a row"
    # Every token but each segment's last one is a target.
    segments = sum(len(mb.sample_ids) for b in batches for mb in b.micro_batches)
    assert sum(int(mb.loss_mask.sum()) for b in batches for mb in b.micro_batches) == \
        sum(b.num_tokens for b in batches) - segments


def test_pad_to_capacity_gives_fixed_rows_with_a_padding_segment(corpus):
    plain = run(corpus)
    padded = run(corpus, pad_to="capacity", pad_token_id=7)
    assert [b.step for b in padded] == [b.step for b in plain]
    seen_padding = 0
    for batch, reference in zip(padded, plain):
        assert batch.num_tokens == reference.num_tokens
        for mb, ref in zip(batch.micro_batches, reference.micro_batches):
            # The same documents in the same places, then the padding.
            assert mb.sample_ids == ref.sample_ids
            used = ref.num_tokens
            assert mb.tokens.shape == mb.position_ids.shape == mb.labels.shape == (C,)
            assert mb.loss_mask.shape == (C,) and mb.num_tokens == used
            assert mb.padding == C - used
            assert torch.equal(mb.tokens[:used], ref.tokens)
            assert torch.equal(mb.position_ids[:used], ref.position_ids)
            assert torch.equal(mb.labels[:used], ref.labels)
            assert torch.equal(mb.loss_mask[:used], ref.loss_mask)
            check_targets(mb)
            cu = mb.cu_seqlens
            assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == C
            assert bool((cu[1:] >= cu[:-1]).all())
            if mb.padding:
                seen_padding += 1
                assert cu[:-1].tolist() == ref.cu_seqlens.tolist()   # one pseudo-document more
                assert (mb.tokens[used:] == 7).all()
                assert mb.position_ids[used:].tolist() == list(range(C - used))
                assert (mb.labels[used:] == IGNORE_INDEX).all() and (mb.loss_mask[used:] == 0).all()
            else:
                assert cu.tolist() == ref.cu_seqlens.tolist()
            # max_seqlen bounds every segment a varlen kernel is given, the padding's too.
            assert mb.max_seqlen == int(torch.diff(cu).max())
            assert mb.max_seqlen == max(ref.max_seqlen, mb.padding)
    assert seen_padding > 0


def test_megatron_and_torchtitan_adapters(corpus):
    batches = run(corpus, pad_to="capacity")
    for batch in batches:
        check_adapters(batch)


def check_adapters(batch) -> None:
    dicts = batch.to_megatron()
    assert isinstance(dicts, list) and len(dicts) == M
    for d, mb in zip(dicts, batch.micro_batches):
        assert set(d) == {"tokens", "labels", "loss_mask", "position_ids", "cu_seqlens",
                          "max_seqlen"}
        for key, dtype in (("tokens", torch.int64), ("labels", torch.int64),
                           ("loss_mask", torch.float32), ("position_ids", torch.int64)):
            assert d[key].shape == (1, C) and d[key].dtype == dtype, key
            assert d[key].data_ptr() == getattr(mb, key).data_ptr()   # a view, no copy
        assert d["cu_seqlens"].dtype == torch.int32
        assert d["cu_seqlens"].shape == (1, mb.cu_seqlens.shape[0])
        assert d["max_seqlen"].dtype == torch.int32 and d["max_seqlen"].shape == (1,)
        assert int(d["max_seqlen"][0]) == mb.max_seqlen
    titan = batch.to_torchtitan()
    assert isinstance(titan, list) and len(titan) == M
    for (inputs, labels), mb in zip(titan, batch.micro_batches):
        assert set(inputs) == {"input", "positions"}
        assert inputs["input"].shape == inputs["positions"].shape == labels.shape == (1, C)
        assert torch.equal(inputs["input"][0], mb.tokens)
        assert torch.equal(inputs["positions"][0], mb.position_ids)
        assert torch.equal(labels[0], mb.labels) and labels.dtype == torch.int64


def test_pad_options_are_validated():
    with pytest.raises(sl.ConfigError) as info:
        sl.LoaderConfig(pad_to="max")
    assert info.value.key == "pad_to"
    with pytest.raises(sl.ConfigError) as info:
        sl.LoaderConfig(pad_token_id=-1)
    assert info.value.key == "pad_token_id"
    assert sl.LoaderConfig().pad_to is None and sl.LoaderConfig().pad_token_id == 0
