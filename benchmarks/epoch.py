"""A whole epoch, judged as a trainer pays for it: steps, fill and compute per epoch.

    python benchmarks/epoch.py                       # loader at R=1,2,4; dry run at R=8,64,512
    python benchmarks/epoch.py --ranks 1,2 --planners naive,balanced --sim-ranks 8
    python benchmarks/epoch.py --scale 2 --step-overhead 0.1 --workdir /tmp/streamload-epoch

A trainer pays per global step: R ranks x M rows of at most C tokens, whatever the rows hold.
This runs one whole epoch (epochs=1) of a five-source corpus (`benchmarks/_epoch_corpus.py`:
JSONL, byte tokens, ~9.7M tokens at --scale 1; lengths 10..100k, a source of long documents
that outlives the others, a one-shard source, a schedule that switches weights at 25% of the
tokens) and measures what the epoch cost:

  loader   the public `sl.Loader` on real gloo process groups (one spawned process per rank,
           like benchmarks/loader_cpu.py), R in --ranks. Every rank records per step its tokens
           and its cost from its micro-batches' cu_seqlens (every segment is a document; the
           pieces of a split document count separately) and every sample id; the per-step lists
           come back through a multiprocessing queue and must have the same length on every
           rank. exactly_once: no sample id twice across ranks, and the ids are exactly the
           corpus's (every document, ":k" for each piece of a split one).
  sim      `streamload.commands.dryrun.simulate` (the loader's planning loop on lengths, no processes) on
           the same corpus, scanned with `dryrun.scan`, at R in --sim-ranks. So that a step of
           R x M x C tokens still leaves >= --sim-min-steps steps per epoch at large R, the
           scanned data is replicated k times (`sim_scale`; default: the smallest k that gives
           that many ideal steps, 1 at R=8): --sim-deal shards (default) copies every shard k
           times (k times as many shards of the same shape, dealt to ranks as the loader deals
           shards); roundrobin hands simulate plain arrays (every rank gets items). The
           schedule's switch is moved to 25% of the replicated tokens.

Cost model: a document (row segment) of L tokens costs L^2 / 24576 + L, i.e. a*L^2 + b*L with
a = 1, b = 24576, divided by 24576 (cost_a = 1/24576, cost_b = 1; units: "token-equivalents of
linear work"). The loader and the simulation plan with the same cost_a / cost_b. A rank's cost
in a step is the sum over its rows' segments. Epoch compute = sum over steps of the largest
rank's cost, plus (compute_with_overhead) a fixed per-step overhead of --step-overhead x the
linear cost of a full balanced step on one rank (0.05 x b x M x C = 0.05 x M x C by default):
optimizer, collectives, launch latency, paid on every step however full.

Per (mode, R, planner):
  steps, ideal_steps = ceil(total tokens / (R*M*C)), steps_over_ideal
  fill_mean          tokens delivered / (steps * R * M * C)
  tokens_per_step    p1 / p50 / p99
  low_fill_steps     steps below 0.9 fill, not counting the epoch's last R*M steps
                     (low_fill_steps_all: counting them); fill_by_decile: mean fill in each
                     tenth of the epoch's steps; source_last_step: the last step holding each
                     source's tokens (where the mix thins out)
  compute, compute_with_overhead: as delivered (every segment at its own cost)
  cut_work           the attention work that cutting pieces took out of the data: a piece of
                     L tokens delivered in parts n_i saved a*(L^2 - sum n_i^2) (loader: from
                     the delivered ids; sim: the dry run's StepReport.cut_work)
  compute_equal_work compute_with_overhead + cut_work / R: the same data uncut, its extra work
                     paid at 1/R as in full, balanced steps (exact at R = 1). Planners cut
                     different amounts (naive, packing in arrival order, cuts 2-3x as many
                     pieces), and a plan must not look cheaper by doing less work, so the
                     planners are compared on this
  speedup_vs_naive   naive's compute_equal_work / this one's at the same mode and R (> 1:
                     cheaper than naive); speedup_vs_naive_as_cut and _no_overhead: the same on
                     compute_with_overhead and compute
  imbalance_mean     mean over steps of max / mean rank cost
  scaling            steps(R) / (steps(1) / R), loader runs (1.0: steps shrink as 1/R)
  wall_s             loader: the slowest rank's Loader from construction to close; sim: simulate
  exactly_once       loader runs only (null for sim)
Targets (booleans, with the measured values, per configuration):
  fill               fill_mean >= 0.98 and steps <= 1.02 * ideal_steps
  tail               low_fill_steps == 0 (none below 0.9 fill except the last R*M steps)
  vs_naive           balanced and lookahead: compute_equal_work <= naive's (null for naive);
                     as_cut_met: the same as delivered (reported, not a target)
  scaling            loader: steps(R) <= 1.02 * steps(1) / R (null for sim, and without R=1)
  exactly_once       loader: as above (null for sim)
With R*M >= steps (the simulation at R=64 and 512 with the default sizes) every step is in
the excluded tail, so `tail` holds trivially there: read low_fill_steps_all instead.
all_met: every non-null target of every configuration; all_met_cost_aware: the same without
the baseline `naive` (which since issue 11 fills its steps too, by the same top-up and cuts).
The exit status is 0 whatever the targets say (this is a measurement); 1 on an error (a rank
failed or timed out). Ranks that disagree on the number of steps are reported (same_steps_all_ranks;
exactly_once is then false), not raised.

streamload is imported from the checkout this file sits in (its parent directory goes first
on sys.path, for the spawned ranks too), so a copy of benchmarks/epoch.py and _epoch_corpus.py
in another checkout (say `git archive HEAD | tar -x -C /tmp/head`) measures that checkout.
The corpus is cached under --workdir and shared by every checkout.

The human table goes to stderr; the last line of stdout is one JSON object:
  {"corpus": {"root", "scale", "tokens", "documents", "sources": [...]},
   "geometry": {"micro_batch_tokens", "micro_batches", "cost_a", "cost_b", "step_overhead",
                "overhead_per_step"},
   "results": [{"mode": "loader"|"sim", "ranks", "planner", "steps", "ideal_steps",
                "steps_over_ideal", "tokens", "fill_mean", "tokens_per_step": {"p1", "p50",
                "p99"}, "low_fill_steps", "low_fill_steps_all", "fill_by_decile",
                "source_last_step", "compute", "compute_with_overhead", "speedup_vs_naive",
                "speedup_vs_naive_no_overhead", "imbalance_mean", "scaling", "wall_s",
                "exactly_once", "sim_scale", "targets": {name: {"met", ...measured}}, "met"},
               ...],
   "all_met": bool, "all_met_cost_aware": bool, "wall_s": float}
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import queue as queue_module  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _epoch_corpus  # noqa: E402
from _options import add_loader_options, loader_options  # noqa: E402

PLANNERS = ("naive", "balanced", "lookahead")
COST_A, COST_B = 1.0 / 24576, 1.0        # a = 1, b = 24576, divided by 24576
LOW_FILL = 0.9
log = _epoch_corpus.log


# -- the job: sources, mixture, options (the same for the loader and the simulation) -----------
def make_sources(corpus: _epoch_corpus.EpochCorpus):
    import streamload as sl
    return [sl.Source(f"{corpus.root}/{s['name']}/", weight=s["weight"], name=s["name"])
            for s in corpus.sources]


def make_mixture(total_tokens: float):
    import streamload as sl
    return sl.Mixture(schedule_unit="tokens", interpolate="step",
                      schedule=[sl.MixPoint(at=at, weights=w)
                                for at, w in _epoch_corpus.mixture_points(total_tokens)])


def job_options(args, planner: str) -> dict:
    return loader_options(args.sl_opt, micro_batch_tokens=args.micro_batch_tokens,
                          micro_batches=args.micro_batches, seed=args.seed, epochs=1,
                          planner=planner, cost_a=COST_A, cost_b=COST_B)


# -- loader runs: one spawned process per rank ---------------------------------------------------
def run_rank(rank: int, world: int, port: int, corpus: _epoch_corpus.EpochCorpus, options: dict,
             queue) -> None:
    try:
        if world > 1:
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=300))
        import streamload as sl
        names = corpus.names
        index = {n: i for i, n in enumerate(names)}
        a, b = options["cost_a"], options["cost_b"]
        tokens, costs, planned, by_source, ids = [], [], [], [], []
        started = time.perf_counter()
        with sl.Loader(make_sources(corpus), mixture=make_mixture(corpus.tokens),
                       **options) as loader:
            for batch in loader:
                step_tokens, step_cost = 0, 0.0
                per_source = [0] * len(names)
                for mb in batch.micro_batches:
                    seg = np.diff(mb.cu_seqlens.numpy()).astype(np.int64)
                    step_tokens += mb.num_tokens
                    step_cost += float((a * seg * seg + b * seg).sum())
                    if len(mb.sample_ids) != seg.size:
                        raise RuntimeError(f"step {batch.step}: {len(mb.sample_ids)} sample ids "
                                           f"for {seg.size} cu_seqlens segments")
                    for sid, n in zip(mb.sample_ids, seg.tolist()):
                        per_source[index[sid.split("/", 1)[0]]] += n
                        ids.append((sid, n))
                tokens.append(step_tokens)
                costs.append(step_cost)
                planned.append(batch.rank_cost_of(rank))
                by_source.append(per_source)
            stats = loader.stats()
        wall = time.perf_counter() - started
        queue.put({"rank": rank, "tokens": tokens, "costs": costs, "planned": planned,
                   "by_source": by_source, "ids": ids, "wall_s": wall,
                   "stall_s": float(stats.get("stall_s", 0.0))})
        if world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, world: int, timeout: float, *args) -> list[dict]:
    """Spawn `world` processes of `target(rank, world, port, *args, queue)` (gloo on a free
    loopback port); each puts one dict on the queue ({"rank", ...}, or {"rank", "error"}).
    Returns them by rank. Raises if a rank fails, exits without a result or times out."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                item = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} exited with "
                                       f"{[procs[r].exitcode for r in dead]} and no result")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"R={world}: no result after {timeout:.0f}s")
                continue
            if "error" in item:
                raise RuntimeError(f"rank {item['rank']} of {world} failed:\n{item['error']}")
            results[item["rank"]] = item
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]


