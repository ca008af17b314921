"""A training loop fed by streamload: sources by URI, a mix, packed rows, and a checkpoint.

    python examples/train_loop.py s3://bucket/web/ /data/code/ --steps 100
    torchrun --nproc-per-node 2 examples/train_loop.py /data/web/ /data/code/

Under torchrun every rank joins the process group before it builds the Loader (a Loader built
without one, where torchrun says there are several ranks, raises UsageError rather than read
the whole data set on every rank). Each rank gets a Batch per step: M rows of at most C tokens,
with `cu_seqlens` and `position_ids` for varlen attention, `labels` and `loss_mask` for the
loss, and the same number of rows on every rank; the ranks read disjoint parts of the data.
The loader's state is saved with the model's, and a restart resumes from it exactly (also at
another world size). The "model" here is a stand-in: an embedding and a linear head.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import streamload as sl


def row_loss(model: torch.nn.Module, mb: sl.MicroBatch) -> torch.Tensor:
    """Next-token loss of one packed row, within its documents: `mb.labels` holds each token's
    next token in the same document, and -100 where there is none (a document's last token,
    padding), so no document is trained to predict the next one; `loss_mask` is 0.0 there."""
    logits = model(mb.tokens.clamp(max=255))    # byte tokens without a tokenizer
    per_token = torch.nn.functional.cross_entropy(logits, mb.labels.clamp(max=255),
                                                  ignore_index=-100, reduction="none")
    return (per_token * mb.loss_mask).sum() / mb.loss_mask.sum().clamp(min=1.0)


def train(args: argparse.Namespace) -> None:
    sources = [sl.Source(uri, weight=1.0) for uri in args.uris]
    model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with sl.Loader(sources, micro_batch_tokens=2048, micro_batches=2, planner="balanced",
                   epochs=args.epochs) as loader:
        checkpoint = Path(args.checkpoint)
        if checkpoint.exists():                      # resume exactly where the last run stopped
            loader.load_state_dict(json.loads(checkpoint.read_text()))
        done, step, loss, sample_ids = 0, None, float("nan"), []
        for done, batch in enumerate(loader, 1):
            for mb in batch.micro_batches:           # one row per micro-batch
                loss_tensor = row_loss(model, mb)
                loss_tensor.backward()
                loss = loss_tensor.item()
                sample_ids += mb.sample_ids
            optimizer.step()
            optimizer.zero_grad()
            step = batch.step
            if done >= args.steps:
                break
        if loader.rank == 0:                         # every rank holds the same state
            checkpoint.write_text(json.dumps(loader.state_dict()))
        if args.sample_ids:
            Path(args.sample_ids).mkdir(parents=True, exist_ok=True)
            (Path(args.sample_ids) / f"rank-{loader.rank}.txt").write_text(
                "".join(f"{i}\n" for i in sample_ids))
        fill = loader.stats()["tokens_per_step"]["fill"]
        print(f"rank {loader.rank} of {loader.world_size}: {done} steps, up to step {step}, "
              f"{len(sample_ids)} samples, fill {fill if fill is None else round(fill, 3)}, "
              f"loss {loss:.3f}, state saved to {checkpoint}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("uris", nargs="+", help="one source per URI (s3://..., a local folder or glob)")
    ap.add_argument("--steps", type=int, default=50, help="stop after this many steps")
    ap.add_argument("--epochs", type=int, default=None,
                    help="stop after this many epochs (default: none, stop at --steps)")
    ap.add_argument("--checkpoint", default="loader_state.json")
    ap.add_argument("--sample-ids", metavar="DIR", default=None,
                    help="write the ids of the samples each rank trained on to DIR/rank-R.txt")
    args = ap.parse_args()
    # torchrun sets WORLD_SIZE (and RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) for every rank.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:   # the trainer's group ("nccl" on GPUs); the loader makes a gloo one from it
        dist.init_process_group("gloo")
    try:
        train(args)
    finally:
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
