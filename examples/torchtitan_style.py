"""A torchtitan-style job: a DeviceMesh ("dp", "tp"), the loader built on it, a tiny model.

    python examples/torchtitan_style.py DIR [DIR ...]          # spawns 4 gloo ranks (dp 2 x tp 2)
    torchrun --nproc-per-node 4 examples/torchtitan_style.py DIR [DIR ...]

Only the DP ranks get distinct data: both TP peers of a DP rank receive the identical batch
(as `get_batch_on_this_tp_rank` expects), and the loader balances the compute cost of every step
over the DP ranks. Each micro-batch comes as torchtitan's `({"input": ..., "positions": ...},
labels)` through `batch.to_torchtitan()`. Without DIRs, a small corpus is generated.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist

import streamload as sl


def train(uris: list[str], steps: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sources = [sl.Source(uri) for uri in uris]
    with sl.Loader(sources, micro_batch_tokens=1024, micro_batches=2, mesh=mesh) as loader:
        for batch in loader:
            for inputs, labels in batch.to_torchtitan():
                logits = model(inputs["input"].clamp(max=255))
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                         ignore_index=-100)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if batch.step + 1 >= steps:
                break
        # One write of the whole line (atomic on a pipe), so the ranks' lines never interleave.
        sys.stdout.write(f"rank {dist.get_rank()} (dp {loader.rank} of {loader.world_size}, tp "
                         f"{loader.topology.tp_rank}): {batch.step + 1} steps, loss "
                         f"{loss.item():.3f}, first ids {batch.micro_batches[0].sample_ids[:2]}\n")
        sys.stdout.flush()


def rank_main(rank: int, world: int, port: int, uris: list[str], steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        train(uris, steps)
    finally:
        dist.destroy_process_group()


def small_corpus() -> list[str]:
    import json
    root = tempfile.mkdtemp(prefix="streamload-titan-")
    for name, words in (("web", 60), ("code", 200)):
        os.makedirs(os.path.join(root, name))
        for shard in range(2):
            with open(os.path.join(root, name, f"part-{shard}.jsonl"), "w") as f:
                for i in range(80):
                    f.write(json.dumps({"text": f"{name} {shard} {i} " + "lorem ipsum " * words}) + "\n")
    return [os.path.join(root, "web"), os.path.join(root, "code")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("uris", nargs="*")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=4, help="spawned ranks without torchrun (even)")
    args = ap.parse_args()
    uris = args.uris or small_corpus()
    if "WORLD_SIZE" in os.environ:   # under torchrun
        dist.init_process_group("gloo")
        try:
            train(uris, args.steps)
        finally:
            dist.destroy_process_group()
        return
    import multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, uris, args.steps))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(abs(p.exitcode or 0) for p in procs))


if __name__ == "__main__":
    main()
