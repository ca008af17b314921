
"""Planner benchmark: per-step imbalance and planning time of naive, balanced and lookahead,
and beside them what a whole finite epoch of the same items costs under each.

The planner alone, no processes: a simulated coordinator keeps a FIFO window per (rank, source),
offers every window to the planner each step, pops what the plan takes, ages what it leaves
(so deferral is real) and tops the windows up from seeded length generators.

Per-step figures alone can mislead: a plan can look balanced step by step by leaving slots
empty, and then the same data takes more steps. So every configuration runs twice:
  steady   the sources never run out (windows refilled from endless generators); `warmup`
           unmeasured steps, then `steps` measured ones: the per-step columns below
  epoch    every source holds a fixed, seeded list of items (the same for every method:
           its weight x E x R*M*C tokens, the item that would cross that total left out, so
           the epoch holds just under E ideal steps of tokens), dealt to the ranks' windows as
           in the steady run; the run goes on until every item is delivered. Per step the
           sources' targets, and the depth of their windows, follow the weights renormalized
           over the sources that still hold items. E = --epoch-steps (50; quick 10) for
           R < 512, and --large-epoch-steps (10) x 512 / R, at least 4, for R >= 512 (the
           naive plan takes seconds per step there). With total tokens just under E steps, a
           planner needs E + 1 steps unless every step is full to the last item.

Distributions (lengths in tokens; a document longer than C is split into C-token pieces, as the
pipeline does upstream):
  lognormal  C = 8192. Four sources with different medians: web (45%, median 600, sigma 1.0),
             code (25%, 1200, 1.3), books (15%, 6000, 1.0), chat (15%, 300, 0.8).
  outlier    C = 32768. The same four sources, except that 2% of every source's documents are
             replaced by documents near the 32k context: uniform in [30720, 32768].
Cost model: CostModel(a=1 / 4096) unless --cost-a/--cost-b (a = 1/4096, b = 1: attention costs as much as
the linear layers at 4096 tokens), document masking. Every planner gets --step-overhead (default
the Planner's, 0.05): the per-step cost o = step_overhead x b x M x C
(`streamload.plan.fill.step_overhead_cost`) that its top-up weighs an empty slot against.

Per-step metrics per (dist, ranks, micro_batches, method), over the steady run's measured steps:
  imbalance          max per-rank cost / mean per-rank cost, per step (mean and p99)
  bound_single       max(total / R, largest single item cost) / mean, per step (mean)
  planner_ms         wall time of Planner.assign, pinned to one core (median and p99); also
                     planner_cpu_ms (the thread's CPU time), which is what a dedicated core
                     would see when other processes share the machine
  deferral_max/mean  age (steps offered and not taken) of the items when taken
  exchanged_fraction taken tokens whose destination rank is not the rank that holds them
  fill               taken tokens / (R * M * C): what a plan leaves for later steps shows here
  efficiency         sum over steps of the mean rank cost / sum of the largest rank cost: the
                     share of the ranks' time spent on work rather than waiting, over the run.
                     The table shows it relative to naive as `speedup` (a per-step figure: a
                     plan that leaves slots empty can score well here and still be slower)
  cost_per_token     sum over steps of (largest rank cost + o) / tokens taken: the steady
                     run's price of a token; `tok_spd` = naive's / this one's (> 1: cheaper)
  steps              measured steps (after `warmup` unmeasured ones). 100 for R <= 64; 20 for
                     R >= 512, and for naive there 20 * 512 / R (its plan takes seconds)

Epoch metrics (JSON key "epoch"; table columns after `|`):
  steps, ideal_steps  steps taken; ceil(total tokens / (R*M*C))
  tokens, items       delivered (checked equal to the epoch's list, so equal for every method)
  fill                tokens / (steps * R * M * C)
  tokens_per_step     p1 / p50 / p99 (the table shows them / (R*M*C))
  imbalance_mean      mean over steps of max / mean rank cost
  compute             sum over steps of (largest rank cost + o); compute_no_overhead without o
  speedup_vs_naive    naive's compute / this one's (> 1: the epoch is cheaper than naive's);
                      speedup_vs_naive_no_overhead likewise without o
  plan_s              the planner's total wall time over the epoch

Window depth (what the coordinator keeps per rank and source, in steps' worth of tokens): 2 for
naive and balanced, W for lookahead. max_age: none for naive, 3 for balanced, W for lookahead
(W = 4).

Usage: python benchmarks/balance.py [--quick] [--steps N] [--ranks 8,64] [--dists lognormal]
                                    [--epoch-steps E] [--large-epoch-steps E] [--step-overhead F]
(--epoch-steps 0 skips the epoch runs.) The human table goes to stderr; the last line of stdout
is {"results": [...]}, one object per configuration: dist, ranks, micro_batches, method, the
per-step metrics above (imbalance_mean, imbalance_p99, bound_single_mean, planner_ms_median,
planner_ms_p99, planner_cpu_ms_median, planner_cpu_ms_p99, deferral_max, deferral_mean,
exchanged_fraction, fill, efficiency, speedup_vs_naive, cost_per_token, tok_speedup_vs_naive,
capacity, steps, warmup, step_overhead, overhead_per_step) and "epoch": {epoch_steps_data (E),
steps, ideal_steps, tokens, items, fill, tokens_per_step: {p1, p50, p99}, imbalance_mean,
compute, compute_no_overhead, speedup_vs_naive, speedup_vs_naive_no_overhead, plan_s} (null
when skipped). The *_vs_naive figures are null when naive is not among --methods.
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
from streamload.plan.fill import step_overhead_cost  # noqa: E402
from streamload.plan.planner import Planner  # noqa: E402
from streamload.plan.types import Geometry  # noqa: E402
from _windows import BODY, SourceSpec, StreamWindows  # noqa: E402
from streamload.pieces import cut_documents  # noqa: E402

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
        return cut_documents(docs, self.capacity, "split").lengths

    def take(self, tokens: float) -> np.ndarray:
        """Lengths of the next documents, at least `tokens` tokens of them (one item over)."""
        while self.pending.sum() < tokens:
            self.pending = np.concatenate([self.pending, self._draw(4096)])
        n = int(np.searchsorted(np.cumsum(self.pending), tokens, side="left")) + 1
        out, self.pending = self.pending[:n], self.pending[n:]
        return out


class FiniteStream:
    """A source with a fixed list of items: `stream`'s first items up to `total` tokens (the
    one that would cross it left out), served in order until they run out."""

    def __init__(self, stream: LengthStream, total: float):
        items = stream.take(total)
        self.items = items[np.cumsum(items) <= total]
        self.cum = np.cumsum(self.items)
        self.pos = 0

    @property
    def left(self) -> int:
        done = int(self.cum[self.pos - 1]) if self.pos else 0
        return int(self.cum[-1]) - done if self.items.size else 0

    def take(self, tokens: float) -> np.ndarray:
        """The next items, at least `tokens` of them (one item over), until the list ends."""
        if self.pos >= self.items.size:
            return np.zeros(0, dtype=np.int64)
        done = float(self.cum[self.pos - 1]) if self.pos else 0.0
        end = min(int(np.searchsorted(self.cum, done + tokens, side="left")) + 1, self.items.size)
        out, self.pos = self.items[self.pos:end], end
        return out


class Coordinator(StreamWindows):
    """The coordinator loop without processes (see _windows.py), for one length mix. With
    `epoch_steps`, every source is finite (`FiniteStream`): its weight x epoch_steps x R*M*C
    tokens."""

    def __init__(self, dist: str, ranks: int, micro_batches: int, depth_steps: float, seed: int,
                 epoch_steps: int | None = None):
        capacity, outlier_fraction, outlier_range = DISTS[dist]
        geometry = Geometry(ranks, micro_batches, capacity)
        self.weights = np.array([s.weight for s in BODY])
        self.targets = self.weights * geometry.step_tokens
        streams = [LengthStream(s, capacity, outlier_fraction, outlier_range, seed, i)
                   for i, s in enumerate(BODY)]
        if epoch_steps is not None:
            share = self.weights / self.weights.sum() * epoch_steps * geometry.step_tokens
            streams = [FiniteStream(st, share[i]) for i, st in enumerate(streams)]
            self.epoch_tokens = int(sum(int(st.items.sum()) for st in streams))
            self.epoch_items = int(sum(st.items.size for st in streams))
        # tokens per (rank, source) window
        self.depth_steps = depth_steps
        super().__init__(geometry, streams, depth_steps * self.targets / ranks)

    def tokens_left(self) -> np.ndarray:
        """Tokens per source still to deliver: in the windows and in the finite streams."""
        held = self.held()
        return held + np.array([st.left for st in self.streams], dtype=np.float64)

    def epoch_targets(self) -> np.ndarray:
        """The step's targets: the weights, renormalized over the sources that hold items."""
        w = np.where(self.tokens_left() > 0, self.weights, 0.0)
        return w / max(w.sum(), 1e-12) * self.geometry.step_tokens


