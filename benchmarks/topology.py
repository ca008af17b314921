"""Broadcast against replicate delivery, at world 8 on gloo: bytes and time per step.

    python benchmarks/topology.py                      # DP2 x TP2 x PP2 and DP2 x CP2 x TP2
    python benchmarks/topology.py --steps 60 --layouts tp2pp2

In a job with TP/CP/PP, only the DP ranks get distinct data. "broadcast": one rank per DP rank
runs the loader and broadcasts each step to the 3 other ranks of its DP rank; "replicate": all
8 ranks run the loader on their own coordinate's DP group and build the same step. Per layout
and delivery, over --steps steps of M=2 rows of C=2048 tokens (CP: rows of cp x C), local JSONL
files (byte tokens):
  step_ms        wall time per step as the trainer sees it (mean over ranks; the loop runs ahead,
                 so this is the loader's cost per step when the trainer takes no time)
  cpu_ms         process CPU per step (mean over ranks): every thread, the collectives included
  read_bytes     bytes read from storage per step, summed over the 8 ranks
  peer_bytes     bytes broadcast to the followers per step, summed over them (0 for replicate)
JSON last line: {"results": [{"layout", "delivery", "steps", "step_ms", "cpu_ms", "read_bytes",
"peer_bytes"}]}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from corpus import write_jsonl_source  # noqa: E402

LAYOUTS = {"tp2pp2": {"tp": 2, "pp": 2}, "cp2tp2": {"tp": 2, "cp": 2}}
WORLD = 8


def rank_main(rank, port, root, layout, delivery, steps, queue):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=300))
    import streamload as sl
    sources = [sl.Source(f"{root}/web", weight=0.6), sl.Source(f"{root}/books", weight=0.4)]
    parallel = sl.Parallel(**LAYOUTS[layout], delivery=delivery)
    with sl.Loader(sources, micro_batch_tokens=2048, micro_batches=2, seed=0,
                   parallel=parallel) as loader:
        iterator = iter(loader)
        next(iterator)   # warm-up: listing, first fetches
        started, cpu0, done = time.perf_counter(), time.process_time(), 0
        for done, _ in enumerate(iterator, 1):
            if done >= steps:
                break
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
        stats = loader.stats()
    queue.put({"rank": rank, "steps": done, "step_ms": elapsed / max(done, 1) * 1e3,
               "cpu_ms": cpu / max(done, 1) * 1e3,
               "read_bytes_total": stats.get("bytes_read", 0),   # 0 on a follower
               "steps_total": stats["steps"],
               "peer_bytes_total": stats.get("bytes_received", 0)})
    dist.barrier()
    dist.destroy_process_group()


def measure(root: str, layout: str, delivery: str, steps: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, root, layout, delivery, steps, queue))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    ranks = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    total_steps = max(r["steps_total"] for r in ranks)
    return {"layout": layout, "delivery": delivery, "steps": min(r["steps"] for r in ranks),
            "step_ms": round(sum(r["step_ms"] for r in ranks) / WORLD, 2),
            "cpu_ms": round(sum(r["cpu_ms"] for r in ranks) / WORLD, 2),
            "read_bytes": int(sum(r["read_bytes_total"] for r in ranks) / total_steps),
            "peer_bytes": int(sum(r["peer_bytes_total"] for r in ranks) / total_steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="streamload-topology-"))
    write_jsonl_source(root, "web", shards=8, per_shard=400, median=600, seed=1)
    write_jsonl_source(root, "books", shards=4, per_shard=60, median=6000, seed=2)
    results = []
    for layout in args.layouts.split(","):
        for delivery in ("broadcast", "replicate"):
            r = measure(str(root), layout, delivery, args.steps)
            print(f"{layout} {delivery}: {r['step_ms']} ms/step, {r['cpu_ms']} ms CPU/step, "
                  f"{r['read_bytes']:,} B read/step, {r['peer_bytes']:,} B to peers/step",
                  file=sys.stderr)
            results.append(r)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
