"""Measured training on the same tokens: naive vs cost-balanced (vs lookahead) plans, 2 gloo ranks.

This benchmark measures; it does not predict. A planner is judged by what the same tokens cost,
not by what one step costs: a plan can make each step look balanced by leaving slots empty, and
then the data takes more steps and longer. So every planner here delivers the same finite sample
stream (one "epoch", about --tokens tokens) until it is exhausted, and the figure of merit is the
total time that took.

Data. Every (rank, source) buffer is a FIFO holding a fixed, seeded sequence of document lengths
(three sources: two lognormal ones and one with 25% of documents near C), with tokens x weight / R
tokens in it (the document that would cross that total is left out, so every planner gets the
identical samples). Each step offers the head windows (1.5 steps' share of each source deep, W
steps' share for lookahead, plus one row); what a plan leaves stays at the head with age + 1, as
in the loader (`--max-age` bounds the wait). The step's targets are the weights (renormalized
over the sources that still hold data) x R*M*C x --fill. The project's planner plans every step,
with method "naive" (token-balanced, the baseline), "balanced" (cost-balanced) and "lookahead"
(balanced over a window of W steps; skipped with a note if it cannot plan here), each with the
same `step_overhead` (the per-step cost the top-up weighs empty slots against; `--step-overhead`).
Planning happens before the ranks start; every planner runs until its stream is empty.

Measurement. Two processes (gloo, 127.0.0.1 only) each run forward plus backward of a small
transformer (real SDPA attention with document masking, see `streamload.commands.calibrate.doc_attention`)
over their own M packed micro-batches of the step, then all-reduce the gradients as one flat
buffer, as data-parallel training does. Rows are not padded: a row of n tokens is an [n]-token
tensor, like varlen packing. The planners' steps are interleaved in one run, each planner's
stream continuing until it has delivered everything: the next step is always from the planner
furthest behind in its own epoch (ties rotate), so all of them progress at the same rate and
drifts in machine load hit them alike. With --repeats K the whole interleaved pass runs K times
(every other pass in reverse order) and totals are medians over the passes. Before timing, each
rank runs two warm-up steps of mixed-length rows, and --warmup N runs each planner's first N
steps once untimed (they are timed again in the pass).

Per step and rank it records
    compute_s  forward+backward over the rank's rows (from a barrier to the end of backward)
    step_s     compute plus the gradient all-reduce, which waits for the slowest rank
    cpu_s      the compute in CPU time (`time.thread_time`; a rank runs one torch thread):
               what the work cost without the time the rank sat descheduled by other load
A step takes max over ranks of step_s (the all-reduce makes every rank wait for the slowest).

Per planner it reports
    steps, ideal_steps   steps taken; ceil(tokens / (R*M*C))
    fill                 tokens / (steps * R * M * C)
    total_s              sum over steps of the step time: the time for the whole stream
    tokens_per_s         tokens / total_s
    speedup_vs_naive     naive's total_s / this total_s, for the same tokens (> 1: faster)
    cpu_total_s          sum over steps of the slowest rank's CPU-time compute;
                         cpu_speedup_vs_naive likewise (insensitive to other load; no all-reduce)
    predicted_speedup_vs_naive   the cost model's: sum over steps of (largest predicted rank
                         cost + step overhead), naive's / this one's
    step_s_median, per_step_speedup_vs_naive   the old per-step figure (naive median / this
                         median), shown beside the same-token one because it can disagree
    imbalance_measured   mean over steps of max / mean of the ranks' compute (wall; _cpu: CPU)
    imbalance_predicted  the same from the cost model's rank costs
    plan_ms_median, exchanged_fraction, deferral_max
    predicted_compute_speedup_vs_naive   the cost model's figure for cpu_speedup_vs_naive (the
                         slowest rank's predicted compute summed over the steps, no overhead)
Every rank checks that it ran exactly the planned tokens, and every planner must deliver the
same total.

Prediction. Per step and rank, the cost model's compute for the rank's rows (the sum over its
documents of a*L^2 + b*L, plus the calibration's per-row constant c per non-empty row; in
seconds with `--cost calibrate`) is printed and recorded beside the measured compute (CPU time
on the CPU, wall time on CUDA; the median over the passes), with err = predicted / measured - 1.
`prediction_error` summarizes |err| over every (step, rank) of every planner (median, p90, max,
share within 10%): "raw" in seconds, "scaled" after one global factor (the median of measured /
predicted; it takes out the FLOP model's units and a uniform drift of the machine between the
calibration and the run, and leaves the relative costs, all that the planner uses).
`within_10pct`: the p90 of the scaled error is at most 10% (`within_10pct_seconds`: of the
seconds error). The calibration is its own measurement, before the run, on its own rows;
nothing of the measured steps goes into the prediction.

The cost model that the planner uses is, by default (`--cost calibrate`), fitted before the run
on this same model by `streamload.commands.calibrate`'s rows and fit (rows of C, C/2 and C/4
tokens with different document mixes, of distinct lengths as real rows have), timed in the
ranks themselves, all at once, on their devices and with their thread count, as they then run
the steps (CPU time on the CPU; a row's time is the median of --calib-repeats passes, the mean
over the ranks).
`--cost transformer` uses `CostModel.transformer()` of the model's dimensions (FLOPs) instead,
and `--cost FILE` loads a `streamload calibrate --output FILE` result.

On CUDA each rank uses cuda:<rank> when there are enough GPUs. With one GPU both ranks share
cuda:0: their kernels then time-slice one device, so per-rank compute times overlap and the
comparison says little; the run prints a note. The gradients are all-reduced on the CPU (gloo).

    python benchmarks/train_step.py            # 2 CPU cores: ~2-3 min (~600k tokens per planner)
    python benchmarks/train_step.py --quick    # ~20 s
    python benchmarks/train_step.py --planners naive,balanced --tokens 1000000 --repeats 2
    python benchmarks/train_step.py --device cuda

The human table goes to stderr; the last line of stdout is one JSON object:
  {"device", "ranks", "micro_batches", "capacity", "threads_per_rank", "tokens_requested",
   "tokens" (delivered, the same for every planner), "ideal_steps", "repeats", "warmup",
   "model", "cost_model", "fill", "max_age", "lookahead", "step_overhead", "planners",
   "skipped": {planner: reason},
   "speedup_vs_naive": {planner: x}, "cpu_speedup_vs_naive": {...} (null off the CPU),
   "predicted_speedup_vs_naive": {...}, "per_step_speedup_vs_naive": {...},
   "results": {planner: {"steps", "ideal_steps", "tokens", "fill", "total_s", "total_s_passes",
                         "tokens_per_s", "speedup_vs_naive", "compute_total_s", "cpu_total_s",
                         "cpu_speedup_vs_naive", "predicted_cost", "predicted_speedup_vs_naive",
                         "step_s_median", "per_step_speedup_vs_naive", "imbalance_measured",
                         "imbalance_measured_cpu", "imbalance_predicted", "tokens_per_step":
                         {"p1", "p50", "p99"}, "plan_ms_median", "exchanged_fraction",
                         "deferral_mean", "deferral_max",
                         "predicted_compute", "measured_compute": [step][rank],
                         "predicted_compute_total", "predicted_compute_speedup_vs_naive",
                         "prediction_error": {"raw", "scaled"},
                         "per_step": [{"tokens", "step_s", "compute_s": [per rank],
                                       "cpu_s": [per rank], "imbalance_predicted",
                                       "predicted" (model units), "measured" (s),
                                       "error" (seconds, or scaled): [per rank]}, ...]}},
   "predicted_compute_speedup_vs_naive": {planner: x},
   "prediction_error": {"raw": {"median", "p90", "max", "share_within_10pct"} (null unless
                        seconds), "bias", "scale", "scaled": {...}, "within_10pct",
                        "within_10pct_seconds"},
   "wall_s", "loadavg_1m": [before, after], "cpu_count"}
(per_step values are from the first pass.)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from datetime import timedelta

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from streamload.plan.cost import CostModel  # noqa: E402
from streamload.plan.planner import METHODS, Planner  # noqa: E402
from streamload.plan.types import Candidates, Geometry  # noqa: E402

# ------------------------------------------------------------------------------------ data
SOURCES = (
    # name, weight, lognormal median, sigma, fraction of near-capacity documents
    ("web", 0.55, 250, 1.0, 0.0),
    ("code", 0.30, 600, 1.1, 0.0),
    ("books", 0.15, 1500, 0.6, 0.25),
)
WEIGHTS = np.array([w for _, w, *_ in SOURCES]) / sum(w for _, w, *_ in SOURCES)


def sample_lengths(rng: np.random.Generator, source: int, n: int, capacity: int) -> np.ndarray:
    _, _, median, sigma, long_frac = SOURCES[source]
    lengths = rng.lognormal(np.log(median), sigma, n)
    long_ = rng.random(n) < long_frac
    lengths[long_] = rng.uniform(0.6 * capacity, capacity, int(long_.sum()))
    return np.clip(np.rint(lengths), 16, capacity).astype(np.int64)


def finite_buffer(seed: int, rank: int, source: int, tokens: float, capacity: int) -> np.ndarray:
    """The (rank, source) buffer's whole content: its seeded documents up to `tokens` tokens
    (the one that would cross the total is left out)."""
    rng = np.random.default_rng([seed, rank, source])
    parts, have = [], 0
    while have < tokens:
        chunk = sample_lengths(rng, source, 64, capacity)
        parts.append(chunk)
        have += int(chunk.sum())
    lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return lengths[np.cumsum(lengths) <= tokens]


class SampleStream:
    """Every (rank, source) buffer as a finite FIFO (`finite_buffer`), so every planner sees
    the same samples. Each step offers the head window of each buffer (`depth` steps' worth of
    the rank's share of the source's target, plus one row); the samples a plan does not take
    stay at the head with age + 1 and are offered again, as in the loader."""

    def __init__(self, seed: int, geometry: Geometry, tokens: float, depth: float, fill: float):
        self.geometry, self.depth, self.fill = geometry, depth, fill
        R, S, C = geometry.ranks, len(SOURCES), geometry.capacity
        self.lengths = [[finite_buffer(seed, r, s, tokens * WEIGHTS[s] / R, C) for s in range(S)]
                        for r in range(R)]
        self.ages = [[np.zeros(x.size, np.int32) for x in row] for row in self.lengths]
        self.window = [[0] * S for _ in range(R)]

    @property
    def tokens_left(self) -> int:
        return int(sum(x.sum() for row in self.lengths for x in row))

    def targets(self) -> np.ndarray:
        """This step's tokens per source: the weights, renormalized over the sources with data."""
        left = np.array([sum(int(self.lengths[r][s].sum()) for r in range(self.geometry.ranks))
                         for s in range(len(SOURCES))])
        w = np.where(left > 0, WEIGHTS, 0.0)
        return w / max(w.sum(), 1e-12) * self.geometry.step_tokens * self.fill

    def candidates(self, targets: np.ndarray) -> Candidates:
        R, C = self.geometry.ranks, self.geometry.capacity
        for r in range(R):
            for s in range(len(SOURCES)):
                need = self.depth * targets[s] / R + C
                self.window[r][s] = int(np.searchsorted(np.cumsum(self.lengths[r][s]), need)) + 1
        return Candidates.from_windows(
            [[self.lengths[r][s][:self.window[r][s]] for s in range(len(SOURCES))] for r in range(R)],
            ages=[[self.ages[r][s][:self.window[r][s]] for s in range(len(SOURCES))] for r in range(R)])

    def consume(self, c: Candidates, take: np.ndarray) -> None:
        taken = np.zeros(len(c), bool)
        taken[take] = True
        for r in range(self.geometry.ranks):
            for s in range(len(SOURCES)):
                here = (c.rank == r) & (c.source == s)
                keep = np.ones(self.lengths[r][s].shape[0], bool)
                keep[c.position[here & taken]] = False
                self.ages[r][s][:self.window[r][s]] += 1      # offered once more
                self.lengths[r][s] = self.lengths[r][s][keep]
                self.ages[r][s] = self.ages[r][s][keep]


