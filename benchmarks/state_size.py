"""The resumable state's size against the world size and the number of sources, on the job
model alone (`streamload.job.JobModel`, the object every rank of the loader and the dry run
drive; no processes, no data: lengths only).

    python benchmarks/state_size.py          # S = 30 at R = 2, 4, 8, 16; S = 300 at R = 2, 16
    python benchmarks/state_size.py --steps 10 --ranks 2,16

The corpus is benchmarks/scale.py's as lengths: S token sources, 20k to 400k tokens each
(geometric), 2 to 31 shards, lognormal documents (median 60 to 600 tokens), weights by size;
M = 2 rows of C = 2048 tokens per rank, planner balanced (scale.py's loader options). After
--steps steps the state is saved twice: in this tree's format (`encode_state`, version 6) and
as the version-4 format wrote the same state (every rank's position and units per source, the
pending items as (source, shard, record, chunk, age) tuples: `msgspec.json.encode` of the
in-memory `LoaderState`). The round trip's CPU ms: the state from the model (`state ms`),
encoded (`save`), decoded (`load`), and loaded and started by a fresh model with no process
group at R (`start`) and at R/2 and R+1 (`elastic`, the slower). `--round-trip 1,8,64,512`
adds rows after 4 steps at those R. Prints a table on stderr, JSON last line on stdout.

`--rank-share 512,4096` measures instead what a rank other than 0 keeps under
control_plane="gather" at S = --many-sources and those R, from its build to its start-up
buffers and its fetchers' layouts: the whole job model unstepped (`JobModel`, as before) against
its own share (`RankShare`), for the last rank. CPU ms (without tracemalloc), then the bytes it
holds afterwards and the peak on the way (tracemalloc). `--share-resumed-from 512`: also
loaded from a state saved at that R after 4 steps (planner naive), at each of those R.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import msgspec
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from streamload import pieces  # noqa: E402
from streamload.config import LoaderConfig, Source  # noqa: E402
from streamload.job import JobModel, RankShare, data_options, layout_feed, step_windows  # noqa: E402
from streamload.plan.windows import Block, ItemQueue, Windows  # noqa: E402
from streamload.state import decode_state, encode_state, shard_permutation  # noqa: E402
import tracemalloc  # noqa: E402

C, M = 2048, 2


def lengths_corpus(num_sources: int, seed: int = 0) -> list[tuple[str, float, list]]:
    """(name, weight, per shard document lengths), scale.py's recipe (shards 2 + i mod 30)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_sources):
        tokens = int(20_000 * 20 ** ((i % 30) / 29))
        shards, median = 2 + i % 30, 60 * 10 ** ((i * 7 % 30) / 29)
        per_shard = []
        for _ in range(shards):
            docs = np.maximum(rng.lognormal(np.log(median), 0.8,
                                            int(2 * tokens / shards / median) + 8), 8)
            docs = docs.astype(np.int64)
            per_shard.append(docs[np.cumsum(docs) <= tokens // shards] if docs.sum() else docs)
        out.append((f"s{i:03d}", float(tokens), per_shard))
    return out


def blocks_of(per_shard: list):
    cuts = [pieces.cut_documents(d, C, "split") for d in per_shard]

    def block(shard: int) -> Block:
        c = cuts[shard % len(cuts)]
        return Block(c.lengths, np.stack([np.full(c.lengths.size, shard, np.int64), c.document,
                                          c.chunks()], 1), c.divisible)
    return block


def build_job(config: LoaderConfig, sources: list, corpus: list, ranks: int) -> JobModel:
    job = JobModel.build(config, sources, None, ranks, data=data_options(config, sources, None))
    job.listed([[f"part-{k:03d}" for k in range(len(p))] for _, _, p in corpus])
    return job


def measure(num_sources: int, ranks: int, steps: int, readers: str = "auto",
            planner: str = "balanced") -> dict:
    """`readers`: "auto" (`plan/readers.py`), or "all" (every rank reads every source it has
    shards enough for, as before readers)."""
    corpus = lengths_corpus(num_sources)
    count = ranks if readers == "all" else None
    sources = [Source(f"/bench/{name}/", weight=w, name=name, readers=count)
               for name, w, _ in corpus]
    config = LoaderConfig(micro_batch_tokens=C, micro_batches=M, seed=0, planner=planner,
                          epochs=1)
    job = build_job(config, sources, corpus, ranks)
    job.start()
    blocks = [blocks_of(p) for _, _, p in corpus]
    windows = Windows([[ItemQueue(layout_feed(job.layout_for(s, 0).rank_units(r), blocks[s]))
                        for s in range(num_sources)] for r in range(ranks)])
    started = time.process_time()
    for _ in range(steps):
        if step_windows(job, windows)[2] is None:
            break
    run_s = time.process_time() - started
    t0 = time.process_time()
    state = job.state(job.snapshot())
    state_ms = (time.process_time() - t0) * 1e3
    t0 = time.process_time()
    saved = encode_state(state)
    save_ms = (time.process_time() - t0) * 1e3
    t0 = time.process_time()
    decoded = decode_state(saved)
    load_ms = (time.process_time() - t0) * 1e3
    assert decoded.sources == state.sources and decoded.ages == state.ages, "round trip"
    start_ms = {}   # a fresh job model (no process group) loads it: at R, and elastic
    for world in sorted({ranks, max(1, ranks // 2), ranks + 1}):
        fresh = build_job(config, sources, corpus, world)
        t0 = time.process_time()
        fresh.load(decoded)
        fresh.start()
        start_ms[world] = (time.process_time() - t0) * 1e3
    old = msgspec.json.encode(msgspec.structs.replace(state, version=4))
    units = sum(len(u) for p in state.sources for u in p.units)
    return {"sources": num_sources, "ranks": ranks, "readers": readers, "steps": job.step,
            "sources_read_max_per_rank": int(job.reads.sum(axis=1).max()),
            "state_bytes": len(saved), "state_bytes_v4": len(old),
            "units_in_progress": units, "pending_items": len(state.ages),
            "state_ms": round(state_ms, 2), "save_ms": round(save_ms, 2),
            "load_ms": round(load_ms, 2), "start_same_ms": round(start_ms[ranks], 2),
            "start_elastic_ms": round(max(v for w, v in start_ms.items() if w != ranks), 2),
            "run_cpu_s": round(run_s, 2)}


def start_rank(kind: str, config: LoaderConfig, sources: list, corpus: list, ranks: int,
               state=None):
    """A non-zero rank's start-up under gather: its model built, listed, `state` loaded,
    started, its buffers and the layouts of the sources it reads (`Runtime.run`)."""
    rank, data = ranks - 1, data_options(config, sources, None)
    job = JobModel.build(config, sources, None, ranks, 4, data, track=False) \
        if kind == "job_model" else RankShare.build(config, sources, None, ranks, rank, data)
    job.listed([[f"part-{k:03d}" for k in range(len(p))] for _, _, p in corpus])
    if state is not None:
        job.load(state)
    job.start()
    kept = (job.budgets(rank), [job.layout_for(s, job.epoch) for s in range(len(sources))
                                if job.reads_source(rank, s)])
    return job, kept


def saved_state(config: LoaderConfig, sources: list, corpus: list, ranks: int, steps: int):
    """The state after `steps` steps at `ranks` (the job model over lengths), decoded."""
    job = build_job(config, sources, corpus, ranks)
    job.start()
    blocks = [blocks_of(p) for _, _, p in corpus]
    windows = Windows([[ItemQueue(layout_feed(job.layout_for(s, 0).rank_units(r), blocks[s]))
                        for s in range(len(sources))] for r in range(ranks)])
    for _ in range(steps):
        step_windows(job, windows)
    return decode_state(encode_state(job.state(job.snapshot())))


def measure_share(num_sources: int, worlds: list[int], saved_at: int) -> list[dict]:
    corpus = lengths_corpus(num_sources)
    sources = [Source(f"/bench/{n}/", weight=w, name=n) for n, w, _ in corpus]
    config = LoaderConfig(micro_batch_tokens=C, micro_batches=M, seed=0, epochs=1,
                          planner="naive")
    state = saved_state(config, sources, corpus, saved_at, 4) if saved_at else None
    rows = []
    for ranks, loaded in [(r, None) for r in worlds] + \
            ([(r, state) for r in worlds] if state is not None else []):
        for kind in ("job_model", "rank_share"):
            shard_permutation.cache_clear()   # each kind deals from scratch
            started = time.process_time()
            held = start_rank(kind, config, sources, corpus, ranks, loaded)
            cpu_ms = (time.process_time() - started) * 1e3
            del held
            shard_permutation.cache_clear()
            tracemalloc.start()
            held = start_rank(kind, config, sources, corpus, ranks, loaded)
            current, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            rows.append({"kind": kind, "sources": num_sources, "ranks": ranks,
                         "resumed_from": saved_at if loaded is not None else None,
                         "sources_read": len(held[1][1]), "start_cpu_ms": round(cpu_ms, 1),
                         "held_mb": round(current / 1e6, 3), "peak_mb": round(peak / 1e6, 3)})
            del held
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4,8,16")
    p.add_argument("--many-ranks", default="2,16", help="ranks for the S = 300 runs")
    p.add_argument("--sources", type=int, default=30)
    p.add_argument("--many-sources", type=int, default=300)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--readers", default="auto",
                   help="comma list: auto (plan/readers.py), all (every rank reads)")
    p.add_argument("--round-trip", default="",
                   help="comma list of R (e.g. 1,8,64,512): also the save/load round trip of the "
                        "job model at S = --sources after 4 steps (planner naive past R = 64)")
    p.add_argument("--rank-share", default="",
                   help="comma list of R (e.g. 512,4096): only what a non-zero rank keeps at "
                        "S = --many-sources, the job model against its share")
    p.add_argument("--share-resumed-from", type=int, default=0,
                   help="with --rank-share: also loaded from a state saved after 4 steps at this "
                        "R (e.g. 512; ~15 s CPU to make), at each of the --rank-share R")
    args = p.parse_args()
    if args.rank_share:
        rows = measure_share(args.many_sources, [int(r) for r in args.rank_share.split(",")],
                             args.share_resumed_from)
        print(f"{'S':>4} {'R':>5} {'from':>5} {'kept':>10} {'reads':>5} {'start ms':>8} "
              f"{'held MB':>8} {'peak MB':>8}", file=sys.stderr)
        for r in rows:
            print(f"{r['sources']:>4} {r['ranks']:>5} {r['resumed_from'] or '-':>5} "
                  f"{r['kind']:>10} {r['sources_read']:>5} {r['start_cpu_ms']:>8} "
                  f"{r['held_mb']:>8} {r['peak_mb']:>8}", file=sys.stderr)
        print(json.dumps({"benchmark": "state_size", "rank_share": rows}))
        return
    rows = []
    for r in filter(None, args.round_trip.split(",")):
        rows.append(measure(args.sources, int(r), 4, "auto",
                            "balanced" if int(r) <= 64 else "naive"))
    for readers in args.readers.split(","):
        rows += [measure(args.sources, int(r), args.steps, readers) for r in args.ranks.split(",")]
        rows += [measure(args.many_sources, int(r), args.steps, readers)
                 for r in args.many_ranks.split(",") if args.many_sources]
    print(f"{'S':>4} {'R':>3} {'rd':>4} {'steps':>5} {'state v6':>9} {'state v4':>9} {'units':>6} "
          f"{'pending':>7} {'read/rank':>9} {'state ms':>8} {'save ms':>8} {'load ms':>8} "
          f"{'start ms':>8} {'elastic':>8}", file=sys.stderr)
    for r in rows:
        print(f"{r['sources']:>4} {r['ranks']:>3} {r['readers']:>4} {r['steps']:>5} "
              f"{r['state_bytes']:>9,} {r['state_bytes_v4']:>9,} {r['units_in_progress']:>6} "
              f"{r['pending_items']:>7} {r['sources_read_max_per_rank']:>9} "
              f"{r['state_ms']:>8} {r['save_ms']:>8} {r['load_ms']:>8} "
              f"{r['start_same_ms']:>8} {r['start_elastic_ms']:>8}", file=sys.stderr)
    by = {(r["sources"], r["ranks"], r["readers"]): r["state_bytes"] for r in rows}
    ratio = {}
    for S, rd in {(r["sources"], r["readers"]) for r in rows}:
        rs = sorted(R for s, R, d in by if (s, d) == (S, rd))
        if len(rs) > 1:
            ratio[f"S={S} readers={rd}"] = round(by[(S, rs[-1], rd)] / by[(S, rs[0], rd)], 3)
    print(json.dumps({"benchmark": "state_size", "rows": rows,
                      "ratio_largest_to_smallest_R": ratio}))


if __name__ == "__main__":
    main()