def make_planner(method: str, geometry: Geometry, cost: CostModel, seed: int,
                 step_overhead: float) -> Planner:
    max_age = {"naive": None, "balanced": 3, "lookahead": None}[method]
    return Planner(geometry, cost, method=method, seed=seed, max_age=max_age, lookahead=WINDOW,
                   step_overhead=step_overhead)


def run_config(dist: str, ranks: int, micro_batches: int, method: str, steps: int, warmup: int,
               cost: CostModel, seed: int, step_overhead: float) -> dict:
    depth = WINDOW if method == "lookahead" else 2
    coord = Coordinator(dist, ranks, micro_batches, depth, seed)
    planner = make_planner(method, coord.geometry, cost, seed, step_overhead)
    overhead = step_overhead_cost(step_overhead, coord.geometry, cost)
    imbalance, bound, times, cpu_times, fill = [], [], [], [], []
    ages = []
    moved = taken_tokens = 0
    step_cost = work = 0.0               # sums over steps of the largest and the mean rank cost
    for step in range(warmup + steps):
        c = coord.candidates()
        t0, c0 = time.perf_counter(), time.thread_time()
        a = planner.assign(c, coord.targets, step)
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
        "cost_per_token": (step_cost + steps * overhead) / max(taken_tokens, 1),
        "capacity": coord.geometry.capacity, "steps": steps, "warmup": warmup,
        "step_overhead": step_overhead, "overhead_per_step": overhead,
    }


