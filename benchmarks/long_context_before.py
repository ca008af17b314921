"""benchmarks/long_context.py's dry run against an older checkout's planner: the "before" of a
change, on the same corpus, baseline and efficiency.

    git worktree add /tmp/old 0ef8509           # the tree to measure
    python benchmarks/long_context_before.py --old /tmp/old --ranks 2,4,64

The older dry run may not report row costs: they are worked out from what its planner returned
(`Stepper.assign` is wrapped), so every configuration is judged on the 1F1B step time as in
long_context.py. Its loader options are the benchmark's without `pipeline_stages` (an older
tree has no such option: it plans every configuration as P = 1). Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="the older checkout (a git worktree)")
    ap.add_argument("--ranks", default="2,4,64")
    ap.add_argument("--planners", default="naive,balanced,lookahead")
    ap.add_argument("--configs", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.old))            # its streamload first
    sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
    import streamload
    if not streamload.__file__.startswith(os.path.abspath(args.old)):
        raise SystemExit(f"streamload came from {streamload.__file__}, not {args.old}")
    import _long_tail
    import long_context as lc
    from streamload.commands.dryrun.simulate import simulate
    from streamload.configfile import LoaderSpec
    from streamload.plan.stepper import Stepper

    rows: list[np.ndarray] = []
    assign = Stepper.assign

    def capture(self, step):
        plan = assign(self, step)
        g = self.geometry
        cost = self.cost.row_costs(plan.length, plan.rank.astype(np.int64) * g.micro_batches +
                                   plan.row, g.ranks * g.micro_batches,
                                   extra_cost=step.candidates.extra_cost[plan.take])
        rows.append(cost.reshape(g.ranks, g.micro_batches))
        return plan
    Stepper.assign = capture

    results = []
    for name in (args.configs or ",".join(lc.CONFIGS)).split(","):
        C, M, P, _ = lc.CONFIGS[name]
        for R in [int(r) for r in args.ranks.split(",")]:
            steps = 150 if R <= 4 else 32
            corpus = _long_tail.corpus(R * M * C * steps * 1.25, seed=0)
            scans = lc.scans_for(corpus, C, R)
            base_eff = lc.efficiency(lc.baseline_rows(np.concatenate(list(corpus.values())),
                                                      C, R, M, 0), P)
            for planner in args.planners.split(","):
                options = lc.options(C, M, P, planner)
                options.pop("pipeline_stages")
                rows.clear()
                simulate(LoaderSpec("before", lc.sources(), options), scans, steps=steps, ranks=R)
                eff = lc.efficiency(np.stack(rows), P)
                r = {"config": name, "ranks": R, "planner": planner, "steps": len(rows),
                     "efficiency": round(eff, 4), "baseline_efficiency": round(base_eff, 4),
                     "speedup_vs_baseline": round(eff / base_eff, 4)}
                print(json.dumps(r), file=sys.stderr, flush=True)
                results.append(r)
    print(json.dumps({"old": os.path.abspath(args.old), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