def run_loader(world: int, corpus, options: dict, timeout: float) -> list[dict]:
    """Spawn `world` ranks; return their records, by rank. Raises if a rank fails."""
    return spawn_ranks(run_rank, world, timeout, corpus, options)


def loader_config(world: int, planner: str, corpus, args, expected_ids: dict) -> dict:
    options = job_options(args, planner)
    started = time.perf_counter()
    ranks = run_loader(world, corpus, options, args.timeout)
    elapsed = time.perf_counter() - started
    lengths = [len(r["tokens"]) for r in ranks]
    steps = max(lengths)

    def table(key):   # [steps, R], padded with 0 where a rank stopped early
        out = np.zeros((steps, world))
        for q, r in enumerate(ranks):
            out[:len(r[key]), q] = r[key]
        return out

    rank_tokens, rank_cost = table("tokens"), table("costs")
    planned = table("planned")
    by_source = np.zeros((steps, len(corpus.names)))
    for r in ranks:
        by_source[:len(r["by_source"])] += np.array(r["by_source"]).reshape(-1, len(corpus.names))
    from streamload.commands.demo.corpus import check_delivery
    parts = [tuple(i) for r in ranks for i in r["ids"]]
    check = check_delivery(parts, expected_ids)
    out = metrics(rank_tokens, rank_cost, by_source, world, args, corpus.names,
                  cut_work=cut_work(parts, options["cost_a"]))
    out.update({
        "mode": "loader", "ranks": world, "planner": planner,
        "same_steps_all_ranks": len(set(lengths)) == 1, "rank_steps": lengths,
        "wall_s": round(max(r["wall_s"] for r in ranks), 2),
        "wall_with_spawn_s": round(elapsed, 2),
        "stall_s": round(max(r["stall_s"] for r in ranks), 3),
        # the plan's predicted rank cost against the cost measured from cu_seqlens
        "plan_cost_max_rel_dev": round(float(np.max(np.abs(planned - rank_cost)
                                                    / np.maximum(rank_cost, 1.0))), 6),
        "samples": len(parts), "duplicates": len(check["duplicates"]),
        "missing": len(check["missing"]), "unexpected": len(check["unexpected"]),
        "pieces_not_tiled": len(check["untiled"]),
        "cut_parts": sum("+" in sid for sid, _ in parts),
        "sim_scale": None,
    })
    out["exactly_once"] = (not any(check.values()) and out["same_steps_all_ranks"])
    return out


