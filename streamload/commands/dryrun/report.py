"""The dry run's report: the run in numbers, the table, and the `streamload plan` command."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence

import numpy as np

from ...configfile import LoaderSpec, load_config
from ...errors import ConfigError, StreamloadError

from ...mixreport import MixTally, format_mix
from ...plan.cost import balanced_time
from .scan import scan
from ...plan.stepper import Stepper
from ...vision.hybrid import imbalance
from .simulate import StepReport, simulate

DEFAULT_STEPS = 100


def summarize(spec: LoaderSpec, reports: Sequence[StepReport]) -> dict:
    """The run in numbers: balance (imbalance mean / max), the mix (`mix`: `MixTally.summary()`:
    the target as configured, realized while every source had data, per epoch with run-outs;
    `mix_max_abs_dev` is the largest |realized - target| on those all-active steps,
    `mix_tail_max_abs_dev` the epoch tails', `mix_step_max_abs_dev` the worst all-active
    step's), deferrals and fill."""
    names = [s.name for s in spec.sources]
    S = len(names)
    out: dict = {"steps": len(reports), "by": spec.mixture.by}
    if not reports:
        return {**out, "imbalance_mean": None, "imbalance_max": None, "mix_max_abs_dev": None,
                "pipeline_stages": None, "step_time_total": None, "balance_efficiency": None,
                "row_cost_max": None,
                "mix_step_max_abs_dev": None, "mix_tail_max_abs_dev": None, "mix": None, "max_deferral": None, "fill_mean": None,
                "sources": {n: {} for n in names}}
    share = np.array([r.share for r in reports]).reshape(-1, S)
    totals = np.array([r.units for r in reports])      # 1 per step with data, 0 when empty
    unit_totals = np.array([(r.tokens if spec.mixture.by == "tokens" else r.samples).sum()
                            for r in reports], dtype=np.float64)
    N = float(unit_totals.sum())
    tally = MixTally(names)
    for r in reports:
        tally.add(r.epoch, r.step, r.tokens if spec.mixture.by == "tokens" else r.samples, r.mix)
    mix = tally.summary()
    all_active = np.array([r.mix is None or not r.mix.tail for r in reports]) & (totals > 0)
    target = np.array([r.target_share if r.mix is None else r.mix.target for r in reports]
                      ).reshape(-1, S)
    step_dev = np.abs(share - target)[all_active]
    imbalance = np.array([r.imbalance for r in reports])
    stages = spec.config().pipeline_stages or 1
    out.update(step_time_summary(reports, stages))
    out.update({
        "imbalance_mean": float(imbalance.mean()), "imbalance_max": float(imbalance.max()),
        "max_rank_cost": float(max(r.rank_cost.max() for r in reports)),
        "mix_max_abs_dev": mix["deviation"], "mix_tail_max_abs_dev": mix["tail_deviation"],
        "mix_step_max_abs_dev": float(step_dev.max()) if step_dev.size else None, "mix": mix,
        "max_deferral": int(max(r.max_age for r in reports)),
        "deferred_mean": float(np.mean([r.deferred for r in reports])),
        "fill_mean": float(np.mean([r.fill for r in reports])),
        "epochs": int(reports[-1].epoch) + 1,
        "tokens": int(sum(int(r.tokens.sum()) for r in reports)),
        "sources": {n: {"share": mix["sources"][n]["realized"],
                        "target": mix["sources"][n]["target"],
                        "share_all_active": mix["sources"][n]["realized_all_active"],
                        "tokens": int(sum(int(r.tokens[s]) for r in reports)),
                        "samples": int(sum(int(r.samples[s]) for r in reports))}
                    for s, n in enumerate(names)},
    })
    if reports[0].encoder_cost is not None:
        out["images"] = image_summary(reports, spec.config())
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


def image_summary(reports: Sequence[StepReport], config) -> dict:
    """An image job's encoder and backbone apart (`vision.hybrid.imbalance`: max / mean over
    ranks, per step): their imbalances (mean and max over steps), the encoder's share of the
    planned cost, and the largest images and patches of any row against the caps per row."""
    encoder = [imbalance(r.encoder_cost) for r in reports]
    backbone = [imbalance(r.backbone_cost) for r in reports]
    enc = float(sum(float(r.encoder_cost.sum()) for r in reports))
    total = enc + float(sum(float(r.backbone_cost.sum()) for r in reports))
    slowest = sum(float((r.encoder_cost + r.backbone_cost).max()) for r in reports)
    return {"image_cost": config.image_cost,
            "encoder_share": enc / total if total > 0 else 0.0,
            # the sequential schedule's balance: the work spread evenly over the ranks, over
            # the sum of each step's slowest rank (encoder + backbone)
            "efficiency": total / len(reports[0].rank_cost) / slowest if slowest > 0 else 1.0,
            "encoder_imbalance_mean": float(np.mean(encoder)),
            "encoder_imbalance_max": float(np.max(encoder)),
            "backbone_imbalance_mean": float(np.mean(backbone)),
            "backbone_imbalance_max": float(np.max(backbone)),
            "row_images_max": int(max(int(r.row_visual[..., 0].max(initial=0)) for r in reports)),
            "row_patches_max": int(max(int(r.row_visual[..., 1].max(initial=0)) for r in reports)),
            "max_images_per_row": config.max_images_per_row,
            "max_patches_per_row": config.max_patches_per_row}


def format_images(images: dict) -> str:
    caps = lambda cap: "no cap" if cap is None else f"cap {cap:,}"
    return (f"images ({images['image_cost']}): encoder {images['encoder_share']:.1%} of the "
            f"cost, efficiency {images['efficiency']:.4f} (encoder then backbone on each rank)"
            f"; imbalance encoder mean {images['encoder_imbalance_mean']:.4f} max "
            f"{images['encoder_imbalance_max']:.4f}, backbone mean "
            f"{images['backbone_imbalance_mean']:.4f} max {images['backbone_imbalance_max']:.4f}"
            f"; per row at most {images['row_images_max']:,} images "
            f"({caps(images['max_images_per_row'])}), {images['row_patches_max']:,} patches "
            f"({caps(images['max_patches_per_row'])})")


def step_time_summary(reports: Sequence[StepReport], stages: int) -> dict:
    """The steps' predicted time under the pipeline model (`cost.pipeline_time`: each rank's
    1F1B time over its micro-batches, the slowest rank's per step) and the balance efficiency:
    the same work spread evenly over every (rank, micro-batch), over that time (1.0: no rank
    and no micro-batch waits)."""
    rows = [r.row_cost for r in reports if r.row_cost is not None and r.row_cost.size]
    if not rows:
        return {"pipeline_stages": stages, "step_time_total": None, "balance_efficiency": None,
                "row_cost_max": None}
    bound = sum(balanced_time(x, stages) for x in rows)
    total = float(sum(r.step_time for r in reports))
    return {"pipeline_stages": stages, "step_time_total": total,
            "balance_efficiency": bound / total if total > 0 else None,
            "row_cost_max": float(max(float(x.max()) for x in rows))}


def steps_per_epoch(spec: LoaderSpec, scans: Sequence, reports: Sequence[StepReport],
                    steps: int) -> dict:
    """The first epoch's steps, for an LR schedule: {"steps": N, "exact": True} when the plan
    (of at most `steps` steps) reached the epoch's end; else an estimate, {"steps": N, "exact":
    False}: the steps planned, plus the finite sources' tokens left over the tokens they gave
    per step so far. {"steps": None, ...} with a "why" when there is no estimate (a finite
    source was sampled with --max-docs, or nothing was planned)."""
    first = [r for r in reports if r.epoch == 0]
    if len(first) < len(reports) or len(reports) < steps:   # the epoch (or the data) ended
        return {"steps": len(first), "exact": True}
    finite = [s for s, source in enumerate(spec.sources) if source.on_exhausted != "restart"]
    if not first or not finite:
        return {"steps": None, "exact": False,
                "why": "no step planned" if not first else "every source restarts: no epochs"}
    if not all(getattr(scans[s], "complete", True) for s in finite):
        return {"steps": None, "exact": False,
                "why": "a source was sampled (--max-docs): its size is not known"}
    total = sum(int(np.sum(getattr(scans[s], "lengths", scans[s]))) for s in finite)
    taken = sum(int(r.tokens[finite].sum()) for r in first)
    per_step = taken / len(first)
    left = max(total - taken, 0)
    return {"steps": len(first) + (int(np.ceil(left / per_step)) if per_step > 0 else 0),
            "exact": False}


def format_steps_per_epoch(estimate: dict) -> str:
    if estimate["steps"] is None:
        return f"steps per epoch: not known ({estimate['why']})"
    if estimate["exact"]:
        return f"steps per epoch: {estimate['steps']:,} (epoch 0, planned to its end)"
    return (f"steps per epoch: about {estimate['steps']:,} (estimated from the tokens left; "
            f"--steps {estimate['steps'] + 10:,} plans to the epoch's end for the exact count)")


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
             f"step time (1F1B over {summary['pipeline_stages']} stage(s)): "
             f"{summary['step_time_total']:.4g} in all; balance efficiency "
             f"{summary['balance_efficiency']:.4f} (the same work spread evenly over every "
             f"rank and micro-batch, over that)",
             "taken: " + ", ".join(f"{name} {s['tokens']:,} tokens, {s['samples']:,} items"
                                   for name, s in summary["sources"].items())]
    if summary.get("images"):
        lines.append(format_images(summary["images"]))
    lines += format_mix(summary["mix"], summary.get("by", "tokens"))
    if summary["mix_step_max_abs_dev"] is not None:
        lines.append(f"  worst single step while every source had data: |realized - target| "
                     f"{summary['mix_step_max_abs_dev']:.4f}")
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
        if getattr(args, "planner", None):   # --planner overrides the file's
            spec = dataclasses.replace(spec, options={**spec.options, "planner": args.planner})
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
    summary["steps_per_epoch"] = steps_per_epoch(spec, scans, reports, args.steps)
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
              + (f", {s.skipped} skipped" if s.skipped else "")
              + ("" if s.image_patches is None else
                 f", {sum(map(len, s.image_patches)):,} images of "
                 f"{sum(map(sum, s.image_patches)):,} patches (from their headers)") + note)
    print()
    for line in format_table(spec, reports, args.every):
        print(line)
    print()
    for line in format_summary(summary):
        print(line)
    print(format_steps_per_epoch(summary["steps_per_epoch"]))
    print(json.dumps({"summary": {**head, **summary}}))
    return 0
