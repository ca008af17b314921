"""The loader's own CPU cost, without a storage server: streamload over local files.

    python benchmarks/loader_cpu.py                 # 1 and 2 gloo ranks, 400 steps each
    python benchmarks/loader_cpu.py --ranks 2 --steps 200
    python benchmarks/loader_cpu.py --profile 25 --steps 300   # the loop thread, per function
    python benchmarks/loader_cpu.py --next                     # next() with the queue full

`benchmarks/throughput.py` shares two cores with the moto server; this reads the same cached
corpus (`benchmarks/_corpus.py`, generated on first use) from local files, so what it measures
is the loader: per rank, text MB/s, samples/s, and process CPU per step (everything: the
step loop, decoding and tokenizing, the collectives, the consumer), and the same per thread:
the loop thread (`streamload-loop`: the step loop and the fetchers' asyncio side), the
transform threads (decoding, tokenizing) and the trainer's thread (`next()` and this script's
consumer). The clock and the CPU counters start after `streamload.loader` (torch with it) is
imported: since `import streamload` stopped importing torch (08bd0f8), `sl.Loader` imports it on
first use, which added about 1 s of CPU, 2.5 ms per step over 400 steps, to the figures of
earlier runs that imported only `streamload`. cpu_ms_per_step counts everything from the
Loader's construction (its start-up too); steady_cpu_ms_per_step only what follows the first
batch. Same geometry as the throughput benchmark (4 rows of 65,536 tokens, planner "naive",
byte tokens). Prints a JSON last line: {"results": [{"ranks", "rank", "steps", "mb_per_s",
"samples_per_s", "cpu_ms_per_step", "steady_cpu_ms_per_step", "loop_ms_per_step",
"transform_ms_per_step", "trainer_ms_per_step", "first_batch_s", "stall_s"}]}; samples count
the pieces of split documents.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _corpus  # noqa: E402


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's live threads, summed by Python thread name (numbered
    workers, `name-0`, `name-1`, together)."""
    names = {t.native_id: t.name.rstrip("0123456789").rstrip("-_") for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:   # the thread ended meanwhile
            continue
        name = names.get(int(tid), "other")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def run_rank(rank: int, world: int, port: int, root: str, weights: dict, steps: int, queue) -> None:
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
    import streamload as sl
    import streamload.loader  # noqa: F401  (the Loader's module and torch: not measured)
    sources = [sl.Source(f"{root}/{name}/", weight=w, name=name) for name, w in weights.items()]
    tokens = samples = done = 0
    first = None
    started, cpu0, trainer0 = time.perf_counter(), time.process_time(), time.thread_time()
    with sl.Loader(sources, micro_batch_tokens=65536, micro_batches=4, epochs=1, seed=0,
                   planner="naive") as loader:
        for done, batch in enumerate(loader, 1):
            if first is None:   # steady state: from the first batch on
                first, cpu1 = time.perf_counter() - started, time.process_time()
            for mb in batch.micro_batches:
                tokens += mb.num_tokens
                samples += len(mb.sample_ids)
            if done >= steps:
                break
        elapsed = time.perf_counter() - started
        cpu, trainer, threads = time.process_time() - cpu0, time.thread_time() - trainer0, \
            thread_cpu_s()
        stall = loader.stats()["stall_s"]
    per_step = 1e3 / max(done, 1)
    queue.put({"ranks": world, "rank": rank, "steps": done,
               "mb_per_s": round(tokens / elapsed / 1e6, 2),
               "samples_per_s": round(samples / elapsed),
               "cpu_ms_per_step": round(cpu * per_step, 2),
               "steady_cpu_ms_per_step": round((cpu0 + cpu - cpu1) / max(done - 1, 1) * 1e3, 2),
               "loop_ms_per_step": round(threads.get("streamload-loop", 0.0) * per_step, 2),
               "transform_ms_per_step": round(threads.get("streamload-transform", 0.0)
                                              * per_step, 2),
               "trainer_ms_per_step": round(trainer * per_step, 2),
               "first_batch_s": round(first or 0.0, 3), "stall_s": round(stall, 3)})
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


# The step's geometry (--micro-batch-tokens, --micro-batches): 4 rows of 65,536 tokens, as
# throughput.py's, unless set (a per-step fixed cost shows as the difference between sizes).
GEOMETRY = {"micro_batch_tokens": 65536, "micro_batches": 4}


def loader(root: str, weights: dict, **options):
    import streamload as sl
    import streamload.loader  # noqa: F401
    return sl.Loader([sl.Source(f"{root}/{name}/", weight=w, name=name)
                      for name, w in weights.items()],
                     epochs=1, seed=0, planner="naive", **GEOMETRY, **options)


def profile_loop(root: str, weights: dict, steps: int, top: int) -> None:
    """One rank: the loop thread under cProfile with a per-thread CPU clock (which inflates
    every figure by about 1.5x: compare trees, not absolutes); the `top` functions by
    cumulative CPU, in ms per step, to stderr."""
    import cProfile
    import pstats
    prof = cProfile.Profile(time.thread_time)

    def start(frame, event, arg):   # runs first in every new thread: profile the loop's
        sys.setprofile(None)
        if threading.current_thread().name == "streamload-loop":
            prof.enable()
    threading.setprofile(start)
    with loader(root, weights) as it:
        for done, _ in enumerate(it, 1):
            if done >= steps:
                break
    threading.setprofile(None)
    if os.environ.get("LOADER_CPU_PROFILE_DUMP"):   # the raw profile, for pstats
        prof.dump_stats(os.environ["LOADER_CPU_PROFILE_DUMP"])
    stats = pstats.Stats(prof).stats
    rows = sorted(((ct, f"{fn.rsplit('/', 2)[-2]}/{fn.rsplit('/', 1)[-1]}:{line}({name})")
                   for (fn, line, name), (_, _, _, ct, _) in stats.items()
                   if "streamload" in fn), reverse=True)
    for ct, where in rows[:top]:
        print(f"{ct / steps * 1e3:8.3f} ms/step  {where}", file=sys.stderr)


# The loop's synchronous phases `--phases` times: (module, owner, attribute, label). Nested ones
# count in both (pack_rows inside _pack, window inside the summary's encoding).
PHASES = [("streamload.pipeline.buffer", "SourceBuffer", "window", "buffer.window"),
          ("streamload.pipeline.buffer", "SourceBuffer", "take", "buffer.take"),
          ("streamload.runtime", None, "encode_summary", "encode_summary"),
          ("streamload.runtime", None, "decode_summaries", "decode_summaries"),
          ("streamload.runtime", None, "encode_local_plan", "encode_local_plan"),
          ("streamload.runtime", None, "decode_local_plan", "decode_local_plan"),
          ("streamload.job", "JobModel", "begin", "job.begin"),
          ("streamload.job", "JobModel", "assign", "job.assign (planner)"),
          ("streamload.job", "JobModel", "commit", "job.commit"),
          ("streamload.job", "JobModel", "snapshot", "job.snapshot"),
          ("streamload.runtime", None, "step_totals", "step_totals"),
          ("streamload.delivery", None, "step_totals", "step_totals"),
          ("streamload.delivery", None, "exchange_tokens", "exchange_tokens"),
          ("streamload.delivery", "Delivery", "_pack", "delivery._pack"),
          ("streamload.delivery", None, "pack_rows", "pack_rows"),
          ("streamload.delivery", "Delivery", "_count", "delivery._count"),
          # The same work in an older tree (A/B runs against c0c42ce): the mixer's calls that
          # JobModel.begin / commit now make, _track (now JobModel._observe), packing in the
          # Runtime. take was async there (it awaits nothing: timed exactly).
          ("streamload.plan.mixing", "QuotaMixer", "plan", "job.begin"),
          ("streamload.plan.mixing", "QuotaMixer", "outcome", "job.begin"),
          ("streamload.plan.mixing", "QuotaMixer", "update", "job.commit"),
          ("streamload.runtime", "Runtime", "_track", "job.commit"),
          ("streamload.runtime", None, "pack_rows", "pack_rows")]


def measure_phases(root: str, weights: dict, steps: int) -> dict:
    """The loop thread's CPU in each of its synchronous phases (`PHASES`), in ms per step:
    each function wrapped in a thread-CPU clock, no profiler (cProfile's per-call cost
    inflates code made of many small NumPy calls, such as the buffer's and the job model's)."""
    import functools
    import importlib
    import inspect
    spent: dict[str, float] = {}
    walls: dict[str, float] = {}   # the same phases' wall time: CPU, waits for the GIL, the OS

    def timed(fn, label):
        if inspect.iscoroutinefunction(fn):   # one that awaits nothing, such as an old take
            @functools.wraps(fn)
            async def waited(*args, **kwargs):
                started, wall = time.thread_time(), time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    spent[label] = spent.get(label, 0.0) + time.thread_time() - started
                    walls[label] = walls.get(label, 0.0) + time.perf_counter() - wall
            return waited

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            started, wall = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.thread_time() - started
                walls[label] = walls.get(label, 0.0) + time.perf_counter() - wall
        return wrapper

    import streamload.loader  # noqa: F401  (every module below is loaded)
    for module, owner, name, label in PHASES:
        try:   # an older tree (an A/B run) may lack a phase: it is left out of the figures
            target = importlib.import_module(module)
            target = getattr(target, owner) if owner else target
            setattr(target, name, timed(getattr(target, name), label))
        except (ImportError, AttributeError):
            print(f"(no {module}.{owner + '.' if owner else ''}{name} here)", file=sys.stderr)
    loop0 = None
    with loader(root, weights) as it:
        for done, _ in enumerate(it, 1):
            if loop0 is None:
                loop0 = thread_cpu_s().get("streamload-loop", 0.0)
                spent.clear()   # steady state: from the first batch on
                walls.clear()
            if done >= steps:
                break
        loop = thread_cpu_s().get("streamload-loop", 0.0) - loop0
    per_step = 1e3 / max(done - 1, 1)
    out = {label: round(t * per_step, 3) for label, t in spent.items()}
    out["loop thread, all"] = round(loop * per_step, 3)
    # wall time per step in each phase: above its CPU where the loop thread waited (for the
    # GIL, which a NumPy copy lets go of and a transform thread then holds; or for a core)
    out["wall"] = {label: round(t * per_step, 3) for label, t in walls.items()}
    return out


def measure_next(root: str, weights: dict, rounds: int = 25) -> dict:
    """next() with the hand-off queue full, as throughput.py times it over S3: prefetch 8,
    rounds of a 0.3 s pause then 8 calls; the call and the drop of the batch it returned
    (a trainer drops each batch once done with it) timed apart."""
    import statistics
    calls, drops = [], []
    with loader(root, weights, prefetch_steps=8) as it:
        it = iter(it)
        next(it)
        time.sleep(1.0)
        for _ in range(rounds):
            time.sleep(0.3)
            for _ in range(8):
                started = time.perf_counter_ns()
                batch = next(it)
                between = time.perf_counter_ns()
                del batch
                calls.append(between - started)
                drops.append(time.perf_counter_ns() - between)
    both = [a + b for a, b in zip(calls, drops)]
    return {"calls": len(calls), "next_us_median": statistics.median(calls) / 1e3,
            "drop_us_median": statistics.median(drops) / 1e3,
            "next_and_drop_us_median": statistics.median(both) / 1e3,
            "next_and_drop_us_p90": sorted(both)[int(0.9 * len(both))] / 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2", help="comma list of world sizes")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--workdir", default="/tmp/streamload-bench")
    ap.add_argument("--profile", type=int, metavar="TOP", default=0,
                    help="instead: profile one rank's loop thread, print the TOP functions")
    ap.add_argument("--phases", action="store_true",
                    help="the loop thread's CPU per phase (steady state), ms per step")
    ap.add_argument("--next", action="store_true",
                    help="instead: time next() and the drop of its batch, queue full")
    ap.add_argument("--micro-batch-tokens", type=int, default=65536,
                    help="C (--phases, --profile, --next): a step's size changes its per-token "
                         "share of the loop's fixed per-step costs")
    ap.add_argument("--micro-batches", type=int, default=4, help="M (as --micro-batch-tokens)")
    args = ap.parse_args(argv)
    GEOMETRY.update(micro_batch_tokens=args.micro_batch_tokens, micro_batches=args.micro_batches)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    info = _corpus.main_corpus(workdir, 300, 8)
    root = str(Path(info.root) / "jsonl")
    weights = {s.name: s.weight for s in info.sources}
    if args.profile:
        profile_loop(root, weights, args.steps, args.profile)
        return 0
    if args.phases:
        result = measure_phases(root, weights, args.steps)
        for label, ms in result.items():
            if label != "wall":
                wall = result["wall"].get(label)
                print(f"{ms:8.3f} ms/step  {label}"
                      + (f"  (wall {wall:.3f})" if wall is not None else ""), file=sys.stderr)
        print(json.dumps(result))
        return 0
    if args.next:
        result = measure_next(root, weights)
        print(f"next(): median {result['next_us_median']:.1f} µs, dropping its batch "
              f"{result['drop_us_median']:.1f} µs, both {result['next_and_drop_us_median']:.1f} "
              f"µs (p90 {result['next_and_drop_us_p90']:.1f})", file=sys.stderr)
        print(json.dumps(result))
        return 0
    results = []
    for world in (int(w) for w in args.ranks.split(",")):
        for r in measure(world, root, weights, args.steps):
            print(f"{world} rank(s), rank {r['rank']}: {r['mb_per_s']} MB/s, "
                  f"{r['samples_per_s']:,} samples/s, {r['cpu_ms_per_step']} ms CPU per step "
                  f"({r['steady_cpu_ms_per_step']} after the first; loop thread "
                  f"{r['loop_ms_per_step']}, transforms {r['transform_ms_per_step']}, trainer "
                  f"{r['trainer_ms_per_step']}), first batch {r['first_batch_s']} s",
                  file=sys.stderr)
            results.append(r)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