def cut_work(parts, a: float) -> float:
    """The attention work the epoch's cuts took out of the data, from what was delivered: a
    piece delivered in parts of n_i tokens (":k", ":k+offset", ...) costs a*(sum n_i)^2 + b*sum
    n_i uncut and sum(a*n_i^2 + b*n_i) cut, so the cuts saved a*((sum n_i)^2 - sum n_i^2)."""
    by_piece: dict[str, list[int]] = {}
    for sid, n in parts:
        by_piece.setdefault(sid.partition("+")[0], []).append(int(n))
    return float(sum(a * (sum(ns) ** 2 - sum(n * n for n in ns))
                     for ns in by_piece.values() if len(ns) > 1))


# -- simulation ---------------------------------------------------------------------------------
def scan_corpus(corpus, args):
    from streamload.configfile import LoaderSpec
    from streamload.commands.dryrun import scan
    spec = LoaderSpec("benchmarks/epoch.py", make_sources(corpus), job_options(args, "balanced"),
                      make_mixture(corpus.tokens))
    started = time.perf_counter()
    scans = scan(spec)
    total = sum(s.tokens for s in scans)
    log(f"scanned lengths in {time.perf_counter() - started:.1f}s: "
        + ", ".join(f"{s.name} {s.lengths.size:,} items/{s.shards} shards" for s in scans))
    if total != corpus.tokens:
        raise RuntimeError(f"the scan found {total:,} tokens, the corpus holds {corpus.tokens:,}")
    return scans


