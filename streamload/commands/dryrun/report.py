"""The dry run's report: the run in numbers, the table, and the `streamload plan` command."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import numpy as np

from ...configfile import LoaderSpec, load_config
from ...errors import ConfigError, StreamloadError

from .scan import scan
from ...plan.stepper import Stepper
from .simulate import StepReport, simulate

DEFAULT_STEPS = 100


def summarize(spec: LoaderSpec, reports: Sequence[StepReport]) -> dict:
    """The run in numbers: balance (imbalance mean / max), the mix over the run against the
    target (per source, and the largest |difference| over the run and in any one step),
    deferrals and fill."""
    names = [s.name for s in spec.sources]
    S = len(names)
    out: dict = {"steps": len(reports)}
    if not reports:
        return {**out, "imbalance_mean": None, "imbalance_max": None, "mix_max_abs_dev": None,
                "mix_step_max_abs_dev": None, "max_deferral": None, "fill_mean": None,
                "sources": {n: {} for n in names}}
    share = np.array([r.share for r in reports]).reshape(-1, S)
    totals = np.array([r.units for r in reports])      # 1 per step with data, 0 when empty
    # Realized and target shares over the run, weighting each step by what it delivered.
    unit_totals = np.array([(r.tokens if spec.mixture.by == "tokens" else r.samples).sum()
                            for r in reports], dtype=np.float64)
    realized = (share * unit_totals[:, None]).sum(axis=0)
    target = np.array([r.target_share for r in reports]).reshape(-1, S)
    wanted = (target * unit_totals[:, None]).sum(axis=0)
    N = float(unit_totals.sum())
    run_share = realized / N if N > 0 else np.zeros(S)
    run_target = wanted / N if N > 0 else np.zeros(S)
    step_dev = np.abs(share - target)[totals > 0]
    imbalance = np.array([r.imbalance for r in reports])
    out.update({
        "imbalance_mean": float(imbalance.mean()), "imbalance_max": float(imbalance.max()),
        "max_rank_cost": float(max(r.rank_cost.max() for r in reports)),
        "mix_max_abs_dev": float(np.abs(run_share - run_target).max()),
        "mix_step_max_abs_dev": float(step_dev.max()) if step_dev.size else 0.0,
        "max_deferral": int(max(r.max_age for r in reports)),
        "deferred_mean": float(np.mean([r.deferred for r in reports])),
        "fill_mean": float(np.mean([r.fill for r in reports])),
        "epochs": int(reports[-1].epoch) + 1,
        "tokens": int(sum(int(r.tokens.sum()) for r in reports)),
        "sources": {n: {"share": float(run_share[s]), "target": float(run_target[s]),
                        "tokens": int(sum(int(r.tokens[s]) for r in reports)),
                        "samples": int(sum(int(r.samples[s]) for r in reports))}
                    for s, n in enumerate(names)},
    })
    if spec.mixture.quotas:
        lq = np.array([r.length_quota for r in reports])
        lt = np.array([r.length_quota_target for r in reports])
        out["length_quotas"] = [
            {"quota": q.describe(), "fraction": q.fraction,
             "share": float((lq[:, i] * unit_totals).sum() / N) if N > 0 else 0.0,
             "target": float((lt[:, i] * unit_totals).sum() / N) if N > 0 else 0.0,
             "min_step_share": float(lq[:, i].min())}
            for i, q in enumerate(spec.mixture.quotas)]
    return out


# -- the command ----------------------------------------------------------------------------------
def format_table(spec: LoaderSpec, reports: Sequence[StepReport], every: int = 1) -> list[str]:
    names = [s.name for s in spec.sources]
    width = max(11, *(len(n) for n in names))
    unit = "tokens" if spec.mixture.by == "tokens" else "samples"
    lines = [f"realized/target share of {unit} per source; imbalance = max/mean rank cost",
             f"{'step':>6} " + " ".join(f"{n:>{width}}" for n in names)
             + f" {'imbalance':>9} {'max cost':>10} {'fill':>6} {'defer':>5} {'age':>3}"]
    for i, r in enumerate(reports):
        if i % max(every, 1) and i != len(reports) - 1:
            continue
        mix = " ".join(f"{f'{a:.3f}/{t:.3f}':>{width}}" for a, t in zip(r.share, r.target_share))
        lines.append(f"{r.step:>6} {mix} {r.imbalance:>9.3f} {r.rank_cost.max():>10.4g} "
                     f"{r.fill:>6.3f} {r.deferred:>5} {r.max_age:>3}")
    return lines


def format_summary(summary: dict) -> list[str]:
    if not summary["steps"]:
        return ["no steps planned: the sources hold no data"]
    lines = [f"{summary['steps']} steps, {summary['tokens']:,} tokens, "
             f"{summary['epochs']} epoch(s)",
             f"imbalance: mean {summary['imbalance_mean']:.4f}, max "
             f"{summary['imbalance_max']:.4f} (max rank cost {summary['max_rank_cost']:.4g})",
             f"mix over the run: max |realized - target| {summary['mix_max_abs_dev']:.4f} "
             f"(worst single step {summary['mix_step_max_abs_dev']:.4f})"]
    for name, s in summary["sources"].items():
        lines.append(f"  {name}: {s['share']:.4f} realized vs {s['target']:.4f} target, "
                     f"{s['tokens']:,} tokens, {s['samples']:,} items")
    for q in summary.get("length_quotas", []):
        lines.append(f"  quota {q['quota']}: {q['share']:.4f} of the run (at least "
                     f"{q['fraction']:g}; lowest step {q['min_step_share']:.4f})")
    lines.append(f"deferral: max {summary['max_deferral']} step(s), "
                 f"{summary['deferred_mean']:.1f} items deferred per step; "
                 f"fill {summary['fill_mean']:.4f}")
    return lines


def run(args: argparse.Namespace) -> int:
    def fail(message: str, code: int) -> int:
        print(f"streamload plan: {message}", file=sys.stderr)
        return code

    for name in ("steps", "ranks", "max_docs", "every"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "steps" else 1):
            return fail(f"--{name.replace('_', '-')}: must be >= "
                        f"{0 if name == 'steps' else 1}, got {value}", 2)
    try:
        spec = load_config(args.config)
        config = spec.config()
        Stepper.build(config, spec.sources, spec.mixture, args.ranks)   # memory_budget too
    except ConfigError as exc:
        return fail(str(exc), 2)
    try:
        scans = scan(spec, args.max_docs)
        reports = simulate(spec, scans, args.steps, args.ranks)
    except ConfigError as exc:
        return fail(str(exc), 2)
    except StreamloadError as exc:
        return fail(str(exc), 1)
    summary = summarize(spec, reports)
    names = [s.name for s in spec.sources]
    head = {"config": spec.path, "ranks": args.ranks, "micro_batches": config.micro_batches,
            "micro_batch_tokens": config.micro_batch_tokens, "planner": config.planner,
            "by": spec.mixture.by, "scans": [s.to_dict() for s in scans]}
    if getattr(args, "plot", None):
        try:
            from ..plots import plot_plan
            plot_plan({**head, **summary}, reports, args.plot)
        except ImportError as exc:
            return fail(str(exc), 2)
        except OSError as exc:
            return fail(f"--plot {args.plot}: {exc.strerror or exc}", 1)
    if args.json:
        print(json.dumps({"summary": {**head, **summary},
                          "steps": [r.to_dict(names) for r in reports]}))
        return 0
    C, M, R = config.micro_batch_tokens, config.micro_batches, args.ranks
    print(f"plan {spec.path}: R={R} ranks x M={M} rows x C={C:,} tokens = "
          f"{R * M * C:,} tokens per step, planner {config.planner}")
    for s in scans:
        note = f" (sampled: first {s.documents:,} documents, repeated)" if not s.complete else ""
        long = ", ".join(f"{v:,} {k}" for k, v in (("split", s.split), ("truncated", s.truncated),
                                                   ("dropped", s.dropped)) if v)
        print(f"  {s.name}: {s.format} by {s.method}, {s.shards_read}/{s.shards} shards, "
              f"{s.documents:,} docs -> {s.lengths.size:,} items, {s.tokens:,} tokens"
              + (f" ({long} long documents)" if long else "")
              + (f", {s.skipped} skipped" if s.skipped else "") + note)
    print()
    for line in format_table(spec, reports, args.every):
        print(line)
    print()
    for line in format_summary(summary):
        print(line)
    print(json.dumps({"summary": {**head, **summary}}))
    return 0
