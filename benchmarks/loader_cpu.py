"""The loader's own CPU cost, without a storage server: streamload over local files.

    python benchmarks/loader_cpu.py                 # 1 and 2 gloo ranks, 400 steps each
    python benchmarks/loader_cpu.py --ranks 2 --steps 200

`benchmarks/throughput.py` shares two cores with the moto server; this reads the same cached
corpus (`benchmarks/_corpus.py`, generated on first use) from local files, so what it measures
is the loader: per rank, text MB/s, samples/s, and process CPU per step (everything: the
step loop, decoding and tokenizing, the collectives, the consumer). Same geometry as the
throughput benchmark (4 rows of 65,536 tokens, planner "naive", byte tokens). Prints a JSON
last line: {"results": [{"ranks", "rank", "steps", "mb_per_s", "samples_per_s",
"cpu_ms_per_step", "steady_cpu_ms_per_step", "stall_s"}]}; samples count the pieces of split
documents. cpu_ms_per_step counts everything from the Loader's construction (its imports, torch
among them, and start-up); steady_cpu_ms_per_step only what follows the first batch.
"""
from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _corpus  # noqa: E402


def run_rank(rank: int, world: int, port: int, root: str, weights: dict, steps: int, queue) -> None:
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
    import streamload as sl
    sources = [sl.Source(f"{root}/{name}/", weight=w, name=name) for name, w in weights.items()]
    tokens = samples = done = 0
    started, cpu0 = time.perf_counter(), time.process_time()
    with sl.Loader(sources, micro_batch_tokens=65536, micro_batches=4, epochs=1, seed=0,
                   planner="naive") as loader:
        for done, batch in enumerate(loader, 1):
            if done == 1:   # steady state: from the first batch on (imports, start-up left out)
                cpu1 = time.process_time()
            for mb in batch.micro_batches:
                tokens += mb.num_tokens
                samples += len(mb.sample_ids)
            if done >= steps:
                break
        elapsed = time.perf_counter() - started
        stall = loader.stats()["stall_s"]
    queue.put({"ranks": world, "rank": rank, "steps": done,
               "mb_per_s": round(tokens / elapsed / 1e6, 2),
               "samples_per_s": round(samples / elapsed),
               "cpu_ms_per_step": round((time.process_time() - cpu0) / max(done, 1) * 1e3, 2),
               "steady_cpu_ms_per_step": round((time.process_time() - cpu1) / max(done - 1, 1)
                                               * 1e3, 2),
               "stall_s": round(stall, 3)})
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()


def measure(world: int, root: str, weights: dict, steps: int) -> list[dict]:
    import multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, world, port, root, weights, steps, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return sorted(results, key=lambda r: r["rank"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2", help="comma list of world sizes")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--workdir", default="/tmp/streamload-bench")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    info = _corpus.main_corpus(workdir, 300, 8)
    root = str(Path(info.root) / "jsonl")
    weights = {s.name: s.weight for s in info.sources}
    results = []
    for world in (int(w) for w in args.ranks.split(",")):
        for r in measure(world, root, weights, args.steps):
            print(f"{world} rank(s), rank {r['rank']}: {r['mb_per_s']} MB/s, "
                  f"{r['samples_per_s']:,} samples/s, {r['cpu_ms_per_step']} ms CPU per step "
                  f"({r['steady_cpu_ms_per_step']} after the first)",
                  file=sys.stderr)
            results.append(r)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