def sim_scale_for(ranks: int, corpus, args) -> int:
    if args.sim_scale != "auto":
        return int(args.sim_scale)
    step = ranks * args.micro_batches * args.micro_batch_tokens
    return max(1, math.ceil(args.sim_min_steps * step / corpus.tokens))


def replicate(scans, k: int, deal: str):
    if deal == "roundrobin":
        return [np.tile(s.lengths, k) for s in scans]
    if k == 1:
        return scans
    return [dataclasses.replace(s, lengths=np.tile(s.lengths, k),
                                divisible=None if s.divisible is None else np.tile(s.divisible, k),
                                shard_items=np.tile(s.shard_items, k), shards=s.shards * k,
                                shards_read=s.shards_read * k, documents=s.documents * k)
            for s in scans]


def sim_config(world: int, planner: str, corpus, scans, args) -> dict:
    from streamload.configfile import LoaderSpec
    from streamload.commands.dryrun import simulate
    k = sim_scale_for(world, corpus, args)
    data = replicate(scans, k, args.sim_deal)
    total = corpus.tokens * k
    spec = LoaderSpec("benchmarks/epoch.py", make_sources(corpus), job_options(args, planner),
                      make_mixture(total))
    ideal = math.ceil(total / (world * args.micro_batches * args.micro_batch_tokens))
    cap = 20 * ideal + 1000
    started = time.perf_counter()
    reports = simulate(spec, data, steps=cap, ranks=world)
    wall = time.perf_counter() - started
    steps, S = len(reports), len(corpus.names)
    rank_tokens = np.zeros((steps, world))
    rank_cost = np.zeros((steps, world))
    by_source = np.zeros((steps, S))
    for i, r in enumerate(reports):   # StepReport's fields, as far as this version has them
        per_source = np.asarray(getattr(r, "tokens", ()), dtype=np.float64).reshape(-1)
        if per_source.size == S:
            by_source[i] = per_source
        rank_cost[i] = np.asarray(r.rank_cost, dtype=np.float64)
        per_rank = getattr(r, "rank_tokens", None)
        if per_rank is not None and np.size(per_rank) == world:
            rank_tokens[i] = np.asarray(per_rank, dtype=np.float64)
        else:   # no per-rank tokens: spread the step's tokens evenly (fill stays exact)
            rank_tokens[i] = (per_source.sum() if per_source.size == S else
                              float(r.fill) * world * args.micro_batches
                              * args.micro_batch_tokens) / world
    out = metrics(rank_tokens, rank_cost, by_source, world, args, corpus.names,
                  cut_work=float(sum(getattr(r, "cut_work", 0.0) for r in reports)))
    out.update({"mode": "sim", "ranks": world, "planner": planner, "wall_s": round(wall, 2),
                "sim_scale": k, "sim_deal": args.sim_deal, "truncated": steps >= cap,
                "exactly_once": None})
    if out["tokens"] != total:
        out["note"] = f"delivered {out['tokens']:,} of {total:,} tokens"
    return out


