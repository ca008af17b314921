"""The loader's control plane against the world size: collective bytes, loader CPU, state and
buffers per rank and per step, at R = 2, 4, 8, 16 real gloo ranks, fitted and extrapolated.

    python benchmarks/scale.py                         # R = 2,4,8,16; ~30 s on 2 busy cores
    python benchmarks/scale.py --ranks 2,4 --steps 6   # quicker

Every rank is a process of its own (forked from a forkserver that imported torch once), in one
gloo job on 127.0.0.1, running the public `sl.Loader` over a cached corpus of 30 token-shard
sources (`corpus()`: 20k to 400k tokens each, 2 to 31 shards, median document 60 to 600
tokens, weights by size). The per-rank batch is the same at every R (M=2 rows of C=2048
tokens), so whatever grows with R is the control plane's. One epoch (epochs=1; the corpus
holds ~30 steps at R=16): with epochs=None, a rank dealt no shard of a source (sources with
fewer shards than ranks) spins through empty epochs on the event loop and the job hangs.

What is measured, per rank, over --steps steps after --warmup (deltas between two points,
divided by the steps the loader *planned* in between, since it plans ahead of the trainer):
  sent_bytes / recv_bytes    bytes of the loader's collectives per step, counted by wrapping
                             torch.distributed's all_gather, gather, broadcast, scatter and
                             all_to_all_single in the rank (the loader's gloo groups are the
                             only users). Logical point-to-point bytes, padding included: an
                             all_gather of n bytes sends n to each of R-1 ranks and receives n
                             from each; a gather sends n to the root, which receives n from
                             each other rank of the group (a node's, or the leaders', under two
                             levels); a broadcast or scatter sends n x (G-1) from its source
                             and n to every other rank of its group of G; an all_to_all counts
                             the parts to and from other ranks. (Gloo's algorithms forward
                             data, so wire bytes differ, not the growth.) Split: gather
                             (summaries: all_gather, or gather to rank 0), plan (the broadcast
                             plan, or each rank's scattered part), a2a (samples). The control
                             planes are run side by side (--paths).
  cpu_ms                     CPU per step by thread (`time.pthread_getcpuclockid`): the loader's
                             asyncio thread ("loop"), its collectives thread ("collectives": the
                             gloo calls), its transform threads; "process" is the whole rank,
                             the trainer's loop (which does nothing) included.
    loop split               plan: JobModel.assign (rank 0 only: the balancer), bookkeeping:
                             JobModel.begin + commit (the stepper's and the progress's: every
                             rank tracks every rank's ids), encode/decode: building and
                             encoding this rank's summary, decoding every rank's, encoding and
                             decoding the plan (or the replies); deliver: the delivery's
                             synchronous parts (SourceBuffer.take, packing the rows, counting
                             the step's figures: `Delivery._pack` / `_count`);
                             rest: the loop's other work (fetch callbacks, asyncio, awaiting
                             the exchange). Each timed with time.thread_time on the loop thread.
  plan_ms_median             stats()["plan_ms_median"] (rank 0: wall ms of Stepper.assign)
  state_bytes                len of the encoded state (`state_dict()["streamload"]`)
  fetchers, sources_read     fetchers this rank runs (one per source, whatever its share), and
                             the sources it actually opened a shard of
  buffer_bytes/_tokens       bytes (token arrays) and tokens held in its buffers at the end
Fits (least squares, over the measured R): y = a + b*R for bytes received and sent per rank
per step (mean over ranks), state bytes, loop CPU per step on rank 0 and the mean of the other
ranks, their encode/decode share; y = a + b*R + c*R^2 for rank 0's bytes sent (it broadcasts a
plan of every rank's candidates to R-1 ranks); extrapolated to R = 1,024 and 4,096 next to the
measured points. Buffer bytes are reported as measured (sized by the configuration).

Both control planes run in one invocation (--paths): "all_gather" (every rank all-gathers every
rank's summary and receives the whole plan, every rank tracks the whole job) and "gather"
(summaries to rank 0 only, which steps the job model alone and scatters each rank its own part
of the plan; `LoaderConfig.control_plane`), and "node_gather": gather with LOCAL_WORLD_SIZE=4,
so from R=8 on the summaries go through one leader per node of 4 ranks (two levels). Every rank
calls `state_dict()` at the same step (under gather the other ranks get it from rank 0:
`state_dict_ms` is the wall time the trainer waited). Prints a table on stderr, the
R=largest/R=smallest ratios of the targets, and the JSON last line on stdout.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))   # this checkout's streamload, for the forkserver's ranks too

CORPUS_VERSION = 1
SOURCES = 30
EXTRAPOLATE = (1024, 4096)
NODE_SIZE = 4   # --paths node_gather: ranks per node
M, C = 2, 2048


# --- corpus -------------------------------------------------------------------------------------

def corpus(workdir: Path) -> tuple[Path, list[tuple[str, float]]]:
    """30 token-shard sources, generated once under workdir (manifest.json written last);
    returns the root and (name, weight) per source."""
    root = workdir / f"scale-corpus-v{CORPUS_VERSION}"
    manifest = root / "manifest.json"
    if manifest.exists():
        return root, [tuple(x) for x in json.loads(manifest.read_text())["sources"]]
    from streamload.formats import write_token_shard
    rng = np.random.default_rng(0)
    sources = []
    for i in range(SOURCES):
        tokens = int(20_000 * 20 ** (i / (SOURCES - 1)))   # 20k .. 400k, geometric
        shards, median = 2 + i, 60 * 10 ** ((i * 7 % SOURCES) / (SOURCES - 1))   # 60 .. 600
        name = f"s{i:02d}"
        for k in range(shards):
            docs, left = [], tokens // shards
            while left > 0:
                n = int(min(left, max(8, rng.lognormal(np.log(median), 0.8))))
                docs.append(rng.integers(0, 50_000, n).astype(np.uint16))
                left -= n
            stem = root / name / f"part-{k:03d}"
            stem.parent.mkdir(parents=True, exist_ok=True)
            write_token_shard(stem, docs)
        sources.append((name, float(tokens)))
    manifest.write_text(json.dumps({"sources": sources}))
    return root, sources


# --- one rank -----------------------------------------------------------------------------------

class Counters:
    """Bytes of the collectives this rank takes part in, by kind."""
    def __init__(self):
        self.bytes = {f"{k}_{d}": 0 for k in ("gather", "plan", "a2a") for d in ("sent", "recv")}
        self.calls = 0

    def add(self, kind: str, sent: int, recv: int) -> None:
        self.bytes[f"{kind}_sent"] += sent
        self.bytes[f"{kind}_recv"] += recv
        self.calls += 1

    def snapshot(self) -> dict:
        return {**self.bytes, "calls": self.calls}


def instrument_collectives(counters: Counters, world: int) -> None:
    import torch.distributed as dist
    all_gather, broadcast, all_to_all_single = (dist.all_gather, dist.broadcast,
                                                dist.all_to_all_single)
    gather_to, scatter_from = dist.gather, dist.scatter

    def all_gather_(out, tensor, *a, **k):
        n = tensor.numel() * tensor.element_size()
        counters.add("gather", n * (world - 1), n * (world - 1))
        return all_gather(out, tensor, *a, **k)

    def size(k) -> int:   # the group's (a node's, the leaders': two levels)
        return dist.get_world_size(k.get("group")) if k.get("group") is not None else world

    def gather_(tensor, gather_list=None, *a, **k):   # control_plane="gather": to rank 0
        n = tensor.numel() * tensor.element_size()
        root = dist.get_rank(k.get("group")) == k.get("group_dst", 0)
        counters.add("gather", 0 if root else n, n * (size(k) - 1) if root else 0)
        return gather_to(tensor, gather_list, *a, **k)

    def bcast(tensor, *a, **k):
        n = tensor.numel() * tensor.element_size()
        mine = dist.get_rank(k.get("group")) == k.get("group_src", k.get("src", 0))
        counters.add("plan", n * (size(k) - 1) if mine else 0, 0 if mine else n)
        return broadcast(tensor, *a, **k)

    def scatter_(tensor, scatter_list=None, *a, **k):   # each rank's own plan
        n = tensor.numel() * tensor.element_size()
        root = dist.get_rank(k.get("group")) == k.get("group_src", 0)
        counters.add("plan", n * (size(k) - 1) if root else 0, 0 if root else n)
        return scatter_from(tensor, scatter_list, *a, **k)

    def a2a(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        size = input.element_size()
        me = dist.get_rank(k.get("group"))
        sent = sum(n for r, n in enumerate(input_split_sizes) if r != me) * size
        recv = sum(n for r, n in enumerate(output_split_sizes) if r != me) * size
        counters.add("a2a", sent, recv)
        return all_to_all_single(output, input, output_split_sizes, input_split_sizes, *a, **k)

    dist.all_gather, dist.broadcast, dist.all_to_all_single = all_gather_, bcast, a2a
    dist.gather, dist.scatter = gather_, scatter_


class LoopTimer:
    """time.thread_time spent in wrapped functions, by bucket (they run on the loop thread)."""
    def __init__(self):
        self.ms = {"plan": 0.0, "bookkeeping": 0.0, "encode_decode": 0.0, "deliver": 0.0}

    def wrap(self, bucket: str, fn):
        def timed(*a, **k):
            t = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.ms[bucket] += (time.thread_time() - t) * 1e3
        return timed


def instrument_loop(timer: LoopTimer, runtime) -> None:
    import streamload.runtime as rt
    for name in ("decode_summaries", "encode_plan", "decode_plan", "encode_local_plan",
                 "decode_local_plan"):
        setattr(rt, name, timer.wrap("encode_decode", getattr(rt, name)))
    rt.step_totals = timer.wrap("bookkeeping", rt.step_totals)
    # the synchronous parts of a delivery: taking from the buffers, packing rows, counting
    from streamload.delivery import Delivery
    from streamload.pipeline.buffer import SourceBuffer
    for cls, name in ((SourceBuffer, "take"), (Delivery, "_pack"), (Delivery, "_count")):
        setattr(cls, name, timer.wrap("deliver", getattr(cls, name)))
    # building this rank's summary: its windows, encoded (`Runtime._summary` is a coroutine
    # function: wrapping it would time only the coroutine's creation)
    rt.encode_summary = timer.wrap("encode_decode", rt.encode_summary)
    SourceBuffer.window = timer.wrap("encode_decode", SourceBuffer.window)
    job = runtime.job
    if hasattr(job, "assign"):   # the job model: rank 0 under gather (the others keep a share)
        job.assign = timer.wrap("plan", job.assign)
        job.begin = timer.wrap("bookkeeping", job.begin)
        job.commit = timer.wrap("bookkeeping", job.commit)   # the stepper's and the progress's


def thread_cpu_ms() -> dict:
    out = {"loop": 0.0, "collectives": 0.0, "transform": 0.0, "process": time.process_time() * 1e3}
    for t in threading.enumerate():
        kind = ("loop" if t.name == "streamload-loop" else
                "collectives" if t.name.startswith("streamload-collectives") else
                "transform" if t.name.startswith("streamload-transform") else None)
        if kind is None or t.ident is None:
            continue
        try:
            out[kind] += time.clock_gettime(time.pthread_getcpuclockid(t.ident)) * 1e3
        except (OSError, ProcessLookupError):   # the thread just ended
            pass
    return out


def run_rank(rank: int, world: int, port: int, root: str, sources: list, warmup: int,
             steps: int, results, path: str, readers: str, full_epoch: bool) -> None:
    try:
        results.put((rank, measure_rank(rank, world, port, root, sources, warmup, steps, path,
                                        readers, full_epoch)))
    except BaseException as exc:   # reported to the parent
        import traceback
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))


def measure_rank(rank, world, port, root, sources, warmup, steps, path, readers="auto",
                 full_epoch=False) -> dict:
    if os.environ.get("SCALE_DEBUG"):   # seconds: then dump every thread's stack and exit
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["SCALE_DEBUG"]), exit=True)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    control_plane = path
    if path == "node_gather":   # gather, nodes of NODE_SIZE ranks (as torchrun would say)
        control_plane = "gather"
        os.environ["LOCAL_WORLD_SIZE"] = str(NODE_SIZE)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    import streamload as sl
    counters, timer = Counters(), LoopTimer()
    instrument_collectives(counters, world)
    try:
        # readers="all": every rank reads every source (as before issue 22's item 4)
        count = world if readers == "all" else None
        with sl.Loader([sl.Source(f"{root}/{name}", weight=w, name=name, readers=count)
                        for name, w in sources],
                       micro_batch_tokens=C, micro_batches=M, seed=0, planner="balanced",
                       epochs=1, collective_timeout_s=600,
                       control_plane=control_plane) as loader:
            instrument_loop(timer, loader._runtime)
            it = iter(loader)
            ids, source_tokens = [], np.zeros(len(sources), np.int64)

            def take():
                batch = next(it)
                source_tokens[:] += np.asarray(batch.source_tokens, np.int64)
                ids.extend(i for mb in batch.micro_batches for i in mb.sample_ids)
            for _ in range(warmup):
                take()
            marks = []
            for point in range(2):
                if point:
                    for _ in range(steps):
                        take()
                planned = loader.stats()["steps_planned"]
                marks.append((planned, counters.snapshot(), thread_cpu_ms(), dict(timer.ms)))
            stats = loader.stats()
            # every rank's state_dict() at the same step (under gather: asked of rank 0, or
            # sent by rank 0 with its own); its wall ms is what the trainer waits
            t = time.perf_counter()
            state_bytes = len(loader.state_dict()["streamload"].encode())
            state_ms = (time.perf_counter() - t) * 1e3
            runtime = loader._runtime
            held = loader._on_loop(lambda: [
                (sum(e.tokens.nbytes for e in getattr(b, "_entries", ()) if hasattr(e, "tokens")),
                 b.tokens, b.capacity_tokens) for b in runtime.buffers])
            fetchers = sum(f is not None for f in runtime.fetchers)
            # open streams: shards this rank's fetchers have started and not finished
            streams = sum(s["shards_started"] - s["shards_read"]
                          for s in stats["sources"].values())
            if full_epoch:   # the rest of the epoch: exactly once, the mix (rank 0's tally)
                while True:
                    try:
                        take()
                    except StopIteration:
                        break
            mix = loader.stats()["mix_steps"]
            dist.barrier()   # every rank measured before any closes its loader
    finally:
        dist.destroy_process_group()
    (p0, c0, t0, l0), (p1, c1, t1, l1) = marks
    planned = max(p1 - p0, 1)
    per = {k: (c1[k] - c0[k]) / planned for k in c0}
    loop_ms = {k: (l1[k] - l0[k]) / planned for k in l0}
    cpu = {k: round((t1[k] - t0[k]) / planned, 3) for k in t0}
    loop_ms["rest"] = cpu["loop"] - sum(loop_ms.values())
    return {
        "path": path, "ranks": world, "rank": rank, "steps_planned": planned,
        "sent_bytes": round(sum(v for k, v in per.items() if k.endswith("_sent"))),
        "recv_bytes": round(sum(v for k, v in per.items() if k.endswith("_recv"))),
        "bytes": {k: round(v) for k, v in per.items()},
        "cpu_ms": cpu, "loop_ms": {k: round(v, 3) for k, v in loop_ms.items()},
        "plan_ms_median": stats["plan_ms_median"],
        "state_bytes": state_bytes, "state_dict_ms": round(state_ms, 2),
        "control": {k: stats["control_plane"].get(k) for k in ("path", "leader")},
        "fetchers": fetchers, "open_streams": streams,
        "readers": readers, "mix_deviation": mix["deviation"],
        "mix_steps_all_active": mix["steps_all_active"],
        **({"ids": ids, "source_tokens": source_tokens.tolist()} if full_epoch else {}),
        "sources_read": sum(1 for s in stats["sources"].values() if s["shards_started"] > 0),
        "buffer_bytes": sum(b for b, _, _ in held), "buffer_tokens": sum(t for _, t, _ in held),
        # what the buffers may hold (MemoryPlan: capacity x 4 bytes a token, at most)
        "buffer_capacity_bytes": 4 * sum(c for _, _, c in held),
    }


def run_world(world: int, root: Path, sources: list, warmup: int, steps: int,
              timeout: float, path: str, readers: str = "auto",
              full_epoch: bool = False) -> list[dict]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "streamload",
                                "streamload.loader"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, world, port, str(root), sources, warmup,
                                                steps, results, path, readers, full_epoch),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        deadline = time.monotonic() + timeout
        while len(out) < world:
            rank, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
            if "error" in value:
                raise RuntimeError(f"R={world} rank {rank}: {value['error']}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    rows = [out[r] for r in range(world)]
    if full_epoch:   # exactly once: no id twice, every source's every token (rank 0's tally)
        ids = [i for r in rows for i in r.pop("ids")]
        expected = [int(w) // (2 + i) * (2 + i) for i, (_, w) in enumerate(sources)]
        delivered = rows[0]["source_tokens"]
        for r in rows:
            r.pop("source_tokens")
        rows[0]["exactly_once"] = len(ids) == len(set(ids)) and delivered == expected
        if not rows[0]["exactly_once"]:
            bad = [i for i, (d, e) in enumerate(zip(delivered, expected)) if d != e]
            raise RuntimeError(f"R={world}: not exactly once: {len(ids) - len(set(ids))} ids "
                               f"twice; sources {bad} delivered {[delivered[i] for i in bad]} "
                               f"tokens of {[expected[i] for i in bad]}")
    return rows


# --- fits ---------------------------------------------------------------------------------------

def fit(ranks: list[int], values: list[float], degree: int = 1) -> dict:
    """Least squares y = a + b*R (+ c*R^2 with degree 2), and its values at EXTRAPOLATE."""
    coef = np.polyfit(np.asarray(ranks, float), np.asarray(values, float), degree)[::-1]
    at = lambda r: float(sum(c * r ** k for k, c in enumerate(coef)))   # noqa: E731
    worst = max(abs(at(r) - v) / max(abs(v), 1e-9) for r, v in zip(ranks, values))
    formula = " + ".join(f"{c:.4g}" + ("" if k == 0 else "*R" if k == 1 else f"*R^{k}")
                         for k, c in enumerate(coef))
    return {"formula": formula, **dict(zip("abc", map(float, coef))),
            "max_rel_residual": round(worst, 3),
            "measured": {str(r): round(float(v), 3) for r, v in zip(ranks, values)},
            "extrapolated": {str(r): round(at(r), 3) for r in EXTRAPOLATE}}


def summarize(results: list[dict]) -> dict:
    worlds = sorted({r["ranks"] for r in results})
    by = {w: [r for r in results if r["ranks"] == w] for w in worlds}
    mean = lambda rows, f: float(np.mean([f(r) for r in rows]))   # noqa: E731
    series = {
        "recv_bytes_per_rank_step": [mean(by[w], lambda r: r["recv_bytes"]) for w in worlds],
        "sent_bytes_per_rank_step": [mean(by[w], lambda r: r["sent_bytes"]) for w in worlds],
        "sent_bytes_rank0_step": [by[w][0]["sent_bytes"] for w in worlds],
        "state_bytes": [by[w][0]["state_bytes"] for w in worlds],
        "state_dict_ms_other_ranks": [mean(by[w][1:], lambda r: r["state_dict_ms"])
                                      for w in worlds],
        "loop_cpu_ms_rank0": [by[w][0]["cpu_ms"]["loop"] for w in worlds],
        "loop_cpu_ms_other_ranks": [mean(by[w][1:], lambda r: r["cpu_ms"]["loop"])
                                    for w in worlds],
        "encode_decode_ms_other_ranks": [mean(by[w][1:], lambda r: r["loop_ms"]["encode_decode"])
                                         for w in worlds],
        "deliver_ms_other_ranks": [mean(by[w][1:], lambda r: r["loop_ms"]["deliver"])
                                   for w in worlds],
        "recv_bytes_other_ranks_step": [mean(by[w][1:], lambda r: r["recv_bytes"])
                                        for w in worlds],
    }
    quadratic = {"sent_bytes_rank0_step"}   # the whole plan, sized by R, to R-1 ranks
    fits = {name: fit(worlds, values, 2 if name in quadratic and len(worlds) > 2 else 1)
            for name, values in series.items()} if len(worlds) > 1 else {}
    # Measured only: buffers are sized per rank by the configuration, not by R.
    fits["buffer_bytes_per_rank"] = {"measured": {
        str(w): round(mean(by[w], lambda r: r["buffer_bytes"])) for w in worlds}}
    fits["buffer_bytes_max_rank"] = {"measured": {
        str(w): max(r["buffer_bytes"] for r in by[w]) for w in worlds}}
    fits["buffer_capacity_bytes_per_rank"] = {"measured": {
        str(w): {"mean": round(mean(by[w], lambda r: r["buffer_capacity_bytes"])),
                 "max": max(r["buffer_capacity_bytes"] for r in by[w])} for w in worlds}}
    # Readers (plan/readers.py): fetchers and open shard streams per rank, the mix
    fits["fetchers_per_rank"] = {"measured": {
        str(w): {"mean": round(mean(by[w], lambda r: r["fetchers"]), 2),
                 "max": max(r["fetchers"] for r in by[w])} for w in worlds}}
    fits["open_streams_per_rank"] = {"measured": {
        str(w): {"mean": round(mean(by[w], lambda r: r["open_streams"]), 2),
                 "max": max(r["open_streams"] for r in by[w])} for w in worlds}}
    fits["mix_deviation"] = {"measured": {str(w): by[w][0]["mix_deviation"] for w in worlds}}
    if "exactly_once" in by[worlds[0]][0]:
        fits["exactly_once"] = {"measured": {str(w): by[w][0]["exactly_once"] for w in worlds}}
    return fits


def table(results: list[dict]) -> str:
    head = (f"{'path':>11} {'R':>3} {'rank':>4} {'recv B/step':>12} {'sent B/step':>12} "
            f"{'loop ms':>8} "
            f"{'plan':>6} {'bookk':>6} {'enc/dec':>7} {'rest':>6} {'coll ms':>7} "
            f"{'state B':>8} {'sd ms':>6} {'fetch':>5} {'read':>4} {'open':>4} {'buffer B':>9} "
            f"{'rd':>4}")
    lines = [head]
    for r in results:
        lm = r["loop_ms"]
        lines.append(f"{r['path']:>11} {r['ranks']:>3} {r['rank']:>4} {r['recv_bytes']:>12,} "
                     f"{r['sent_bytes']:>12,} {r['cpu_ms']['loop']:>8.2f} {lm['plan']:>6.2f} "
                     f"{lm['bookkeeping']:>6.2f} {lm['encode_decode']:>7.2f} {lm['rest']:>6.2f} "
                     f"{r['cpu_ms']['collectives']:>7.2f} {r['state_bytes'] or 0:>8,} "
                     f"{r['state_dict_ms']:>6.1f} "
                     f"{r['fetchers']:>5} {r['sources_read']:>4} {r['open_streams']:>4} "
                     f"{r['buffer_bytes']:>9,} {r['readers']:>4}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4,8,16", help="comma list of world sizes")
    ap.add_argument("--steps", type=int, default=20, help="measured steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--workdir", default="/tmp/streamload-bench")
    ap.add_argument("--timeout", type=float, default=240, help="per world size, seconds")
    ap.add_argument("--paths", default="all_gather,gather",
                    help="control planes to compare (LoaderConfig.control_plane); node_gather: "
                         "gather with LOCAL_WORLD_SIZE=4 (nodes of 4 ranks: two levels from R=8)")
    ap.add_argument("--readers", default="auto",
                    help="comma list: auto (plan/readers.py), all (every rank reads every "
                         "source, as before readers)")
    ap.add_argument("--full-epoch", action="store_true",
                    help="after measuring, run the epoch out: check exactly once (no id twice, "
                         "every token of every source) and report the mix deviation")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    root, sources = corpus(workdir)
    results, started = [], time.perf_counter()
    paths = args.paths.split(",")
    for readers in args.readers.split(","):
        for path in paths:
            for world in (int(w) for w in args.ranks.split(",")):
                t = time.perf_counter()
                rows = run_world(world, root, sources, args.warmup, args.steps, args.timeout,
                                 path, readers, args.full_epoch)
                results += rows
                print(f"{path} readers={readers} R={world}: {time.perf_counter() - t:.1f} s",
                      file=sys.stderr)
    print(table(results), file=sys.stderr)
    # one group per (control plane, readers): "gather", "gather readers=all", ...
    groups = {(p if rd == "auto" else f"{p} readers={rd}"): (p, rd)
              for rd in args.readers.split(",") for p in paths}
    fits = {key: summarize([r for r in results if (r["path"], r["readers"]) == group])
            for key, group in groups.items()}
    paths = list(groups)
    for path in paths:
        for name, f in fits[path].items():
            if "formula" not in f:
                print(f"{path} {name}: measured {f['measured']}", file=sys.stderr)
                continue
            print(f"{path} {name} = {f['formula']}  (max residual {f['max_rel_residual']:.0%}); "
                  f"measured {f['measured']}; extrapolated {f['extrapolated']}", file=sys.stderr)
    ratios = {}
    for path in paths:
        for name in ("recv_bytes_per_rank_step", "recv_bytes_other_ranks_step",
                     "loop_cpu_ms_other_ranks", "loop_cpu_ms_rank0"):
            measured = fits[path].get(name, {}).get("measured", {})
            if len(measured) > 1:
                keys = sorted(measured, key=int)
                ratios[f"{path} {name} R={keys[-1]}/R={keys[0]}"] = round(
                    measured[keys[-1]] / max(measured[keys[0]], 1e-9), 3)
    for k, v in ratios.items():
        print(f"{k}: {v}", file=sys.stderr)
    print(json.dumps({"config": {"sources": SOURCES, "micro_batches": M, "micro_batch_tokens": C,
                                 "warmup": args.warmup, "steps": args.steps, "paths": paths,
                                 "wall_s": round(time.perf_counter() - started, 1)},
                      "results": results, "fits": fits, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
