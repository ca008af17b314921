"""Megatron-LM's external data loader fed by streamload: the dict contract, shown without Megatron.

    python examples/megatron_external.py /data/web/ /data/code/ --steps 5
    python examples/megatron_external.py                 # a tiny corpus generated in a temp dir

With `--dataloader-type external`, Megatron takes whatever the dataset provider returns as the
training data iterator and calls `next()` on it once per micro-batch: `forward_step(
data_iterator, model)` runs M times per step (M = global batch / (micro-batch size x DP)), and
each time its `get_batch` reads one dict, {tokens, labels, loss_mask, position_ids:
[1, n]; cu_seqlens: int32 [1, segments + 1]; max_seqlen: int32 [1]} (cu_seqlens selects the
packed THD path: documents attend only within themselves).

`Batch.to_megatron()` gives that dict for each of the step's M rows, so the provider returns

    iter(d for batch in loader for d in batch.to_megatron())

with Megatron set to `--micro-batch-size 1 --seq-length C --global-batch-size M*DP`, and the
loader to `micro_batch_tokens=C, micro_batches=M, pad_to="capacity"`: Megatron's other tensor-
parallel ranks receive the batch by broadcast into [1, seq_length] buffers, so every row must
hold exactly C tokens (the padding is the row's last segment, with loss mask 0). Below, the
stand-ins `get_batch` and `forward_step` consume the dicts the way pretrain_gpt.py does, on a
toy model, and check the contract as they go.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import streamload as sl

C, M = 512, 2   # --seq-length, and micro-batches per step on each DP rank


def make_provider(loader: sl.Loader):
    """The `train_valid_test_datasets_provider` to give Megatron's `pretrain(...)`: under the
    external loader type, what it returns for training is the data iterator itself (one
    micro-batch dict per next()); no validation or test set here."""
    def train_valid_test_datasets_provider(train_val_test_num_samples=None):
        return iter(d for batch in loader for d in batch.to_megatron()), None, None
    return train_valid_test_datasets_provider


def get_batch(data_iterator):
    """pretrain_gpt.py's get_batch on tensor-parallel rank 0: one dict per call."""
    data = next(data_iterator)
    tokens, labels = data["tokens"], data["labels"]
    loss_mask, position_ids = data["loss_mask"], data["position_ids"]
    for t, dtype in ((tokens, torch.int64), (labels, torch.int64), (loss_mask, torch.float32),
                     (position_ids, torch.int64)):
        assert t.shape == (1, C) and t.dtype == dtype, (t.shape, t.dtype)
    cu_seqlens, max_seqlen = data["cu_seqlens"], data["max_seqlen"]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.shape[0] == 1   # micro-batch size 1
    assert int(cu_seqlens[0, -1]) == C and max_seqlen.shape == (1,)
    # What Megatron turns them into: PackedSeqParams(qkv_format="thd", cu_seqlens_q=...,
    # max_seqlen_q=...), for Transformer Engine's attention and the fused RoPE.
    packed_seq_params = {"qkv_format": "thd", "cu_seqlens_q": cu_seqlens[0],
                         "cu_seqlens_kv": cu_seqlens[0], "max_seqlen_q": int(max_seqlen[0]),
                         "max_seqlen_kv": int(max_seqlen[0])}
    return tokens, labels, loss_mask, position_ids, packed_seq_params


def forward_step(data_iterator, model):
    """Megatron's forward step: the model's per-token losses, masked and summed (its loss_func
    returns the sum and the number of tokens counted)."""
    tokens, labels, loss_mask, position_ids, packed_seq_params = get_batch(data_iterator)
    logits = model(tokens.clamp(max=255))                  # byte tokens: no tokenizer here
    # Megatron's vocab-parallel cross entropy scores every token; the mask removes the -100s.
    losses = torch.nn.functional.cross_entropy(logits.view(-1, 256), labels.clamp(min=0).view(-1),
                                               reduction="none")
    mask = loss_mask.view(-1)
    return (losses * mask).sum(), mask.sum(), len(packed_seq_params["cu_seqlens_q"]) - 1


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("uris", nargs="*", help="sources (s3://..., a folder or glob); none: a tiny "
                                            "generated corpus")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        uris = args.uris or [write_tiny_corpus(Path(tmp))]
        loader = sl.Loader([sl.Source(uri) for uri in uris], micro_batch_tokens=C,
                           micro_batches=M, pad_to="capacity", pad_token_id=0)
        with loader:
            data_iterator, _, _ = make_provider(loader)()   # what pretrain() does with it
            model = torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for step in range(args.steps):         # Megatron's train_step
                total = counted = segments = 0
                for _ in range(M):                 # forward_backward_func: M micro-batches
                    loss, num_tokens, n = forward_step(data_iterator, model)
                    loss.backward()
                    total, counted = total + loss.item(), counted + int(num_tokens)
                    segments += n
                optimizer.step()
                optimizer.zero_grad()
                print(f"step {step}: {M} micro-batches of [1, {C}], {segments} segments, "
                      f"{counted} tokens in the loss, loss {total / max(counted, 1):.3f}")


def write_tiny_corpus(root: Path) -> str:
    from streamload.formats import write_jsonl
    words = "the data model train token loss step rank of and to in".split()
    docs = [" ".join(words[(i * 7 + k) % len(words)] for k in range(3 + (i * 37) % 60))
            for i in range(300)]
    write_jsonl(root / "tiny.jsonl", docs)
    return str(root / "tiny.jsonl")


if __name__ == "__main__":
    main()
