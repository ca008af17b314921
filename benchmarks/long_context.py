"""Balancing where it pays: long context, pipeline stages, against the baseline users have.

    python benchmarks/long_context.py                       # every configuration, loader + dry run
    python benchmarks/long_context.py --configs 128k_pp4 --sim-ranks 64 --no-loader
    python benchmarks/long_context.py --no-loader --sim-ranks 4,64,512 --seeds 0,1,2 \
        --planners lookahead --jsonl q.jsonl      # dry runs over three corpus seeds

Corpus: `benchmarks/_long_tail.py`, five sources of published long-tail shapes (ByteScale's
production mix among them: 80% of documents <= 4k, the 1% >= 128k holding ~40% of the tokens).
Documents longer than C are split into pieces of C (`long_documents="split"`).

Cost: a document of L tokens costs a*L^2 + b*L with a = 1/49152, b = 1: the document-masked
FLOPs of a d_model = 4096 decoder (L^2 + 12*d*L per layer, relative). A (rank, micro-batch)
row costs the sum over its segments; with P pipeline stages a rank's step takes the 1F1B time
of its M rows, (sum + (P-1) * max) / P (`streamload.plan.cost.pipeline_time`).

Baseline (what a Megatron-LM GPTDataset or LitData user has): the same documents, shuffled,
concatenated and cut into rows of exactly C tokens (document masking kept), rows dealt
round-robin, M per rank per step.

Efficiency = the perfectly balanced time for the same work over the actual time, summed over
the steps: a step's bound is its work W spread evenly over R*M rows, W/R * (M+P-1)/(M*P). It
does not depend on how much a planner (or the baseline's cutting) changed the work, so
`speedup_vs_baseline` = efficiency / the baseline's efficiency compares the same work.

Per (configuration, mode, R, planner): efficiency, speedup_vs_baseline, fill, steps,
mix_dev_active (max over sources of |realized share - weight| over the steps where every source
had data), tail_steps (the steps after a source ran out), waited_items / waited_mean /
waited_max (the dry run's deferred items: taken after a later item of their own (rank, source)
stream went ahead of them; their delay counts the steps since then), delay_mean_all (the same
delays over every token delivered, deferred or not: what a token waits on average), age_max
(the most steps a taken item sat in a head window; the deferral bound is on this), plan_ms
(planner CPU per step: mean and max).
waited_short_* / waited_long_* / waited_next / waited_mean_floor: the same delays by kind of
item, the share taken at the next step, and the mean were every short one taken then
(`delay_breakdown`).
The delay is the wait beyond arrival order: in arrival order nothing of a stream goes before an
earlier item, so an item that a later one overtook at step t would have been taken by step t,
and each step it stays after t counts. It does not count a stream that gives fewer tokens for
a while (the carry repaying a layer's overshoot slows a whole source, in order): that is the
mix deviation's subject. Nor does it credit items taken *before* their turn (a layer's long
documents taken from deep in the window): those count as zero, never as negative.
The last line is the JSON of everything.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _long_tail  # noqa: E402

COST_A, COST_B = 1.0 / 49152, 1.0
K = 1024
CONFIGS = {   # name: (C, M, P, CP)
    "32k_dp": (32 * K, 1, 1, 1),
    "32k_pp4": (32 * K, 8, 4, 1),
    "128k_pp4": (128 * K, 4, 4, 1),
    "128k_cp4": (128 * K, 2, 1, 4),   # rows of 128k over a CP group of 4 (32k per GPU)
}
PLANNERS = ("naive", "balanced", "lookahead", "lookahead:4")


def doc_cost(lengths) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.float64)
    return COST_A * lengths * lengths + COST_B * lengths


def step_times(row_cost: np.ndarray, P: int) -> np.ndarray:
    """[steps, R, M] -> the slowest rank's 1F1B time per step, (sum + (P-1) * max) / P over its
    rows. Written out here, not taken from streamload: the benchmark judges any tree's plans
    (long_context_before.py runs an older one) by the same rule."""
    return ((row_cost.sum(axis=-1) + (P - 1) * row_cost.max(axis=-1)) / P).max(axis=-1)


def bound_times(row_cost: np.ndarray, P: int) -> np.ndarray:
    """[steps, R, M] -> per step: the step's work over R*M equal rows, in 1F1B time."""
    _, R, M = row_cost.shape
    return row_cost.sum(axis=(1, 2)) / R * (M + P - 1) / (M * P)


def efficiency(row_cost: np.ndarray, P: int) -> float:
    return float(bound_times(row_cost, P).sum() / step_times(row_cost, P).sum())


