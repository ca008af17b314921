"""A training loop fed by streamload: sources by URI, a mix, packed rows, and a checkpoint.

    python examples/train_loop.py s3://bucket/web/ /data/code/ --steps 100
    torchrun --nproc-per-node 2 examples/train_loop.py /data/web/ /data/code/

Each rank gets a Batch per step: M rows of at most C tokens, with `cu_seqlens` and
`position_ids` for varlen attention, and the same number of rows on every rank. The loader's
state is saved with the model's, and a restart resumes from it exactly (also at another world
size). The "model" here is a stand-in: an embedding and a linear head.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import streamload as sl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("uris", nargs="+", help="one source per URI (s3://..., a local folder or glob)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--checkpoint", default="loader_state.json")
    args = ap.parse_args()

    sources = [sl.Source(uri, weight=1.0) for uri in args.uris]
    model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with sl.Loader(sources, micro_batch_tokens=2048, micro_batches=2, planner="balanced") as loader:
        checkpoint = Path(args.checkpoint)
        if checkpoint.exists():                      # resume exactly where the last run stopped
            loader.load_state_dict(json.loads(checkpoint.read_text()))
        for done, batch in enumerate(loader, 1):
            for mb in batch.micro_batches:           # one row per micro-batch
                tokens = mb.tokens.clamp(max=255)    # byte tokens without a tokenizer
                logits = model(tokens[:-1])
                loss = torch.nn.functional.cross_entropy(logits, tokens[1:])
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if done >= args.steps:
                break
        if loader.rank == 0:
            checkpoint.write_text(json.dumps(loader.state_dict()))
        stats = loader.stats()["tokens_per_step"]
        print(f"rank {loader.rank}: {done} steps, up to step {batch.step}, fill "
              f"{stats['fill']:.3f}, loss {loss.item():.3f}, state saved to {checkpoint}")


if __name__ == "__main__":
    main()