# -- metrics and targets ------------------------------------------------------------------------
def metrics(rank_tokens: np.ndarray, rank_cost: np.ndarray, by_source: np.ndarray, R: int, args,
            names, cut_work: float) -> dict:
    M, C = args.micro_batches, args.micro_batch_tokens
    steps = rank_tokens.shape[0]
    step_tokens = rank_tokens.sum(axis=1)
    total = int(round(step_tokens.sum()))
    capacity = R * M * C
    fill = step_tokens / capacity
    ideal = math.ceil(total / capacity)
    overhead = args.step_overhead * COST_B * M * C
    largest = rank_cost.max(axis=1) if steps else np.zeros(0)
    mean = rank_cost.mean(axis=1) if steps else np.zeros(0)
    imbalance = np.where(mean > 0, largest / np.maximum(mean, 1e-300), 1.0)
    body = fill[:max(steps - R * M, 0)]
    deciles = [float(np.mean(part)) if part.size else None
               for part in np.array_split(fill, 10)] if steps else []
    last_step = {}
    for s, name in enumerate(names):
        nz = np.flatnonzero(by_source[:, s] > 0)
        last_step[name] = int(nz[-1]) if nz.size else None
    low = np.flatnonzero(body < LOW_FILL)
    # The mix, where it is defined by the first weights alone: the steps before the schedule's
    # switch and before any source ran out. A planner could buy fill by taking the wrong data.
    (_, first), (switch, _) = _epoch_corpus.mixture_points(total)
    before = np.cumsum(step_tokens) <= switch
    before[min([v for v in last_step.values() if v is not None], default=0):] = False
    window = by_source[before].sum(axis=0)
    target = np.array([first[n] for n in names]) / sum(first.values())
    mix_dev = float(np.abs(window / window.sum() - target).max()) if window.sum() > 0 else None
    return {
        "steps": steps, "ideal_steps": ideal,
        "steps_over_ideal": round(steps / ideal, 4) if ideal else None,
        "tokens": total,
        "fill_mean": round(total / (steps * capacity), 4) if steps else 0.0,
        "tokens_per_step": {f"p{q}": int(np.percentile(step_tokens, q)) if steps else 0
                            for q in (1, 50, 99)},
        "low_fill_steps": int(low.size),
        "low_fill_steps_all": int((fill < LOW_FILL).sum()),
        "first_low_fill_step": int(low[0]) if low.size else None,
        "fill_by_decile": [round(d, 3) if d is not None else None for d in deciles],
        "source_last_step": last_step,
        "compute": round(float(largest.sum()), 1),
        "compute_with_overhead": round(float(largest.sum() + steps * overhead), 1),
        "cut_work": round(cut_work, 1),
        # the same data, uncut: the work the cuts took out, paid at 1/R in full, balanced steps
        "compute_equal_work": round(float(largest.sum() + steps * overhead + cut_work / R), 1),
        "imbalance_mean": round(float(imbalance.mean()), 4) if steps else None,
        "mix_steps": int(before.sum()),
        "mix_max_abs_dev": round(mix_dev, 4) if mix_dev is not None else None,
    }


