
"""Planner benchmark: per-step imbalance and planning time of naive, balanced and lookahead.

The planner alone, no processes: a simulated coordinator keeps a FIFO window per (rank, source),
offers every window to the planner each step, pops what the plan takes, ages what it leaves
(so deferral is real) and tops the windows up from seeded length generators.

Distributions (lengths in tokens; a document longer than C is split into C-token pieces, as the
pipeline does upstream):
  lognormal  C = 8192. Four sources with different medians: web (45%, median 600, sigma 1.0),
             code (25%, 1200, 1.3), books (15%, 6000, 1.0), chat (15%, 300, 0.8).
  outlier    C = 32768. The same four sources, except that 2% of every source's documents are
             replaced by documents near the 32k context: uniform in [30720, 32768].
Cost model: CostModel() unless --cost-a/--cost-b (a = 1/4096, b = 1: attention costs as much as
the linear layers at 4096 tokens), document masking.

Metrics per (dist, ranks, micro_batches, method), over the measured steps:
  imbalance          max per-rank cost / mean per-rank cost, per step (mean and p99)
  bound_single       max(total / R, largest single item cost) / mean, per step (mean)
  planner_ms         wall time of Planner.plan, pinned to one core (median and p99); also
                     planner_cpu_ms (the thread's CPU time), which is what a dedicated core
                     would see when other processes share the machine
  deferral_max/mean  age (steps offered and not taken) of the items when taken
  exchanged_fraction taken tokens whose destination rank is not the rank that holds them
  fill               taken tokens / (R * M * C): what a plan leaves for later steps shows here
  efficiency         sum over steps of the mean rank cost / sum of the largest rank cost: the
                     share of the ranks' time spent on work rather than waiting, over the run
                     (what a plan leaves out is done, and counted, in a later step). The table
                     shows it relative to naive as `speedup`: the predicted throughput gain
  steps              measured steps (after `warmup` unmeasured ones). 100 for R <= 64; 20 for
                     R >= 512, and for naive there 20 * 512 / R (its plan takes seconds)

Window depth (what the coordinator keeps per rank and source, in steps' worth of tokens): 2 for
naive and balanced, W for lookahead. max_age: none for naive, 3 for balanced, W for lookahead
(W = 4).

Usage: python benchmarks/balance.py [--quick] [--steps N] [--ranks 8,64] [--dists lognormal]
The human table goes to stderr; the last line of stdout is {"results": [...]}.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from streamload.plan.balance import exchanged_tokens  # noqa: E402
from streamload.plan.cost import CostModel  # noqa: E402
from streamload.plan.planner import Planner  # noqa: E402
from streamload.plan.types import Geometry  # noqa: E402
from _windows import BODY, FifoWindows, SourceSpec, split_at_capacity  # noqa: E402

DISTS = {
    # name: (capacity C, outlier fraction, outlier length range)
    "lognormal": (8192, 0.0, None),
    "outlier": (32768, 0.02, (30720, 32768)),
}
GEOMETRIES = ((8, 4), (8, 8), (64, 4), (64, 8), (512, 8), (4096, 8))
METHODS = ("naive", "balanced", "lookahead")
WINDOW = 4



class LengthStream:
    """Deterministic stream of document lengths for one source (split at C)."""

    def __init__(self, spec: SourceSpec, capacity: int, outlier_fraction: float, outlier_range,
                 seed: int, index: int):
        self.spec, self.capacity = spec, capacity
        self.outlier_fraction, self.outlier_range = outlier_fraction, outlier_range
        self.rng = np.random.default_rng([seed, index])
        self.pending = np.zeros(0, dtype=np.int64)

    def _draw(self, n: int) -> np.ndarray:
        docs = np.maximum(np.rint(self.rng.lognormal(np.log(self.spec.median), self.spec.sigma, n)),
                          8).astype(np.int64)
        if self.outlier_fraction:
            lo, hi = self.outlier_range
            out = self.rng.random(n) < self.outlier_fraction
            docs[out] = self.rng.integers(lo, hi + 1, int(out.sum()))
        return split_at_capacity(docs, self.capacity)

    def take(self, tokens: float) -> np.ndarray:
        """Lengths of the next documents, at least `tokens` tokens of them (one item over)."""
        while self.pending.sum() < tokens:
            self.pending = np.concatenate([self.pending, self._draw(4096)])
        n = int(np.searchsorted(np.cumsum(self.pending), tokens, side="left")) + 1
        out, self.pending = self.pending[:n], self.pending[n:]
        return out


class Coordinator(FifoWindows):
    """The coordinator loop without processes (see _windows.py), for one length mix."""

    def __init__(self, dist: str, ranks: int, micro_batches: int, depth_steps: float, seed: int):
        capacity, outlier_fraction, outlier_range = DISTS[dist]
        geometry = Geometry(ranks, micro_batches, capacity)
        self.weights = np.array([s.weight for s in BODY])
        self.targets = self.weights * geometry.step_tokens
        streams = [LengthStream(s, capacity, outlier_fraction, outlier_range, seed, i)
                   for i, s in enumerate(BODY)]
        # tokens per (rank, source) window
        super().__init__(geometry, streams, depth_steps * self.targets / ranks)


def run_config(dist: str, ranks: int, micro_batches: int, method: str, steps: int, warmup: int,
               cost: CostModel, seed: int) -> dict:
    depth = WINDOW if method == "lookahead" else 2
    coord = Coordinator(dist, ranks, micro_batches, depth, seed)
    max_age = {"naive": None, "balanced": 3, "lookahead": None}[method]
    planner = Planner(coord.geometry, cost, method=method, seed=seed, max_age=max_age,
                      lookahead=WINDOW)
    imbalance, bound, times, cpu_times, fill = [], [], [], [], []
    ages = []
    moved = taken_tokens = 0
    step_cost = work = 0.0               # sums over steps of the largest and the mean rank cost
    for step in range(warmup + steps):
        c = coord.candidates()
        t0, c0 = time.perf_counter(), time.thread_time()
        a = planner.plan(c, coord.targets, step)
        elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if step >= warmup:
            mean = float(a.rank_cost.mean())
            largest = float(cost.doc_cost(c.length[a.take]).max()) if len(a) else 0.0
            imbalance.append(float(a.rank_cost.max()) / mean)
            bound.append(max(mean, largest) / mean)
            times.append(elapsed * 1e3)
            cpu_times.append(cpu * 1e3)
            ages.append(c.age[a.take])
            moved += exchanged_tokens(c, a)
            tokens = int(c.length[a.take].sum())
            taken_tokens += tokens
            step_cost += float(a.rank_cost.max())
            work += mean
            fill.append(tokens / coord.geometry.step_tokens)
        coord.commit(a.take)
    ages = np.concatenate(ages)
    return {
        "dist": dist, "ranks": ranks, "micro_batches": micro_batches, "method": method,
        "imbalance_mean": float(np.mean(imbalance)),
        "imbalance_p99": float(np.percentile(imbalance, 99)),
        "bound_single_mean": float(np.mean(bound)),
        "planner_ms_median": float(np.median(times)),
        "planner_ms_p99": float(np.percentile(times, 99)),
        "planner_cpu_ms_median": float(np.median(cpu_times)),
        "planner_cpu_ms_p99": float(np.percentile(cpu_times, 99)),
        "deferral_max": int(ages.max()) if ages.size else 0,
        "deferral_mean": float(ages.mean()) if ages.size else 0.0,
        "exchanged_fraction": moved / max(taken_tokens, 1),
        "fill": float(np.mean(fill)),
        "efficiency": work / max(step_cost, 1e-12),
        "capacity": coord.geometry.capacity, "steps": steps, "warmup": warmup,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100, help="measured steps per configuration")
    p.add_argument("--large-steps", type=int, default=20,
                   help="measured steps when R >= 512 (naive: scaled down by R / 512, at least "
                        "2, because the baseline takes seconds per step there)")
    p.add_argument("--warmup", type=int, default=WINDOW, help="unmeasured steps first")
    p.add_argument("--quick", action="store_true", help="10 steps, R <= 64: a smoke test")
    p.add_argument("--ranks", type=str, default="", help="comma list, e.g. 8,64")
    p.add_argument("--dists", type=str, default=",".join(DISTS))
    p.add_argument("--methods", type=str, default=",".join(METHODS))
    p.add_argument("--cost-a", type=float, default=CostModel().a)
    p.add_argument("--cost-b", type=float, default=CostModel().b)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", type=int, default=None, help="core to pin to (default: the last)")
    args = p.parse_args(argv)

    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {args.cpu if args.cpu is not None else cpus[-1]})
    cost = CostModel(args.cost_a, args.cost_b)
    geometries = GEOMETRIES
    if args.ranks:
        wanted = {int(r) for r in args.ranks.split(",")}
        geometries = tuple(g for g in geometries if g[0] in wanted)
    elif args.quick:
        geometries = tuple(g for g in geometries if g[0] <= 64)
    results = []
    header = (f"{'dist':<10}{'R':>5}{'M':>3} {'method':<10}{'imb_mean':>9}{'imb_p99':>9}"
              f"{'bound':>8}{'ms_med':>9}{'ms_p99':>9}{'cpu_med':>9}{'def_max':>8}"
              f"{'def_mean':>9}{'exch':>7}{'fill':>7}{'speedup':>8}{'steps':>6}")
    print(header, file=sys.stderr)
    for dist in args.dists.split(","):
        for ranks, micro_batches in geometries:
            for method in args.methods.split(","):
                steps, warmup = (10 if args.quick else args.steps), args.warmup
                if ranks >= 512 and not args.quick:
                    steps = args.large_steps
                    if method == "naive":
                        steps = max(2, steps * 512 // ranks)
                        warmup = min(warmup, max(1, steps // 2))
                r = run_config(dist, ranks, micro_batches, method, steps, warmup, cost,
                               args.seed)
                results.append(r)
                base = [x for x in results if x["method"] == "naive" and x["dist"] == dist
                        and x["ranks"] == ranks and x["micro_batches"] == micro_batches]
                speedup = r["efficiency"] / base[0]["efficiency"] if base else float("nan")
                print(f"{dist:<10}{ranks:>5}{micro_batches:>3} {method:<10}"
                      f"{r['imbalance_mean']:>9.4f}{r['imbalance_p99']:>9.4f}"
                      f"{r['bound_single_mean']:>8.4f}{r['planner_ms_median']:>9.2f}"
                      f"{r['planner_ms_p99']:>9.2f}{r['planner_cpu_ms_median']:>9.2f}"
                      f"{r['deferral_max']:>8d}{r['deferral_mean']:>9.2f}"
                      f"{r['exchanged_fraction']:>7.3f}{r['fill']:>7.3f}{speedup:>8.3f}"
                      f"{steps:>6d}",
                      file=sys.stderr, flush=True)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