def run_epoch(dist: str, ranks: int, micro_batches: int, method: str, epoch_steps: int,
              cost: CostModel, seed: int, step_overhead: float) -> dict:
    """One finite epoch: plan until every item of the epoch's list is delivered."""
    depth = WINDOW if method == "lookahead" else 2
    coord = Coordinator(dist, ranks, micro_batches, depth, seed, epoch_steps=epoch_steps)
    g = coord.geometry
    planner = make_planner(method, g, cost, seed, step_overhead)
    overhead = step_overhead_cost(step_overhead, g, cost)
    tokens, items, largest, imbalance = [], 0, [], []
    plan_s = 0.0
    limit = 4 * epoch_steps + 50
    while coord.has_items():
        if len(tokens) >= limit:
            raise RuntimeError(f"{dist} R={ranks} M={micro_batches} {method}: the epoch did not "
                               f"end in {limit} steps")
        targets = coord.epoch_targets()
        # The windows follow the renormalized targets too (as the loader sizes its windows from
        # the active sources' shares): a source that outlasts the others gets a deeper window,
        # not its old share's.
        coord.depth = coord.depth_steps * targets / ranks
        coord.refill()
        c = coord.candidates()
        t0 = time.perf_counter()
        a = planner.assign(c, targets, len(tokens))
        plan_s += time.perf_counter() - t0
        tokens.append(int(c.length[a.take].sum()))
        items += len(a)
        largest.append(float(a.rank_cost.max()))
        imbalance.append(float(a.rank_cost.max()) / max(float(a.rank_cost.mean()), 1e-300))
        coord.commit(a.take)
    if sum(tokens) != coord.epoch_tokens or items != coord.epoch_items:
        raise AssertionError(f"{dist} R={ranks} {method}: delivered {sum(tokens)} tokens in "
                             f"{items} items of {coord.epoch_tokens} in {coord.epoch_items}")
    tokens = np.array(tokens)
    steps = int(tokens.size)
    compute0 = float(np.sum(largest))
    return {
        "epoch_steps_data": epoch_steps,
        "steps": steps,
        "ideal_steps": -(-coord.epoch_tokens // g.step_tokens),
        "tokens": coord.epoch_tokens, "items": coord.epoch_items,
        "fill": coord.epoch_tokens / (steps * g.step_tokens),
        "tokens_per_step": {k: float(np.percentile(tokens, q))
                            for k, q in (("p1", 1), ("p50", 50), ("p99", 99))},
        "imbalance_mean": float(np.mean(imbalance)),
        "compute": compute0 + steps * overhead,
        "compute_no_overhead": compute0,
        "plan_s": plan_s,
    }


def num(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100, help="measured steps per configuration")
    p.add_argument("--large-steps", type=int, default=20,
                   help="measured steps when R >= 512 (naive: scaled down by R / 512, at least "
                        "2, because the baseline takes seconds per step there)")
    p.add_argument("--warmup", type=int, default=WINDOW, help="unmeasured steps first")
    p.add_argument("--epoch-steps", type=int, default=None,
                   help="the finite epoch's data in ideal steps (R*M*C tokens), R < 512 "
                        "(default 50, quick 10; 0: no epoch runs)")
    p.add_argument("--large-epoch-steps", type=int, default=10,
                   help="the same for R >= 512, scaled by 512 / R, at least 4 (default 10)")
    p.add_argument("--step-overhead", type=float, default=Planner.step_overhead,
                   help="per-step overhead as a fraction of a rank's full linear step, for the "
                        f"planners and the epoch compute (default {Planner.step_overhead})")
    p.add_argument("--quick", action="store_true",
                   help="10 steps, 10-step epochs, R <= 64: a smoke test")
    p.add_argument("--ranks", type=str, default="", help="comma list, e.g. 8,64")
    p.add_argument("--dists", type=str, default=",".join(DISTS))
    p.add_argument("--methods", type=str, default=",".join(METHODS))
    p.add_argument("--cost-a", type=float, default=CostModel(a=1 / 4096).a)
    p.add_argument("--cost-b", type=float, default=CostModel(a=1 / 4096).b)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", type=int, default=None, help="core to pin to (default: the last)")
    args = p.parse_args(argv)
    if args.epoch_steps is None:
        args.epoch_steps = 10 if args.quick else 50

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
              f"{'def_mean':>9}{'exch':>7}{'fill':>7}{'speedup':>8}{'tok_spd':>8}{'steps':>6}"
              f" |{'E':>4}{'e_steps':>8}{'ideal':>6}{'e_fill':>7}{'tps_p1':>7}{'tps_p50':>8}"
              f"{'tps_p99':>8}{'e_imb':>7}{'e_spd':>7}{'e_spd0':>7}{'plan_s':>8}")
    print(header, file=sys.stderr)
    print(" " * 126 + " | epoch: tps = tokens per step / (R*M*C); e_spd = naive's epoch compute "
          "(with overhead) / this; e_spd0 without overhead", file=sys.stderr)
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
                               args.seed, args.step_overhead)
                epoch_steps = args.epoch_steps if ranks < 512 else \
                    max(4, args.large_epoch_steps * 512 // ranks)
                r["epoch"] = (run_epoch(dist, ranks, micro_batches, method, epoch_steps, cost,
                                        args.seed, args.step_overhead)
                              if args.epoch_steps > 0 else None)
                base = [x for x in results if x["method"] == "naive" and x["dist"] == dist
                        and x["ranks"] == ranks and x["micro_batches"] == micro_batches]
                base = base[0] if base else (r if method == "naive" else None)
                nan = None                       # no naive run to compare with: null in JSON
                r["speedup_vs_naive"] = r["efficiency"] / base["efficiency"] if base else nan
                r["tok_speedup_vs_naive"] = (base["cost_per_token"] / r["cost_per_token"]
                                             if base else nan)
                e = r["epoch"]
                if e is not None:
                    be = base["epoch"] if base else None
                    e["speedup_vs_naive"] = be["compute"] / e["compute"] if be else nan
                    e["speedup_vs_naive_no_overhead"] = (
                        be["compute_no_overhead"] / e["compute_no_overhead"] if be else nan)
                results.append(r)
                line = (f"{dist:<10}{ranks:>5}{micro_batches:>3} {method:<10}"
                        f"{r['imbalance_mean']:>9.4f}{r['imbalance_p99']:>9.4f}"
                        f"{r['bound_single_mean']:>8.4f}{r['planner_ms_median']:>9.2f}"
                        f"{r['planner_ms_p99']:>9.2f}{r['planner_cpu_ms_median']:>9.2f}"
                        f"{r['deferral_max']:>8d}{r['deferral_mean']:>9.2f}"
                        f"{r['exchanged_fraction']:>7.3f}{r['fill']:>7.3f}"
                        f"{num(r['speedup_vs_naive']):>8}{num(r['tok_speedup_vs_naive']):>8}"
                        f"{steps:>6d} |")
                if e is not None:
                    st = float(r["capacity"] * ranks * micro_batches)
                    tps = e["tokens_per_step"]
                    line += (f"{e['epoch_steps_data']:>4d}{e['steps']:>8d}{e['ideal_steps']:>6d}"
                             f"{e['fill']:>7.3f}{tps['p1'] / st:>7.3f}{tps['p50'] / st:>8.3f}"
                             f"{tps['p99'] / st:>8.3f}{e['imbalance_mean']:>7.3f}"
                             f"{num(e['speedup_vs_naive']):>7}"
                             f"{num(e['speedup_vs_naive_no_overhead']):>7}{e['plan_s']:>8.2f}")
                print(line, file=sys.stderr, flush=True)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
