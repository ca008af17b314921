"""Where a rank's memory goes: the RSS floor under the loader, and what the loader adds.

    python benchmarks/memory.py            # the throughput benchmark's corpus, ~1.5 min
    python benchmarks/memory.py --small

Reads the 5-source JSONL corpus of `benchmarks/throughput.py` from a moto S3 server (its own
process, 127.0.0.1), with the same geometry (4 rows of 65,536 tokens, planner "naive", byte
tokens) and the same number of steps. Every measurement runs in a fresh process:

  floor     RSS after each import (numpy, torch, streamload, streamload's S3 module), after an
            S3 client made and one 1 MiB ranged GET done, and at the loader's first batch.
  default   the default settings: peak RSS (sampled every 10 ms), and at step 400 where the
            anonymous memory sits (/proc/self/smaps: the main heap, and the other anonymous
            mappings, mostly the malloc arenas of the loader's threads).
  traced    the same run under tracemalloc: the bytes Python objects and NumPy arrays hold
            at their peak, the loader's live data; RSS minus that is allocator overhead.
  lean      the leanest settings that still run this corpus (memory_budget 14 MB, 512 KiB
            ranges, window_factor 1, 1 prefetched step, 1 transform thread): peak RSS, MB/s.

Prints a JSON last line: {"floor": {...}, "runs": [{"mode", "peak_rss_mb", "mb_per_s", ...}]}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BUCKET = "bench"
C, M = 65536, 4
LEAN = {"memory_budget": 14_000_000, "chunk_bytes": 1 << 19, "window_factor": 1.0,
        "prefetch_steps": 1, "transform_workers": 1}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def anonymous_mb() -> dict:
    """RSS of the main heap and of all other anonymous mappings, from /proc/self/smaps."""
    heap = other = 0
    name = None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                name = parts[5] if len(parts) > 5 else "[anon]"
            elif parts and parts[0] == "Rss:":
                if name == "[heap]":
                    heap += int(parts[1])
                elif name == "[anon]":
                    other += int(parts[1])
    return {"heap_mb": round(heap / 1024, 1), "other_anonymous_mb": round(other / 1024, 1)}


# ==== child side ====================================================================================

def child_floor(spec: dict) -> dict:
    out = {"interpreter": rss_mb()}
    import numpy  # noqa: F401
    out["numpy"] = rss_mb()
    import torch  # noqa: F401
    out["torch"] = rss_mb()
    import streamload as sl
    out["streamload"] = rss_mb()
    import asyncio

    import streamload.storage.s3
    from streamload.storage import open_store
    out["streamload.storage.s3"] = rss_mb()

    async def one_get():
        store = open_store("s3://", spec["storage_options"])
        uri = f"s3://{BUCKET}/jsonl/web/"
        objects = await store.list(uri)
        await store.read_range(objects[0].uri, 0, min(1 << 20, objects[0].size))
        await store.aclose()
    asyncio.run(one_get())
    out["s3_client_and_one_1mib_get"] = rss_mb()
    sources = [sl.Source(f"s3://{BUCKET}/jsonl/{name}/", weight=w, name=name)
               for name, w in spec["sources"]]
    with sl.Loader(sources, micro_batch_tokens=C, micro_batches=M, epochs=1, seed=0,
                   planner="naive", storage_options=spec["storage_options"]) as loader:
        next(iter(loader))
        out["first_batch"] = rss_mb()
    return {k: round(v, 1) for k, v in out.items()}


def child_run(spec: dict) -> dict:
    import torch  # noqa: F401  (a trainer has it; so do the peers)

    import streamload as sl
    import streamload.storage.s3
    traced = spec["mode"] == "traced"
    peak, stop = [0.0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.01)
    base, base_anonymous = rss_mb(), anonymous_mb()
    threading.Thread(target=sample, daemon=True).start()
    if traced:
        import tracemalloc
        tracemalloc.start()
    sources = [sl.Source(f"s3://{BUCKET}/jsonl/{name}/", weight=w, name=name)
               for name, w in spec["sources"]]
    row = {"mode": spec["mode"], "options": spec["options"]}
    tokens = 0
    t0 = time.perf_counter()
    with sl.Loader(sources, micro_batch_tokens=C, micro_batches=M, epochs=1, seed=0,
                   planner="naive", storage_options=spec["storage_options"],
                   **spec["options"]) as loader:
        for step, batch in enumerate(loader):
            tokens += sum(mb.num_tokens for mb in batch.micro_batches)
            if step == 400 and not traced:
                row["before_loader"] = base_anonymous
                row["at_step_400"] = anonymous_mb()
            if step + 1 >= spec["steps"]:
                break
        elapsed = time.perf_counter() - t0
    stop.set()
    row.update(rss_before_loader_mb=round(base, 1), peak_rss_mb=round(max(peak[0], rss_mb()), 1),
               mb_per_s=round(tokens / elapsed / 1e6, 1))
    if traced:
        row["traced_peak_mb"] = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
        row.pop("mb_per_s")       # tracemalloc slows every allocation: not a speed
    return row


# ==== parent side ===================================================================================

def run_child(spec: dict, env: dict, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, check=False,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{spec['mode']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="~20 MB corpus: a quick smoke run")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "streamload-bench"))
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        result = child_floor(spec) if spec["mode"] == "floor" else child_run(spec)
        print(json.dumps(result))
        return 0

    import _corpus  # imports NumPy: only here, so the floor's children start bare
    from _corpus import log
    from _moto import MotoServer, merged_env
    total_mb, shard_mb = (20, 1) if args.small else (300, 8)
    info = _corpus.main_corpus(Path(args.workdir), total_mb, shard_mb)
    weights = [(s.name, s.weight) for s in info.sources]
    steps = math.ceil(info.text_bytes * 0.5 / (M * C))   # throughput.py's read: half the corpus
    with MotoServer() as s3:
        for s in info.sources:
            s3.upload_dir(Path(info.root) / "jsonl" / s.name, BUCKET, f"jsonl/{s.name}/")
        env = merged_env(s3.env)
        base = {"sources": weights, "storage_options": s3.storage_options, "steps": steps}
        floor = run_child({**base, "mode": "floor"}, env, args.timeout)
        log(f"floor: {floor}")
        runs = []
        for mode, options in (("default", {}), ("traced", {}), ("lean", LEAN)):
            row = run_child({**base, "mode": mode, "options": options}, env, args.timeout)
            log(f"{mode}: {row}")
            runs.append(row)
    print(json.dumps({"floor": floor, "runs": runs, "steps": steps,
                      "micro_batch_tokens": C, "micro_batches": M}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