def baseline_rows(docs: np.ndarray, C: int, R: int, M: int, seed: int) -> np.ndarray:
    """Megatron-style rows: the documents shuffled, concatenated, cut every C tokens; rows
    dealt round-robin, M per rank per step. Returns row costs [steps, R, M] (full steps)."""
    docs = np.random.default_rng(seed).permutation(np.asarray(docs, dtype=np.int64))
    ends = np.cumsum(docs)
    total = int(ends[-1])
    rows = total // C
    cuts = np.union1d(ends[ends < rows * C], np.arange(1, rows + 1, dtype=np.int64) * C)
    starts = np.concatenate([[0], cuts[:-1]])
    seg = cuts - starts
    cost = np.bincount(starts // C, weights=doc_cost(seg), minlength=rows)[:rows]
    steps = rows // (R * M)
    # Round-robin: consecutive rows go to ranks 0..R-1, then the next micro-batch.
    return cost[:steps * R * M].reshape(steps, M, R).transpose(0, 2, 1)


def scans_for(corpus: dict, C: int, R: int):
    from streamload import pieces
    from streamload.commands.dryrun.scan import SourceScan
    out = []
    for name, docs in corpus.items():
        cuts = pieces.cut_documents(docs, C, "split")
        shards = max(4, min(2 * R, cuts.lengths.size))
        per_shard = np.bincount(np.arange(cuts.lengths.size) * shards // cuts.lengths.size,
                                minlength=shards)
        out.append(SourceScan(name, "tokens", "index", cuts.lengths, per_shard, shards, shards,
                              docs.size, split=int((docs > C).sum()),
                              divisible=cuts.piece >= 0))
    return out


def sources():
    import streamload as sl
    return [sl.Source(f"/bench/{n}/", weight=w, name=n) for n, w in _long_tail.WEIGHTS.items()]


def options(C, M, P, planner, seed=0) -> dict:
    """Loader options. `planner` is a method, or "lookahead:W": the lookahead over W steps
    with the deferral bound 2W (`max_deferral`)."""
    method, _, window = planner.partition(":")
    extra = {"lookahead": int(window), "max_deferral": 2 * int(window)} if window else {}
    return dict(micro_batch_tokens=C, micro_batches=M, pipeline_stages=P, planner=method,
                cost_a=COST_A, cost_b=COST_B, epochs=1, seed=seed, **extra)


def summarize(row_cost: np.ndarray, P: int, tokens_by_source: np.ndarray, active: np.ndarray,
              fill: np.ndarray, waited: np.ndarray, waited_steps: np.ndarray,
              plan_ms: np.ndarray, base_eff: float) -> dict:
    weights = np.array(list(_long_tail.WEIGHTS.values()))
    all_active = active.all(axis=1)
    part = tokens_by_source[all_active].sum(axis=0)
    mix_dev = float(np.abs(part / part.sum() - weights / weights.sum()).max()) \
        if part.sum() else None
    eff = efficiency(row_cost, P)
    n_wait = int(waited.sum())
    return {"steps": int(row_cost.shape[0]), "efficiency": round(eff, 4),
            "speedup_vs_baseline": round(eff / base_eff, 4),
            "fill": round(float(fill.mean()), 4),
            # The epoch's last step holds what is left: a short step whatever the planner.
            "fill_but_last": round(float(fill[:-1].mean()), 4) if fill.size > 1 else None,
            "fill_p1": round(float(np.percentile(fill, 1)), 4),
            "mix_dev_active": None if mix_dev is None else round(mix_dev, 4),
            "tail_steps": int((~all_active).sum()),
            "waited_items": n_wait,
            "waited_mean": round(float(waited_steps.sum()) / n_wait, 3) if n_wait else 0.0,
            "waited_max": int(waited_steps.max(initial=0)) if waited_steps.ndim == 0 else None,
            "plan_ms_mean": round(float(plan_ms.mean()), 2) if plan_ms.size else None,
            "plan_ms_max": round(float(plan_ms.max()), 2) if plan_ms.size else None}


def delay_breakdown(delays: np.ndarray, C: int) -> dict:
    """The deferred items' delays ([2, n]: delay, tokens) by what they are: *short* ones (under
    C/16 tokens: the light items the balancer and the top-up leave out or pass over) and *long*
    ones (C/4 or more: documents that wait in the outlier queue for their layer, by design).
    `waited_next` is the share taken at the very next step (delay 1, the least a deferred item
    can have: see the module docstring), and `waited_mean_floor` the mean were every short
    item taken at the next step and the rest as they were: what the short items' second
    deferrals add, and what stays with the long ones."""
    delay, tokens = delays
    n = delay.size
    if n == 0:
        return {}
    short, long = tokens < C // 16, tokens >= C // 4

    def mean(mask):
        return round(float(delay[mask].mean()), 3) if mask.any() else None
    return {"waited_short_items": int(short.sum()), "waited_short_mean": mean(short),
            "waited_long_items": int(long.sum()), "waited_long_mean": mean(long),
            "waited_next": round(float((delay == 1).mean()), 3),
            "waited_mean_floor": round(float(np.where(short, 1, delay).sum()) / n, 3)}


def default_sim_steps(R: int) -> int:
    """The dry run's default length at R ranks. No item can be forced before step 2W = 16 (the
    deferral bound), so the first ~18 steps are a warm-up whose layers take the window's heavy
    documents with nothing yet due; the steady state after it alternates layers with steps that
    carry the documents come due. 32 steps at R = 64 were half warm-up (128k PP=4: 0.975 over
    32 steps against 0.93-0.95 over 96, main before long9); 96 steps keep the warm-up to a fifth:
    seconds a run at R = 64, ~1.5 min at R = 512 (planning ~0.3 s a step there). At R = 4096
    (~1 s a step, and a corpus of 10^11 tokens for 48 steps) 4 steps: warm-up only, its figures
    do not show the steady state.
    """
    return 96 if R <= 512 else 4


def run_sim(name: str, R: int, planners, args, seed: int = 0) -> list[dict]:
    """The dry run (`streamload.commands.dryrun.simulate`) at R ranks, `args.sim_steps` steps of
    a corpus sized for them."""
    from streamload.commands.dryrun.simulate import simulate
    from streamload.configfile import LoaderSpec
    C, M, P, CP = CONFIGS[name]
    step_tokens = R * M * C
    steps = args.sim_steps or default_sim_steps(R)
    corpus = _long_tail.corpus(step_tokens * steps * 1.25, seed=seed)
    scans = scans_for(corpus, C, R)
    base = baseline_rows(np.concatenate(list(corpus.values())), C, R, M, seed)
    base_eff = efficiency(base, P)
    out = [{"config": name, "mode": "sim", "ranks": R, "planner": "megatron_baseline",
            "steps": int(base.shape[0]), "efficiency": round(base_eff, 4),
            "speedup_vs_baseline": 1.0, "fill": 1.0}]
    for planner in planners:
        spec = LoaderSpec("long_context", sources(), options(C, M, P, planner, seed))
        started = time.perf_counter()
        reports = simulate(spec, scans, steps=steps, ranks=R)
        wall = time.perf_counter() - started
        row_cost = np.stack([r.row_cost for r in reports])
        res = summarize(row_cost, P,
                        np.stack([r.tokens for r in reports]).astype(np.float64),
                        np.stack([r.active for r in reports]),
                        np.array([r.fill for r in reports]),
                        np.array([r.waited for r in reports]),
                        np.array([r.waited_steps for r in reports]),
                        np.array([1e3 * r.plan_seconds for r in reports]), base_eff)
        res["waited_max"] = int(max(r.delay_max for r in reports))
        res["delay_mean_all"] = round(sum(r.waited_token_steps for r in reports) /
                                      max(sum(int(r.tokens.sum()) for r in reports), 1), 3)
        res["age_max"] = int(max(r.max_age for r in reports))
        res.update(delay_breakdown(np.concatenate([r.delays for r in reports], axis=1), C))
        out.append({"config": name, "mode": "sim", "ranks": R, "planner": planner, "seed": seed,
                    "wall_s": round(wall, 1), **res})
    return out


def print_row(r: dict, jsonl: str | None = None) -> None:
    if jsonl:
        with open(jsonl, "a", encoding="utf-8") as f:
            f.write(json.dumps(r) + "\n")
    keys = ("efficiency", "speedup_vs_baseline", "fill_but_last", "mix_dev_active",
            "waited_mean", "waited_max", "waited_short_mean", "waited_long_mean",
            "waited_mean_floor", "delay_mean_all", "plan_ms_mean", "steps")
    print(f"{r['config']:>9} {r['mode']:>6} R={r['ranks']:<5} {r['planner']:>17} " +
          " ".join(f"{k}={r.get(k)}" for k in keys), file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--sim-ranks", default="64,512,4096")
    ap.add_argument("--sim-steps", type=int, default=None,
                    help="dry-run steps per run (default: 96 up to R=512, else 4: "
                         "`default_sim_steps`)")
    ap.add_argument("--seeds", default="0",
                    help="corpus seeds of the dry runs, e.g. 0,1,2 (one run per seed)")
    ap.add_argument("--loader-ranks", default="2,4")
    ap.add_argument("--loader-tokens", type=float, default=None, help="loader corpus tokens (default: 96 steps of R*M*C)")
    ap.add_argument("--no-loader", action="store_true")
    ap.add_argument("--jsonl", default=None,
                    help="also append every result to this file as it comes (long runs)")
    args = ap.parse_args(argv)
    planners = args.planners.split(",")
    results = []
    for name in args.configs.split(","):
        if not args.no_loader:
            import _long_context_loader
            for R in [int(x) for x in args.loader_ranks.split(",") if x]:
                for r in _long_context_loader.run(name, R, planners, args):
                    print_row(r, args.jsonl)
                    results.append(r)
        for R in [int(x) for x in args.sim_ranks.split(",") if x]:
            for seed in [int(x) for x in args.seeds.split(",") if x]:
                for r in run_sim(name, R, planners, args, seed=seed):
                    print_row(r, args.jsonl)
                    results.append(r)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
