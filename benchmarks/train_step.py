"""Measured training steps, naive vs cost-balanced plans, on 2 gloo ranks.

This benchmark measures; it does not predict. Two processes (gloo, 127.0.0.1 only) each run
forward plus backward of a small transformer (real SDPA attention with document masking, see
`streamload.calibrate.doc_attention`) over their own M packed micro-batches, then all-reduce the
gradients as one flat buffer, as data-parallel training does. Both methods plan from the same
sample stream: every (rank, source) buffer is a FIFO fed by its own seeded generator, each step
offers the head windows, and what a plan leaves stays at the head with age + 1, as in the loader
(`--max-age` bounds the wait). The project's planner makes the plans, with method "naive"
(token-balanced, the baseline) and method "balanced" (cost-balanced). The two methods' steps
alternate (and which one goes first alternates too), so drifts in machine load hit both.

Per step and rank it records
    compute_s  forward+backward over the rank's rows (from a barrier to the end of backward)
    step_s     compute plus the gradient all-reduce, which waits for the slowest rank
and reports per method the median step time, each rank's median compute time, the measured
imbalance (max/mean of the ranks' compute, averaged over steps), the cost model's predicted
imbalance for the same plans, and the speedup naive/balanced.

Rows are not padded: a row of n tokens is a [n]-token tensor, like varlen packing.

On the CPU it also records each rank's compute in CPU time (`time.thread_time`; a rank runs one
torch thread): what the work cost, without the time a rank sat descheduled because other work
shared the cores. Wall-clock step time is the real measure; the CPU-time figures say how much of
a difference comes from the plans rather than from load on the machine.

The cost model that the planner uses is, by default (`--cost calibrate`), fitted before the run
on this same model, on this device and with the ranks' thread count, by `streamload.calibrate`
(rows of C, C/2 and C/4 tokens with different document mixes; CPU time on the CPU).
`--cost transformer` uses `CostModel.transformer()` of the model's dimensions (FLOPs) instead,
and `--cost FILE` loads a `streamload calibrate --output FILE` result.

On CUDA each rank uses cuda:<rank> when there are enough GPUs. With one GPU both ranks share
cuda:0: their kernels then time-slice one device, so per-rank compute times overlap and the
comparison says little; the run prints a note. The gradients are all-reduced on the CPU (gloo).

    python benchmarks/train_step.py            # ~1-2 min on 2 CPU cores
    python benchmarks/train_step.py --quick    # ~15 s
    python benchmarks/train_step.py --device cuda

The last line of output is one JSON object with naive_step_s, balanced_step_s and speedup.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from streamload.plan.cost import CostModel  # noqa: E402
from streamload.plan.planner import Planner  # noqa: E402
from streamload.plan.types import Candidates, Geometry  # noqa: E402

# ------------------------------------------------------------------------------------ data
SOURCES = (
    # name, weight, lognormal median, sigma, fraction of near-capacity documents
    ("web", 0.55, 250, 1.0, 0.0),
    ("code", 0.30, 600, 1.1, 0.0),
    ("books", 0.15, 1500, 0.6, 0.25),
)


def sample_lengths(rng: np.random.Generator, source: int, n: int, capacity: int) -> np.ndarray:
    _, _, median, sigma, long_frac = SOURCES[source]
    lengths = rng.lognormal(np.log(median), sigma, n)
    long_ = rng.random(n) < long_frac
    lengths[long_] = rng.uniform(0.6 * capacity, capacity, int(long_.sum()))
    return np.clip(np.rint(lengths), 16, capacity).astype(np.int64)


class SampleStream:
    """Every (rank, source) buffer as a FIFO fed by its own seeded generator, so every method
    sees the same sequence of samples. Each step offers the head window of each buffer (about
    1.5x the rank's share of the source's target); the samples a plan does not take stay at the
    head with age + 1 and are offered again, as in the loader."""

    def __init__(self, seed: int, geometry: Geometry, targets: np.ndarray):
        self.geometry, self.targets = geometry, targets
        R, S = geometry.ranks, len(SOURCES)
        self.gens = [[np.random.default_rng([seed, r, s]) for s in range(S)] for r in range(R)]
        self.lengths = [[np.zeros(0, np.int64) for _ in range(S)] for _ in range(R)]
        self.ages = [[np.zeros(0, np.int32) for _ in range(S)] for _ in range(R)]
        self.window = [[0] * S for _ in range(R)]

    def candidates(self) -> Candidates:
        R, C = self.geometry.ranks, self.geometry.capacity
        for r in range(R):
            for s in range(len(SOURCES)):
                need = 1.5 * self.targets[s] / R + C
                while self.lengths[r][s].sum() < need:
                    chunk = sample_lengths(self.gens[r][s], s, 64, C)
                    self.lengths[r][s] = np.concatenate([self.lengths[r][s], chunk])
                    self.ages[r][s] = np.concatenate([self.ages[r][s], np.zeros(64, np.int32)])
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


def build_plans(args, geometry: Geometry, cost: CostModel):
    """Plans for every step (warm-up included), for both methods, from the same sample stream."""
    weights = np.array([w for _, w, *_ in SOURCES])
    targets = weights / weights.sum() * geometry.step_tokens * args.fill
    planners = {name: Planner(geometry, cost, method=name, seed=args.seed, max_age=args.max_age)
                for name in ("naive", "balanced")}
    out = {name: {"rows": [], "rank_cost": [], "plan_ms": [], "exchanged": [], "age": []}
           for name in planners}
    for name, planner in planners.items():
        stream = SampleStream(args.seed, geometry, targets)
        for step in range(args.warmup + args.steps):
            c = stream.candidates()
            t0 = time.perf_counter()
            a = planner.plan(c, targets, step)
            out[name]["plan_ms"].append((time.perf_counter() - t0) * 1e3)
            out[name]["rows"].append(plan_rows(a, c, geometry))
            out[name]["rank_cost"].append(a.rank_cost.tolist())
            lengths = c.length[a.take]
            moved = lengths[c.rank[a.take] != a.rank].sum()
            out[name]["exchanged"].append(float(moved) / max(float(lengths.sum()), 1.0))
            out[name]["age"].append(c.age[a.take].tolist())
            stream.consume(c, a.take)
    return out


# ------------------------------------------------------------------------------------ workers
def model_config(args) -> dict:
    return dict(vocab=args.vocab, d_model=args.d_model, heads=args.heads,
                ffn_mult=args.ffn_mult, n_layers=args.layers)


def rank_device(args, rank: int) -> str:
    if args.device == "cpu":
        return "cpu"
    import torch
    return f"cuda:{rank}" if torch.cuda.device_count() >= args.ranks else "cuda:0"


def worker(rank: int, args, port: int, plans, result_queue) -> None:
    import torch
    import torch.distributed as dist
    from streamload.calibrate import TinyTransformer, synchronize

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    device = rank_device(args, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks, timeout=timedelta(seconds=300))
    try:
        torch.manual_seed(args.seed)             # same initial weights on every rank
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        model = TinyTransformer(**model_config(args)).to(device=device, dtype=dtype)
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

        # Warm up the kernels once on a row of mixed lengths before anything is timed.
        warm = [args.capacity // 2, args.capacity // 4, args.capacity // 8, args.capacity // 8]
        for _ in range(2):
            run_step([warm])

        records = {"naive": [], "balanced": []}
        for step in range(args.warmup + args.steps):
            order = ("naive", "balanced") if step % 2 == 0 else ("balanced", "naive")
            for name in order:
                record = run_step(plans[name][step][rank])
                if step >= args.warmup:
                    records[name].append(record)
        gathered = [None] * args.ranks
        dist.all_gather_object(gathered, records)
        if rank == 0:
            result_queue.put(gathered)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------ main
def get_cost_model(args) -> tuple[CostModel, dict]:
    import torch
    from streamload.calibrate import TinyTransformer, calibration_rows, fit_rows, time_rows
    torch.manual_seed(args.seed)
    model = TinyTransformer(**model_config(args))
    flops = model.cost_model()
    if args.cost == "transformer":
        return flops, {"source": "transformer", "a": flops.a, "b": flops.b,
                       "crossover_length": flops.crossover_length}
    if args.cost != "calibrate":
        cost = CostModel.load(args.cost)
        return cost, {"source": args.cost, "a": cost.a, "b": cost.b,
                      "crossover_length": cost.crossover_length}
    # Calibrate this very model, on rank 0's device, with the ranks' thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        device = rank_device(args, 0)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        model = model.to(device=device, dtype=dtype)
        C = args.capacity
        rows = calibration_rows([C, C // 2, C // 4], min_doc=64)
        t0 = time.perf_counter()
        times = time_rows(model, rows, warmup=1, repeats=args.calib_repeats, seed=args.seed,
                          stat="min", clock="cpu" if device == "cpu" and args.threads == 1 else "wall")
        fit = fit_rows(rows, times)
    finally:
        torch.set_num_threads(threads)
    cost = fit.cost_model()
    return cost, {"source": "calibrate", "a": fit.a, "b": fit.b, "c": fit.c, "r2": fit.r2,
                  "max_rel_residual": fit.max_rel_residual,
                  "crossover_length": cost.crossover_length,
                  "flops_crossover_length": flops.crossover_length,
                  "calibrate_s": time.perf_counter() - t0}


def summarize(name, gathered, plan, ranks):
    steps = len(gathered[0][name])
    compute = np.array([[gathered[r][name][i][0] for r in range(ranks)] for i in range(steps)])
    total = np.array([[gathered[r][name][i][1] for r in range(ranks)] for i in range(steps)])
    tokens = np.array([[gathered[r][name][i][2] for r in range(ranks)] for i in range(steps)])
    cpu = np.array([[gathered[r][name][i][3] for r in range(ranks)] for i in range(steps)])
    step_s = total.max(axis=1)                            # the step ends when the slowest rank does
    imb = compute.max(axis=1) / compute.mean(axis=1)
    pred = np.array(plan["rank_cost"][-steps:])
    pred_imb = pred.max(axis=1) / pred.mean(axis=1)
    planned = np.array([[sum(map(sum, rows)) for rows in step] for step in plan["rows"][-steps:]])
    if not np.array_equal(planned, tokens):
        raise AssertionError(f"{name}: the ranks ran other tokens than planned")
    ages = [a for step in plan["age"][-steps:] for a in step]
    return {
        "step_s": float(np.median(step_s)),
        "step_s_mean": float(step_s.mean()),
        "compute_s_per_rank": [float(x) for x in np.median(compute, axis=0)],
        "compute_s_max_mean": float(compute.max(axis=1).mean()),
        "imbalance_measured": float(imb.mean()),
        "imbalance_predicted": float(pred_imb.mean()),
        # CPU time of each rank's compute (its one thread): what the work cost, without the
        # time the rank spent descheduled by other load on the machine. CPU device only.
        "compute_cpu_s_per_rank": [float(x) for x in np.median(cpu, axis=0)],
        "compute_cpu_s_max_median": float(np.median(cpu.max(axis=1))),
        "imbalance_measured_cpu": float((cpu.max(axis=1) / cpu.mean(axis=1)).mean()),
        "tokens_per_rank": [float(x) for x in tokens.mean(axis=0)],
        "tokens_per_step": float(tokens.sum(axis=1).mean()),
        # median over steps of that step's tokens / step time: robust to a step that other
        # load on the machine stretched
        "tokens_per_s": float(np.median(tokens.sum(axis=1) / step_s)),
        "plan_ms_median": float(np.median(plan["plan_ms"])),
        "exchanged_fraction": float(np.mean(plan["exchanged"][-steps:])),
        "deferral_mean": float(np.mean(ages)) if ages else 0.0,
        "deferral_max": int(max(ages)) if ages else 0,
        "steps": steps,
        "per_step": [{"step_s": float(s), "compute_s": [float(c) for c in cs],
                      "imbalance_measured": float(i), "imbalance_predicted": float(p)}
                     for s, cs, i, p in zip(step_s, compute, imb, pred_imb)],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=None, help="M rows per rank (default 4, quick 2)")
    p.add_argument("--capacity", type=int, default=None,
                   help="C tokens per row (default 4096, quick 2048; CUDA 16384, quick 8192)")
    p.add_argument("--fill", type=float, default=0.9, help="step tokens asked for, as a fraction of R*M*C")
    p.add_argument("--max-age", type=int, default=4,
                   help="planner max_age: a sample offered this many steps is taken first (default 4)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per method (default 10, quick 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per method (default 1)")
    p.add_argument("--d-model", type=int, default=None, help="default 128 (CPU), 1024 (CUDA)")
    p.add_argument("--heads", type=int, default=None, help="default 2 (CPU), 8 (CUDA)")
    p.add_argument("--ffn-mult", type=int, default=4)
    p.add_argument("--layers", type=int, default=None, help="default 2 (CPU), 4 (CUDA)")
    p.add_argument("--vocab", type=int, default=None, help="default 512 (CPU), 4096 (CUDA)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--cost", default=None,
                   help="calibrate (default), transformer (quick default), or a calibrate --output JSON file")
    p.add_argument("--calib-repeats", type=int, default=2,
                   help="timed passes per calibration row; the minimum is kept (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smaller and fewer steps (~20 s on 2 CPU cores)")
    args = p.parse_args(argv)
    q, gpu = args.quick, args.device == "cuda"
    args.d_model = args.d_model or (1024 if gpu else 128)
    args.heads = args.heads or (8 if gpu else 2)
    args.layers = args.layers or (4 if gpu else 2)
    args.vocab = args.vocab or (4096 if gpu else 512)
    args.micro_batches = args.micro_batches or (2 if q else 4)
    args.capacity = args.capacity or ((8192 if q else 16384) if gpu else (2048 if q else 4096))
    args.steps = args.steps or (4 if q else 10)
    args.warmup = args.warmup if args.warmup is not None else 1
    args.cost = args.cost or ("transformer" if q else "calibrate")
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
    try:
        plans = build_plans(args, geometry, cost)
    except ValueError as e:      # ConfigError: e.g. a planner without the "balanced" method
        print(f"train_step: cannot plan: {e}", file=sys.stderr)
        return 2
    rows = {name: plans[name]["rows"] for name in plans}

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    mp.spawn(worker, args=(args, port, rows, queue), nprocs=args.ranks, join=True)
    gathered = queue.get()

    results = {name: summarize(name, gathered, plans[name], args.ranks)
               for name in ("naive", "balanced")}
    naive, bal = results["naive"], results["balanced"]
    speedup = naive["step_s"] / bal["step_s"]
    # Both methods draw from the same sample stream, but a plan may leave samples for a later
    # step, so the tokens per step can differ a little: compare throughput (tokens/s) too.
    throughput_speedup = bal["tokens_per_s"] / naive["tokens_per_s"]
    cpu_speedup = naive["compute_cpu_s_max_median"] / bal["compute_cpu_s_max_median"]

    print(f"train_step: {args.ranks} gloo ranks on {args.device} ({args.threads} thread(s) each), "
          f"M={args.micro_batches} rows x C={args.capacity} tokens, model d_model={args.d_model} "
          f"layers={args.layers} heads={args.heads}, {args.steps} timed steps per method")
    print(f"cost model: {cost_info['source']}: a={cost.a:.4g} b={cost.b:.4g} "
          f"(attention = linear at L={cost.crossover_length:.0f})"
          + (f", fit R^2={cost_info['r2']:.4f}, max |rel. residual| "
             f"{cost_info['max_rel_residual']:.1%} in {cost_info['calibrate_s']:.1f} s"
             if "r2" in cost_info else ""))
    header = (f"{'method':<10} {'step s (med)':>12} {'compute s per rank (med)':>26} "
              f"{'imbalance meas.':>16} {'imbalance pred.':>16} {'tokens/step':>12} {'plan ms':>8} "
              f"{'exchanged':>9} {'defer max':>9}")
    print(header)
    for name, r in results.items():
        per_rank = " ".join(f"{x:.3f}" for x in r["compute_s_per_rank"])
        print(f"{name:<10} {r['step_s']:>12.3f} {per_rank:>26} {r['imbalance_measured']:>16.3f} "
              f"{r['imbalance_predicted']:>16.3f} {r['tokens_per_step']:>12.0f} "
              f"{r['plan_ms_median']:>8.2f} {r['exchanged_fraction']:>9.1%} {r['deferral_max']:>9d}")
    if abs(bal["tokens_per_step"] / naive["tokens_per_step"] - 1) > 0.02:
        print(f"note: the methods ran {naive['tokens_per_step']:.0f} and {bal['tokens_per_step']:.0f} "
              "tokens per step (a plan may leave samples for a later step); compare throughput")
    load_after = os.getloadavg()[0]
    if args.device == "cpu" and max(load_before, load_after) > (os.cpu_count() or 1) + 0.5:
        print(f"note: the 1-minute load average was {load_before:.1f} -> {load_after:.1f} on "
              f"{os.cpu_count()} CPUs: other work shared the cores, so these timings are noisy")
    print(f"speedup naive/balanced (median step time): {speedup:.3f}x; "
          f"throughput (tokens/s) balanced/naive: {throughput_speedup:.3f}x")
    if args.device == "cpu":
        print(f"by CPU time (immune to other load): imbalance naive "
              f"{naive['imbalance_measured_cpu']:.3f}, balanced {bal['imbalance_measured_cpu']:.3f}; "
              f"slowest rank's compute naive/balanced {cpu_speedup:.3f}x")

    out = {
        "naive_step_s": naive["step_s"], "balanced_step_s": bal["step_s"], "speedup": speedup,
        "throughput_speedup": throughput_speedup,
        "compute_cpu_speedup": cpu_speedup if args.device == "cpu" else None,
        "device": args.device, "ranks": args.ranks, "micro_batches": args.micro_batches,
        "capacity": args.capacity, "threads_per_rank": args.threads, "steps": args.steps,
        "model": model_config(args), "cost_model": cost_info, "fill": args.fill, "max_age": args.max_age,
        "naive": naive, "balanced": bal, "wall_s": time.perf_counter() - t_start,
        # Other work on the machine slows the ranks unevenly; a 1-minute load average well
        # above the ranks' thread count means the timings are noisy.
        "loadavg_1m": [load_before, os.getloadavg()[0]], "cpu_count": os.cpu_count(),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