def check_targets(results: list[dict]) -> tuple[bool, bool]:
    """Fill in the naive ratios, scaling and targets; return (all_met, all_met by the
    cost-aware planners, the baseline `naive` left out)."""
    def find(mode, ranks, planner):
        for r in results:
            if (r["mode"], r["ranks"], r["planner"]) == (mode, ranks, planner):
                return r
        return None

    all_met = cost_aware_met = True
    for r in results:
        naive = find(r["mode"], r["ranks"], "naive")
        for key, field in (("speedup_vs_naive", "compute_equal_work"),
                           ("speedup_vs_naive_as_cut", "compute_with_overhead"),
                           ("speedup_vs_naive_no_overhead", "compute")):
            r[key] = (round(naive[field] / r[field], 4) if naive and r[field] > 0 else None)
        one = find("loader", 1, r["planner"]) if r["mode"] == "loader" else None
        r["scaling"] = (round(r["steps"] / (one["steps"] / r["ranks"]), 4)
                        if one and one["steps"] else None)
        targets = {
            "fill": {"met": r["fill_mean"] >= 0.98 and r["steps"] <= 1.02 * r["ideal_steps"],
                     "fill_mean": r["fill_mean"], "steps": r["steps"],
                     "ideal_steps": r["ideal_steps"]},
            "tail": {"met": r["low_fill_steps"] == 0, "low_fill_steps": r["low_fill_steps"],
                     "excluded_last_steps": r["ranks"] * r["micro_batches"]},
            "vs_naive": ({"met": None} if r["planner"] == "naive" or naive is None else
                         {"met": r["compute_equal_work"] <= naive["compute_equal_work"],
                          "compute_equal_work": r["compute_equal_work"],
                          "naive": naive["compute_equal_work"],
                          "as_cut_met": r["compute_with_overhead"]
                          <= naive["compute_with_overhead"]}),
            "scaling": ({"met": None} if r["scaling"] is None or r["ranks"] == 1 else
                        {"met": r["scaling"] <= 1.02, "steps": r["steps"],
                         "steps_1": one["steps"], "scaling": r["scaling"]}),
            "exactly_once": {"met": r["exactly_once"]},
        }
        r["targets"] = targets
        r["met"] = all(t["met"] is not False for t in targets.values())
        all_met = all_met and r["met"]
        if r["planner"] != "naive":
            cost_aware_met = cost_aware_met and r["met"]
    return all_met, cost_aware_met