def plan_rows(assignment, candidates: Candidates, geometry: Geometry) -> list[list[list[int]]]:
    """rows[rank][m] -> document lengths in the order the plan packs them."""
    rows = [[[] for _ in range(geometry.micro_batches)] for _ in range(geometry.ranks)]
    lengths = candidates.length[assignment.take]
    for L, r, m in zip(lengths.tolist(), assignment.rank.tolist(), assignment.row.tolist()):
        rows[r][m].append(int(L))
    for r in range(geometry.ranks):
        for m in range(geometry.micro_batches):
            if sum(rows[r][m]) > geometry.capacity:
                raise AssertionError(f"plan overfills rank {r} row {m}: {sum(rows[r][m])} tokens")
    return rows


def make_planner(args, geometry: Geometry, cost: CostModel, name: str) -> Planner:
    return Planner(geometry, cost, method=name, seed=args.seed, max_age=args.max_age,
                   lookahead=args.lookahead, step_overhead=args.step_overhead)


def build_plans(args, geometry: Geometry, cost: CostModel, name: str) -> dict:
    """Every step of one planner's epoch: it plans until its stream is empty."""
    planner = make_planner(args, geometry, cost, name)
    depth = float(args.lookahead) if name == "lookahead" else 1.5
    stream = SampleStream(args.seed, geometry, args.tokens, depth, args.fill)
    total = stream.tokens_left
    out = {"rows": [], "rank_cost": [], "plan_ms": [], "exchanged": [], "age": [], "tokens": [],
           "overhead": planner.overhead, "total_tokens": total}
    limit = 10 * math.ceil(total / geometry.step_tokens) + 100
    while stream.tokens_left > 0:
        if len(out["rows"]) >= limit:
            raise RuntimeError(f"{name}: no end after {limit} steps "
                               f"({stream.tokens_left} tokens left)")
        targets = stream.targets()
        c = stream.candidates(targets)
        t0 = time.perf_counter()
        a = planner.assign(c, targets, len(out["rows"]))
        out["plan_ms"].append((time.perf_counter() - t0) * 1e3)
        out["rows"].append(plan_rows(a, c, geometry))
        out["rank_cost"].append(a.rank_cost.tolist())
        lengths = c.length[a.take]
        moved = lengths[c.rank[a.take] != a.rank].sum()
        out["exchanged"].append(float(moved) / max(float(lengths.sum()), 1.0))
        out["age"].append(c.age[a.take].tolist())
        out["tokens"].append(int(lengths.sum()))
        stream.consume(c, a.take)
    if sum(out["tokens"]) != total:
        raise AssertionError(f"{name}: delivered {sum(out['tokens'])} of {total} tokens")
    return out


