"""Planner CPU on the same inputs: record the dry run's `Stepper.assign` inputs, replay them.

    python benchmarks/plan_replay.py record 128k_pp4 512 r.pkl --steps 6 --seed 0
    python benchmarks/plan_replay.py replay r.pkl --runs 2          # in each tree to compare

`record` runs `long_context.run_sim` for one configuration (planner `lookahead`) and keeps each
step's planner inputs (the planner, the step's quota and index, pickled before it plans) with a
digest of the plan it made (take, rank, row, tokens). `replay` plans every recorded step again
in the tree on PYTHONPATH, `--runs` times (the first step once more before, to warm up), keeps
each step's smallest CPU time (`time.process_time`) and checks the plan's digest against the
recording. The dry run times the planner between steps of a moving corpus; a replay times the
same inputs in two trees, so run them alternately: on a shared machine the times move by ±10%
between rounds, the digests do not (a change meant to keep the plans must keep them all).
A replay's candidates know their windows' layout where the tree's dry run hands it to the
planner (`Candidates.from_windows` knows it, `Candidates.keep_layout` passes it through the
quota), and that no item has a cost of its own where the tree's dry run knows it (text
sources), so each tree pays for what its own dry run pays. The last line is the JSON.
"""
from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import os
import pickle
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def digest(assignment) -> str:
    h = hashlib.sha1()
    for part in (assignment.take, assignment.rank, assignment.row, assignment.length):
        h.update(np.ascontiguousarray(part).tobytes())
    return h.hexdigest()


def _uncached(candidates) -> None:
    """Drop what `Candidates` worked out and cached, so a replay pays for it as a step does."""
    for name, value in vars(type(candidates)).items():
        if isinstance(value, functools.cached_property):
            vars(candidates).pop(name, None)


def record(config: str, ranks: int, path: str, steps: int, seed: int) -> dict:
    import long_context
    from streamload.plan.planner import Planner
    steps_seen = []
    plan = Planner.assign_quota

    def recording(self, quota, step):
        _uncached(quota.candidates)
        blob = pickle.dumps((self, quota, step))
        assignment = plan(self, quota, step)
        steps_seen.append((blob, digest(assignment)))
        return assignment

    Planner.assign_quota = recording
    try:
        result = long_context.run_sim(config, ranks, ["lookahead"],
                                      argparse.Namespace(sim_steps=steps), seed=seed)[1]
    finally:
        Planner.assign_quota = plan
    with open(path, "wb") as f:
        pickle.dump(steps_seen, f)
    return {"mode": "record", "config": config, "ranks": ranks, "seed": seed,
            "steps": len(steps_seen), "path": path,
            **{k: result[k] for k in ("efficiency", "fill_but_last", "plan_ms_mean")}}


def _as_offered(quota):
    """The recorded step as this tree's dry run would offer it: where `Candidates.from_windows`
    already knows the windows' layout (`Candidates.known_windows`), or that no item has a
    cost of its own (`has_extra_cost`), the replay's candidates know it too (worked out here,
    outside the timing, from the recorded step)."""
    from streamload.plan.types import Candidates
    probe = Candidates.from_windows([[np.array([1])]])
    c = quota.candidates
    # The planner sees the quota's relabelled candidates: they know the layout where the
    # quota passes it on (`Candidates.keep_layout`) and `from_windows` knows it.
    if "dense_positions" in vars(probe) and hasattr(Candidates, "keep_layout") and len(c) \
            and c.window_bounds is not None and c.dense_positions:
        sizes = np.diff(c.window_bounds).reshape(c.num_sources, c.num_ranks).T
        _uncached(c)
        c.known_windows(sizes)
    # Where `from_windows` knows that no item has a cost of its own (the dry run offers no
    # extra costs for text sources), the quota's candidates know it too: so do the replay's
    # (recorded text steps, all zero; worked out here, outside the timing).
    if "has_extra_cost" in vars(probe) and len(c) and not c.extra_cost.any():
        c.__dict__["has_extra_cost"] = False
    return quota


def replay(path: str, runs: int) -> dict:
    with open(path, "rb") as f:
        steps = pickle.load(f)
    planner, quota, index = pickle.loads(steps[0][0])
    planner.assign_quota(quota, index)                     # warm up
    times, same = [], 0
    for blob, expected in steps:
        best = None
        for _ in range(runs):
            planner, quota, index = pickle.loads(blob)
            quota = _as_offered(quota)
            gc.collect()
            started = time.process_time()
            assignment = planner.assign_quota(quota, index)
            spent = time.process_time() - started
            best = spent if best is None else min(best, spent)
        times.append(1e3 * best)
        same += digest(assignment) == expected
    ms = np.array(times)
    return {"mode": "replay", "path": path, "steps": len(steps), "same_plans": same,
            "plan_ms_mean": round(float(ms.mean()), 1), "plan_ms_max": round(float(ms.max()), 1),
            "plan_ms": [round(t, 1) for t in times]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("config")
    rec.add_argument("ranks", type=int)
    rec.add_argument("path")
    rec.add_argument("--steps", type=int, default=6)
    rec.add_argument("--seed", type=int, default=0)
    rep = sub.add_parser("replay")
    rep.add_argument("path")
    rep.add_argument("--runs", type=int, default=2)
    args = ap.parse_args(argv)
    if args.mode == "record":
        out = record(args.config, args.ranks, args.path, args.steps, args.seed)
    else:
        out = replay(args.path, args.runs)
        print(f"{out['path']}: {out['plan_ms_mean']} ms mean, {out['plan_ms_max']} max, "
              f"same plans {out['same_plans']}/{out['steps']}")
    print(json.dumps(out))
    return 0 if out.get("same_plans", out["steps"]) == out["steps"] else 1


if __name__ == "__main__":
    sys.exit(main())