def print_table(results: list[dict]) -> None:
    def b(x):
        return "-" if x is None else ("yes" if x else "NO")

    header = (f"{'mode':<7}{'R':>4} {'planner':<10}{'steps':>6}{'ideal':>6}{'st/id':>6}"
              f"{'fill':>7}{'p1':>9}{'p50':>9}{'p99':>9}{'low':>5}{'all':>5}{'compute+oh':>12}"
              f"{'equal_work':>12}{'vs_naive':>9}{'as_cut':>7}{'imb':>7}{'mix':>7}{'scal':>6}{'once':>5}{'wall_s':>8}"
              f"  targets f/t/n/s")
    print("low / all: steps below 0.9 fill, without / with the epoch's last R*M steps; "
          "equal_work: compute+oh plus the work cuts took out at 1/R; vs_naive: naive's "
          "equal_work / this; as_cut: the same on compute+oh; imb: mean max/mean rank cost; scal: "
          "steps(R) / (steps(1) / R); mix: max |realized - target| share before the schedule's "
          "switch and the first source's end; targets: fill / tail / vs_naive / scaling",
          file=sys.stderr)
    print(header, file=sys.stderr)
    for r in results:
        t = r["targets"]
        vs, vs_cut = r["speedup_vs_naive"], r["speedup_vs_naive_as_cut"]
        sc = r["scaling"]
        mix = r["mix_max_abs_dev"]
        print(f"{r['mode']:<7}{r['ranks']:>4} {r['planner']:<10}{r['steps']:>6}"
              f"{r['ideal_steps']:>6}{r['steps_over_ideal']:>6.2f}{r['fill_mean']:>7.3f}"
              f"{r['tokens_per_step']['p1']:>9}{r['tokens_per_step']['p50']:>9}"
              f"{r['tokens_per_step']['p99']:>9}{r['low_fill_steps']:>5}"
              f"{r['low_fill_steps_all']:>5}"
              f"{r['compute_with_overhead']:>12.4g}{r['compute_equal_work']:>12.4g}"
              f"{'-' if vs is None else f'{vs:.3f}':>9}"
              f"{'-' if vs_cut is None else f'{vs_cut:.3f}':>7}"
              f"{r['imbalance_mean']:>7.3f}"
              f"{'-' if mix is None else f'{mix:.3f}':>7}"
              f"{'-' if sc is None else f'{sc:.2f}':>6}"
              f"{b(r['exactly_once']):>5}{r['wall_s']:>8.1f}  "
              + "/".join(b(t[k]["met"]) for k in ("fill", "tail", "vs_naive", "scaling")),
              file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2,4", help="loader world sizes (comma list; '' = none)")
    p.add_argument("--sim-ranks", default="8,64,512", help="simulated world sizes ('' = none)")
    p.add_argument("--planners", default=",".join(PLANNERS))
    p.add_argument("--micro-batch-tokens", type=int, default=4096, help="C")
    p.add_argument("--micro-batches", type=int, default=2, help="M")
    p.add_argument("--step-overhead", type=float, default=0.05,
                   help="per-step overhead, as a fraction of b*M*C (a full step's linear cost)")
    p.add_argument("--scale", type=float, default=1.0, help="corpus size (1: ~9.7M tokens)")
    p.add_argument("--sim-scale", default="auto",
                   help="replicate the scanned corpus k times in the simulation; auto: the "
                        "smallest k giving --sim-min-steps ideal steps at each R")
    p.add_argument("--sim-min-steps", type=int, default=100)
    p.add_argument("--sim-deal", choices=("shards", "roundrobin"), default="shards")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="/tmp/streamload-epoch")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per loader run")
    add_loader_options(p)
    args = p.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    sim_ranks = [int(x) for x in args.sim_ranks.split(",") if x.strip()]
    planners = [x.strip() for x in args.planners.split(",") if x.strip()]
    for planner in planners:
        if planner not in PLANNERS:
            p.error(f"--planners: unknown planner {planner!r}")
    if args.sim_scale != "auto" and not args.sim_scale.isdigit():
        p.error("--sim-scale: 'auto' or a positive integer")

    started = time.perf_counter()
    corpus = _epoch_corpus.load_or_generate(args.workdir, args.scale, args.seed)
    M, C = args.micro_batches, args.micro_batch_tokens
    expected = corpus.expected_items(C)
    log(f"corpus {corpus.root}: {corpus.tokens:,} tokens, {corpus.documents:,} documents, "
        f"{len(expected):,} items at C={C:,}; M={M}, step overhead "
        f"{args.step_overhead:g} x M x C = {args.step_overhead * M * C:,.0f}")
    results = []

    def record(r: dict, label: str, extra: str = "") -> None:
        r["micro_batches"] = M
        results.append(r)
        log(f"{label}: {r['steps']} steps (ideal {r['ideal_steps']}), fill {r['fill_mean']:.3f}, "
            f"compute+oh {r['compute_with_overhead']:,.0f}{extra}, {r['wall_s']:.1f}s")

    for world in ranks:
        for planner in planners:
            r = loader_config(world, planner, corpus, args, expected)
            record(r, f"loader R={world} {planner}", f", exactly_once {r['exactly_once']}")
    if sim_ranks:
        scans = scan_corpus(corpus, args)
        for world in sim_ranks:
            for planner in planners:
                r = sim_config(world, planner, corpus, scans, args)
                record(r, f"sim R={world} x{r['sim_scale']} {planner}")
    all_met, cost_aware_met = check_targets(results)
    print(file=sys.stderr)
    print_table(results)
    wall = time.perf_counter() - started
    print(f"\nall targets met: {all_met}; by balanced and lookahead: {cost_aware_met}; "
          f"{wall:.0f}s", file=sys.stderr)
    print(json.dumps({
        "corpus": {"root": corpus.root, "scale": corpus.scale, "tokens": corpus.tokens,
                   "documents": corpus.documents, "items": len(expected),
                   "switch_at_fraction": _epoch_corpus.SWITCH, "sources": corpus.describe()},
        "geometry": {"micro_batch_tokens": C, "micro_batches": M, "cost_a": COST_A,
                     "cost_b": COST_B, "step_overhead": args.step_overhead,
                     "overhead_per_step": args.step_overhead * COST_B * M * C},
        "results": results, "all_met": all_met, "all_met_cost_aware": cost_aware_met,
        "wall_s": round(wall, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