def interleave(counts: dict[str, int]) -> list[tuple[str, int]]:
    """One pass over every planner's steps: always next the step of the planner furthest
    behind in its own epoch (lowest share of its steps done), ties rotating, so the planners
    progress at the same rate whatever their step counts."""
    names = list(counts)
    done = dict.fromkeys(names, 0)
    order = []
    for _ in range(sum(counts.values())):
        left = [n for n in names if done[n] < counts[n]]
        pick = min(left, key=lambda n: ((done[n] + 0.5) / counts[n],
                                        (names.index(n) - done[n]) % len(names)))
        order.append((pick, done[pick]))
        done[pick] += 1
    return order


# ------------------------------------------------------------------------------------ workers
def model_config(args) -> dict:
    return dict(vocab=args.vocab, d_model=args.d_model, heads=args.heads,
                ffn_mult=args.ffn_mult, n_layers=args.layers)


def rank_device(args, rank: int) -> str:
    if args.device == "cpu":
        return "cpu"
    import torch
    return f"cuda:{rank}" if torch.cuda.device_count() >= args.ranks else "cuda:0"


def start_rank(rank: int, args, port: int):
    """A rank's torch threads, device and gloo group, and the model with the same initial
    weights on every rank (the seed). Returns (device, model)."""
    import torch
    import torch.distributed as dist
    from streamload.commands.calibrate import TinyTransformer

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    device = rank_device(args, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks, timeout=timedelta(seconds=300))
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return device, TinyTransformer(**model_config(args)).to(device=device, dtype=dtype)


def to_parent(value, rank: int, args, result_queue) -> None:
    """Every rank's `value`, gathered, to the parent process (through rank 0)."""
    import torch.distributed as dist
    gathered = [None] * args.ranks
    dist.all_gather_object(gathered, value)
    if rank == 0:
        result_queue.put(gathered)


def worker(rank: int, args, port: int, plans, order, result_queue) -> None:
    import torch
    import torch.distributed as dist
    from streamload.commands.calibrate import synchronize

    device, model = start_rank(rank, args, port)
    try:
        params = [p for p in model.parameters()]
        gen = torch.Generator().manual_seed(1000 + rank)

        def run_step(rows):
            for p in params:
                p.grad = None
            dist.barrier()
            synchronize(device)
            t0, c0 = time.perf_counter(), time.thread_time()
            tokens = 0
            for row in rows:
                if not row:
                    continue
                model.step(model.make_input(row, gen), row)
                tokens += sum(row)
            synchronize(device)
            t1, c1 = time.perf_counter(), time.thread_time()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1).float() for g in grads]).cpu()  # gloo: reduce on CPU
            dist.all_reduce(flat)
            flat /= args.ranks
            offset = 0
            for p, g in zip(params, grads):
                n = g.numel()
                p.grad = flat[offset:offset + n].view_as(g).to(device=device, dtype=g.dtype)
                offset += n
            synchronize(device)
            t2 = time.perf_counter()
            return t1 - t0, t2 - t0, tokens, c1 - c0

        # Warm up the kernels on rows of mixed lengths before anything is timed.
        warm = [args.capacity // 2, args.capacity // 4, args.capacity // 8, args.capacity // 8]
        for _ in range(2):
            run_step([warm])
        for name in plans:
            for step in range(min(args.warmup, len(plans[name]))):
                run_step(plans[name][step][rank])

        # records[name][pass][step] = (compute_s, step_s, tokens, cpu_s)
        records = {name: [[None] * len(plans[name]) for _ in range(args.repeats)] for name in plans}
        for rep in range(args.repeats):
            for name, step in (order if rep % 2 == 0 else order[::-1]):
                records[name][rep][step] = run_step(plans[name][step][rank])
        to_parent(records, rank, args, result_queue)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------ main
def mp_context():
    import torch.multiprocessing as mp
    return mp.get_context("spawn")


def calibrate_worker(rank: int, args, port: int, rows, result_queue) -> None:
    """Time the calibration rows on this rank (all ranks at once); rank 0 gets every rank's
    times, [rank][row]: the minimum over --calib-repeats passes, CPU time on the CPU with one
    thread, else wall time."""
    import torch
    import torch.distributed as dist
    from streamload.commands.calibrate import time_rows

    device, model = start_rank(rank, args, port)
    try:
        dist.barrier()
        times = time_rows(model, rows, warmup=1, repeats=args.calib_repeats,
                          seed=args.seed + rank, stat=args.calib_stat,
                          clock="cpu" if device == "cpu" and args.threads == 1 else "wall")
        to_parent(times, rank, args, result_queue)
    finally:
        dist.destroy_process_group()


def get_cost_model(args) -> tuple[CostModel, dict]:
    import torch
    from streamload.commands.calibrate import TinyTransformer, calibration_rows, fit_rows
    torch.manual_seed(args.seed)
    model = TinyTransformer(**model_config(args))
    flops = model.cost_model()
    if args.cost == "transformer":
        return flops, {"source": "transformer", "units": "FLOPs", "a": flops.a, "b": flops.b,
                       "crossover_length": flops.crossover_length}
    if args.cost != "calibrate":
        cost = CostModel.load(args.cost)
        return cost, {"source": args.cost, "units": "file", "a": cost.a, "b": cost.b,
                      "crossover_length": cost.crossover_length}
    # Calibrate this very model, in the ranks themselves: every rank times the calibration
    # rows at the same time, on its device and with its thread count, as it will run the
    # steps, so the calibration shares the machine as the run does (one process calibrating
    # alone, then two ranks running, is another load). A row's time is the mean over the ranks.
    C = args.capacity
    rows = calibration_rows([C, C // 2, C // 4], min_doc=64, distinct=True)
    t0 = time.perf_counter()
    queue = mp_context().SimpleQueue()
    import torch.multiprocessing as mp
    mp.spawn(calibrate_worker, args=(args, free_port(), rows, queue), nprocs=args.ranks, join=True)
    per_rank = np.array(queue.get(), dtype=np.float64)        # [rank, row]
    times = per_rank.mean(axis=0)
    fit = fit_rows(rows, times)
    cost = fit.cost_model()
    return cost, {"source": "calibrate", "units": "s", "distinct_lengths": True,
                  "in_ranks": args.ranks,
                  "a": fit.a, "b": fit.b, "c": fit.c, "r2": fit.r2,
                  "max_rel_residual": fit.max_rel_residual,
                  "crossover_length": cost.crossover_length,
                  "flops_crossover_length": flops.crossover_length,
                  "calibrate_s": time.perf_counter() - t0}


def predict_compute(plan, geometry: Geometry, cost: CostModel, row_constant: float) -> np.ndarray:
    """[step, rank]: the cost model's compute for each rank's rows, the sum over its non-empty
    rows of the row cost (document masking: the sum over the row's documents) plus the
    calibration's per-row constant. In seconds when the model was calibrated here."""
    M = geometry.micro_batches
    out = np.zeros((len(plan["rows"]), geometry.ranks))
    for i, step in enumerate(plan["rows"]):
        for r, rows in enumerate(step):
            lengths = [L for row in rows for L in row]
            where = [m for m, row in enumerate(rows) for _ in row]
            out[i, r] = float(cost.row_costs(lengths, where, M).sum()) \
                + row_constant * sum(1 for row in rows if row)
    return out


def error_summary(rel: np.ndarray) -> dict:
    """{median, p90, max} of |rel| and the share within 10%."""
    e = np.abs(np.asarray(rel, dtype=np.float64)).reshape(-1)
    if e.size == 0:
        return {"median": None, "p90": None, "max": None, "share_within_10pct": None}
    return {"median": float(np.median(e)), "p90": float(np.percentile(e, 90)),
            "max": float(e.max()), "share_within_10pct": float(np.mean(e <= 0.10))}


def prediction_errors(results: dict, seconds: bool) -> dict:
    """The prediction against the measured per-(step, rank) compute, over every planner.

    raw: predicted / measured - 1, when the prediction is in seconds (a calibration here);
    scaled: the same after one global factor (the median of measured / predicted over all
    (step, rank)), which removes the units (FLOPs) and a uniform drift of the machine's speed
    between the calibration and the run, and leaves what the planner can get wrong: how the
    cost spreads over ranks and steps, all the planner uses (it compares costs, never seconds).
    within_10pct: the p90 of scaled is at most 10%; within_10pct_seconds: the same of raw."""
    pred = np.concatenate([np.ravel(r["predicted_compute"]) for r in results.values()])
    meas = np.concatenate([np.ravel(r["measured_compute"]) for r in results.values()])
    ok = (pred > 0) & (meas > 0)
    pred, meas = pred[ok], meas[ok]
    scale = float(np.median(meas / pred)) if pred.size else 1.0
    out = {"raw": error_summary(pred / meas - 1) if seconds else None,
           "bias": float(np.median(pred / meas - 1)) if seconds and pred.size else None,
           "scale": scale, "scaled": error_summary(pred * scale / meas - 1)}
    out["within_10pct"] = out["scaled"]["p90"] is not None and out["scaled"]["p90"] <= 0.10
    out["within_10pct_seconds"] = out["raw"]["p90"] <= 0.10 if seconds else None
    f = 1.0 if seconds else scale
    for name, r in results.items():
        for st in r["per_step"]:     # err in seconds (after the scale when not in seconds)
            st["error"] = [float(p * f / m - 1) if m > 0 else None
                           for p, m in zip(st["predicted"], st["measured"])]
        p_, m_ = np.asarray(r["predicted_compute"]), np.asarray(r["measured_compute"])
        r["prediction_error"] = {"raw": error_summary(p_ / m_ - 1) if seconds else None,
                                 "scaled": error_summary(p_ * scale / m_ - 1)}
    return out


def summarize(name, gathered, plan, geometry: Geometry, repeats: int,
              predicted: np.ndarray, gpu: bool) -> dict:
    R = geometry.ranks
    steps = len(plan["rows"])
    # [pass, step, rank] arrays
    rec = np.array([[[gathered[r][name][p][i] for r in range(R)] for i in range(steps)]
                    for p in range(repeats)], dtype=np.float64)
    compute, total, tokens, cpu = rec[..., 0], rec[..., 1], rec[..., 2], rec[..., 3]
    planned = np.array([[sum(map(sum, rows)) for rows in step] for step in plan["rows"]])
    if not all(np.array_equal(planned, tokens[p].astype(np.int64)) for p in range(repeats)):
        raise AssertionError(f"{name}: the ranks ran other tokens than planned")
    step_s = total.max(axis=2)                            # the step ends when the slowest rank does
    totals = step_s.sum(axis=1)                           # per pass
    total_s = float(np.median(totals))
    n_tokens = int(planned.sum())
    imb = compute.max(axis=2) / np.maximum(compute.mean(axis=2), 1e-12)
    imb_cpu = cpu.max(axis=2) / np.maximum(cpu.mean(axis=2), 1e-12)
    pred = np.array(plan["rank_cost"])
    pred_imb = pred.max(axis=1) / np.maximum(pred.mean(axis=1), 1e-300)
    step_tokens = planned.sum(axis=1)
    ages = [a for step in plan["age"] for a in step]
    # The measured per-(step, rank) compute the prediction is judged against: CPU time on the
    # CPU (what the work cost, without time lost to other load), wall time on CUDA; the median
    # over the passes.
    measured = np.median(compute if gpu else cpu, axis=0)
    return {
        "steps": steps,
        "ideal_steps": math.ceil(n_tokens / geometry.step_tokens),
        "tokens": n_tokens,
        "fill": n_tokens / (steps * geometry.step_tokens),
        "total_s": total_s,
        "total_s_passes": [float(x) for x in totals],
        "tokens_per_s": n_tokens / total_s,
        "compute_total_s": float(np.median(compute.max(axis=2).sum(axis=1))),
        # CPU time of each rank's compute (its one thread): what the work cost, without the
        # time the rank spent descheduled by other load on the machine. CPU device only.
        "cpu_total_s": float(np.median(cpu.max(axis=2).sum(axis=1))),
        "predicted_cost": float((pred.max(axis=1) + plan["overhead"]).sum()),
        "step_s_median": float(np.median(step_s)),
        "imbalance_measured": float(imb.mean()),
        "imbalance_measured_cpu": float(imb_cpu.mean()),
        "imbalance_predicted": float(pred_imb.mean()),
        "tokens_per_step": {k: float(np.percentile(step_tokens, q))
                            for k, q in (("p1", 1), ("p50", 50), ("p99", 99))},
        "plan_ms_median": float(np.median(plan["plan_ms"])),
        "exchanged_fraction": float(np.mean(plan["exchanged"])),
        "deferral_mean": float(np.mean(ages)) if ages else 0.0,
        "deferral_max": int(max(ages)) if ages else 0,
        "predicted_compute": predicted.tolist(),
        "measured_compute": measured.tolist(),
        "predicted_compute_total": float(predicted.max(axis=1).sum()),
        "per_step": [{"tokens": int(t), "step_s": float(s), "compute_s": [float(x) for x in cs],
                      "cpu_s": [float(x) for x in us], "imbalance_predicted": float(p),
                      "predicted": [float(x) for x in pr], "measured": [float(x) for x in me]}
                     for t, s, cs, us, p, pr, me in zip(step_tokens, step_s[0], compute[0], cpu[0],
                                                        pred_imb, predicted, measured)],
    }


def print_prediction(results: dict, prediction: dict, cost_info: dict, gpu: bool, err) -> None:
    """The cost model's prediction against the measured compute, per planner, step and rank."""
    seconds = prediction["raw"] is not None
    clock = "wall time" if gpu else "CPU time"
    f = 1.0 if seconds else prediction["scale"]      # model units -> seconds
    print(f"prediction per step and rank: the cost model's compute ({cost_info['source']}"
          + (", seconds" if seconds else f", {cost_info.get('units')} x the global scale "
             f"{prediction['scale']:.3g} s") + f") against the measured compute ({clock}, "
          f"ms); err = predicted / measured - 1", file=err)
    R = len(next(iter(results.values()))["measured_compute"][0])
    head = f"{'planner':<10}{'step':>5}{'tokens':>8}" + "".join(
        f"{f'r{r} pred':>9}{f'r{r} meas':>9}{f'r{r} err':>8}" for r in range(R))
    print(head, file=err)
    for name, r in results.items():
        for i, st in enumerate(r["per_step"]):
            cells = "".join(f"{p * f * 1e3:>9.1f}{m * 1e3:>9.1f}{p * f / m - 1:>+8.1%}"
                            for p, m in zip(st["predicted"], st["measured"]))
            print(f"{name:<10}{i:>5d}{st['tokens']:>8d}{cells}", file=err)
    for label, key in (("seconds", "raw"), ("after the global scale", "scaled")):
        e = prediction[key]
        if e is None:
            continue
        print(f"prediction error ({label}) over every (step, rank): median {e['median']:.1%}, "
              f"p90 {e['p90']:.1%}, max {e['max']:.1%}, {e['share_within_10pct']:.0%} within 10%"
              + (f"; bias (median) {prediction['bias']:+.1%}" if key == "raw" else
                 f"; scale {prediction['scale']:.3g}"), file=err)
        for name, r in results.items():
            pe = r["prediction_error"][key]
            print(f"  {name:<10} median {pe['median']:.1%}  p90 {pe['p90']:.1%}  "
                  f"max {pe['max']:.1%}", file=err)
    print(f"prediction within 10% (p90 after the global scale): "
          f"{'yes' if prediction['within_10pct'] else 'NO'}"
          + (f"; in seconds: {'yes' if prediction['within_10pct_seconds'] else 'NO'} (a "
             "uniform bias is the machine's speed drifting between the calibration and the "
             "run, e.g. other load)" if seconds else ""), file=err)
    spd = "  ".join(f"{n} {r['predicted_compute_speedup_vs_naive']:.3f}"
                    + (f" (measured {r['cpu_speedup_vs_naive']:.3f})"
                       if r.get("cpu_speedup_vs_naive") else "") for n, r in results.items())
    print(f"compute speedup vs naive, predicted (measured in {clock}): {spd}", file=err)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=None, help="M rows per rank (default 4, quick 2)")
    p.add_argument("--capacity", type=int, default=None,
                   help="C tokens per row (default 4096, quick 2048; CUDA 16384, quick 8192)")
    p.add_argument("--tokens", type=float, default=None,
                   help="tokens in the finite sample stream every planner delivers (default "
                        "600k, quick 100k; CUDA 4M, quick 1M); a little less is delivered, as "
                        "every (rank, source) buffer stops before the document that would cross "
                        "its share")
    p.add_argument("--planners", default=",".join(METHODS),
                   help=f"comma list from {','.join(METHODS)}; naive is always run (the baseline)")
    p.add_argument("--fill", type=float, default=1.0,
                   help="step tokens the targets ask for, as a fraction of R*M*C (default 1.0)")
    p.add_argument("--max-age", type=int, default=4,
                   help="planner max_age: a sample offered this many steps is taken first (default 4)")
    p.add_argument("--lookahead", type=int, default=4, help="W for the lookahead planner (default 4)")
    p.add_argument("--step-overhead", type=float, default=Planner.step_overhead,
                   help="planner step_overhead: per-step cost as a fraction of a rank's full "
                        f"linear step (default {Planner.step_overhead})")
    p.add_argument("--repeats", type=int, default=1,
                   help="interleaved passes over every planner's steps; totals are medians (default 1)")
    p.add_argument("--warmup", type=int, default=1,
                   help="each planner's first N steps run once untimed before the pass (default 1)")
    p.add_argument("--d-model", type=int, default=None, help="default 128 (CPU), 1024 (CUDA)")
    p.add_argument("--heads", type=int, default=None, help="default 2 (CPU), 8 (CUDA)")
    p.add_argument("--ffn-mult", type=int, default=4)
    p.add_argument("--layers", type=int, default=None, help="default 2 (CPU), 4 (CUDA)")
    p.add_argument("--vocab", type=int, default=None, help="default 512 (CPU), 4096 (CUDA)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--cost", default=None,
                   help="calibrate (default), transformer (quick default), or a calibrate --output JSON file")
    p.add_argument("--calib-repeats", type=int, default=3,
                   help="timed passes per calibration row (default 3)")
    p.add_argument("--calib-stat", choices=["median", "min"], default="median",
                   help="a calibration row's time over its passes (default median: like one "
                        "measured step; the minimum of a few passes sits below a typical one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smaller rows and stream (~20 s on 2 CPU cores)")
    args = p.parse_args(argv)
    q, gpu = args.quick, args.device == "cuda"
    args.d_model = args.d_model or (1024 if gpu else 128)
    args.heads = args.heads or (8 if gpu else 2)
    args.layers = args.layers or (4 if gpu else 2)
    args.vocab = args.vocab or (4096 if gpu else 512)
    args.micro_batches = args.micro_batches or (2 if q else 4)
    args.capacity = args.capacity or ((8192 if q else 16384) if gpu else (2048 if q else 4096))
    args.tokens = int(args.tokens or ((1_000_000 if q else 4_000_000) if gpu
                                      else (100_000 if q else 600_000)))
    args.cost = args.cost or ("transformer" if q else "calibrate")
    planners = ["naive"] + [n for n in args.planners.split(",") if n and n != "naive"]
    unknown = [n for n in planners if n not in METHODS]
    if unknown or args.repeats < 1 or args.warmup < 0 or args.tokens <= 0:
        print(f"train_step: bad arguments (unknown planners {unknown}, repeats >= 1, warmup >= 0, "
              "tokens > 0)", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("--device cuda: CUDA is not available", file=sys.stderr)
            return 2
        if torch.cuda.device_count() < args.ranks:
            print(f"note: {torch.cuda.device_count()} GPU(s) for {args.ranks} ranks: every rank "
                  "uses cuda:0, so the ranks share one GPU, their kernels time-slice it and the "
                  "per-rank compute times overlap; the comparison says little", file=sys.stderr)

    import torch.multiprocessing as mp

    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    geometry = Geometry(ranks=args.ranks, micro_batches=args.micro_batches, capacity=args.capacity)
    cost, cost_info = get_cost_model(args)
    plans, skipped = {}, {}
    for name in planners:
        try:
            plans[name] = build_plans(args, geometry, cost, name)
        except Exception as e:     # e.g. ConfigError, or a planner that cannot plan this stream
            if name == "naive":
                print(f"train_step: cannot plan the baseline: {e!r}", file=sys.stderr)
                return 2
            skipped[name] = f"{type(e).__name__}: {e}"
            print(f"note: {name} skipped, it could not plan this stream: {skipped[name]}",
                  file=sys.stderr)
    totals = {plans[n]["total_tokens"] for n in plans}
    if len(totals) != 1:
        raise AssertionError(f"the planners' streams hold different tokens: {totals}")
    rows = {name: plans[name]["rows"] for name in plans}
    order = interleave({name: len(rows[name]) for name in rows})

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    mp.spawn(worker, args=(args, port, rows, order, queue), nprocs=args.ranks, join=True)
    gathered = queue.get()

    seconds = cost_info.get("units") == "s"
    row_constant = cost_info.get("c", 0.0) if seconds else 0.0
    results = {name: summarize(name, gathered, plans[name], geometry, args.repeats,
                               predict_compute(plans[name], geometry, cost, row_constant), gpu)
               for name in plans}
    prediction = prediction_errors(results, seconds)
    base = results["naive"]
    for r in results.values():
        # The model's own figure for what cpu_speedup_vs_naive measures (the slowest rank's
        # compute summed over the steps; no step overhead).
        r["predicted_compute_speedup_vs_naive"] = \
            base["predicted_compute_total"] / r["predicted_compute_total"]
        r["speedup_vs_naive"] = base["total_s"] / r["total_s"]
        r["cpu_speedup_vs_naive"] = base["cpu_total_s"] / r["cpu_total_s"] if not gpu else None
        r["predicted_speedup_vs_naive"] = base["predicted_cost"] / r["predicted_cost"]
        r["per_step_speedup_vs_naive"] = base["step_s_median"] / r["step_s_median"]

    err = sys.stderr
    tokens = base["tokens"]
    print(f"train_step: {args.ranks} gloo ranks on {args.device} ({args.threads} thread(s) each), "
          f"M={args.micro_batches} rows x C={args.capacity} tokens, model d_model={args.d_model} "
          f"layers={args.layers} heads={args.heads}; every planner delivers the same {tokens:,} "
          f"tokens (ideal {base['ideal_steps']} steps), {args.repeats} interleaved pass(es), "
          f"step_overhead {args.step_overhead}", file=err)
    print(f"cost model: {cost_info['source']}: a={cost.a:.4g} b={cost.b:.4g} "
          f"(attention = linear at L={cost.crossover_length:.0f})"
          + (f", fit R^2={cost_info['r2']:.4f}, max |rel. residual| "
             f"{cost_info['max_rel_residual']:.1%} in {cost_info['calibrate_s']:.1f} s"
             if "r2" in cost_info else ""), file=err)
    header = (f"{'planner':<10}{'steps':>6}{'ideal':>6}{'fill':>7}{'total s':>9}{'tokens/s':>10}"
              f"{'speedup':>8}{'cpu s':>8}{'cpu spd':>8}{'pred spd':>9}{'step s med':>11}"
              f"{'step spd':>9}{'imb meas':>9}{'imb cpu':>8}{'imb pred':>9}{'plan ms':>8}"
              f"{'exch':>6}{'def max':>8}")
    print(header, file=err)
    for name, r in results.items():
        cpu_spd = f"{r['cpu_speedup_vs_naive']:>8.3f}" if r["cpu_speedup_vs_naive"] else f"{'-':>8}"
        print(f"{name:<10}{r['steps']:>6d}{r['ideal_steps']:>6d}{r['fill']:>7.3f}"
              f"{r['total_s']:>9.2f}{r['tokens_per_s']:>10.0f}{r['speedup_vs_naive']:>8.3f}"
              f"{r['cpu_total_s']:>8.2f}{cpu_spd}{r['predicted_speedup_vs_naive']:>9.3f}"
              f"{r['step_s_median']:>11.3f}{r['per_step_speedup_vs_naive']:>9.3f}"
              f"{r['imbalance_measured']:>9.3f}{r['imbalance_measured_cpu']:>8.3f}"
              f"{r['imbalance_predicted']:>9.3f}{r['plan_ms_median']:>8.2f}"
              f"{r['exchanged_fraction']:>6.2f}{r['deferral_max']:>8d}", file=err)
    print("speedup = naive total s / this total s for the same tokens (> 1: faster); cpu spd the "
          "same in CPU time of the slowest rank's compute; pred spd the cost model's (with the "
          "step overhead); step spd = naive median step s / this one (the per-step figure)",
          file=err)
    print_prediction(results, prediction, cost_info, gpu, err)
    for name, r in results.items():
        # A planner that takes other step counts than naive can win per step and lose on the
        # same tokens (or the reverse); with equal step counts the two differ by noise only.
        if name != "naive" and r["steps"] != base["steps"] and \
                (r["per_step_speedup_vs_naive"] > 1) != (r["speedup_vs_naive"] > 1):
            print(f"note: {name} is {'faster' if r['per_step_speedup_vs_naive'] > 1 else 'slower'} "
                  f"per step ({r['per_step_speedup_vs_naive']:.3f}x) but "
                  f"{'faster' if r['speedup_vs_naive'] > 1 else 'slower'} for the same tokens "
                  f"({r['speedup_vs_naive']:.3f}x, {r['steps']} steps against naive's "
                  f"{base['steps']})", file=err)
    load_after = os.getloadavg()[0]
    if args.device == "cpu" and max(load_before, load_after) > (os.cpu_count() or 1) + 0.5:
        print(f"note: the 1-minute load average was {load_before:.1f} -> {load_after:.1f} on "
              f"{os.cpu_count()} CPUs: other work shared the cores, so wall-clock timings are "
              "noisy; the CPU-time columns are not", file=err)

    out = {
        "device": args.device, "ranks": args.ranks, "micro_batches": args.micro_batches,
        "capacity": args.capacity, "threads_per_rank": args.threads,
        "tokens_requested": args.tokens, "tokens": tokens, "ideal_steps": base["ideal_steps"],
        "repeats": args.repeats, "warmup": args.warmup, "model": model_config(args),
        "cost_model": cost_info, "fill": args.fill, "max_age": args.max_age,
        "lookahead": args.lookahead, "step_overhead": args.step_overhead,
        "planners": list(results), "skipped": skipped,
        "speedup_vs_naive": {n: r["speedup_vs_naive"] for n, r in results.items()},
        "cpu_speedup_vs_naive": {n: r["cpu_speedup_vs_naive"] for n, r in results.items()},
        "predicted_speedup_vs_naive": {n: r["predicted_speedup_vs_naive"]
                                       for n, r in results.items()},
        "per_step_speedup_vs_naive": {n: r["per_step_speedup_vs_naive"]
                                      for n, r in results.items()},
        "predicted_compute_speedup_vs_naive": {n: r["predicted_compute_speedup_vs_naive"]
                                               for n, r in results.items()},
        "prediction_error": prediction,
        "results": results, "wall_s": time.perf_counter() - t_start,
        # Other work on the machine slows the ranks unevenly; a 1-minute load average well
        # above the ranks' thread count means the timings are noisy.
        "loadavg_1m": [load_before, load_after], "cpu_count": os.cpu_count(),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
