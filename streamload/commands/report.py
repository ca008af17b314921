"""`streamload report METRICS.jsonl [--plot OUT.png]`: a run's metrics log
(`streamload.observe.MetricsLog`) in a few lines, and as a plot (`plots.plot_run`). The log
records each step's configured target shares, the epoch's tail and the sources' run-outs, so
the mix is reported as `Loader.summary()` reports it (`mixreport`); `--target` sets the target
of a log written before those were recorded."""
from __future__ import annotations

import argparse
import math
import sys
from typing import Mapping, Optional, Sequence

import numpy as np

from ..mixreport import MixTally, StepMix, format_mix
from ..observe import read_metrics
from .plots import plot_run, series_from_records   # NumPy only: matplotlib when drawing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", metavar="METRICS.jsonl",
                        help="a metrics log: one JSON record per step (streamload.observe)")
    parser.add_argument("--plot", metavar="OUT.png", default=None,
                        help="draw the run into a PNG (needs matplotlib: "
                             "pip install streamload[plot])")
    parser.add_argument("--target", metavar="NAME=SHARE,...", action="append", default=None,
                        help="the mixture's target shares, e.g. web=0.7,code=0.3 (normalized), "
                             "for a log that has no target/<source> keys (default: the log's)")
    parser.add_argument("--by", choices=("tokens", "samples"), default="tokens",
                        help="the mixture's unit: the shares compare tokens (default) or items")


def parse_targets(values: Optional[Sequence[str]]) -> Optional[dict[str, float]]:
    """["web=0.7,code=0.3", "math=0.1"] -> {"web": 0.7, "code": 0.3, "math": 0.1}."""
    if not values:
        return None
    out: dict[str, float] = {}
    for value in values:
        for part in value.split(","):
            if not part.strip():
                continue
            name, sep, share = part.partition("=")
            try:
                if not sep or not name.strip():
                    raise ValueError
                out[name.strip()] = float(share)
            except ValueError:
                raise ValueError(f"--target: expected NAME=SHARE, got {part.strip()!r}") from None
            if not math.isfinite(out[name.strip()]) or out[name.strip()] < 0:
                raise ValueError(f"--target: {name.strip()}: a share must be >= 0, got {share}")
    if sum(out.values()) <= 0:
        raise ValueError("--target: the shares add up to 0")
    return out


def summarize_records(records: Sequence[Mapping], target_shares: Optional[Mapping] = None,
                      by: str = "tokens") -> dict:
    """The log in numbers: steps, fill, tokens per step, imbalance, deferral, each source's
    share of the run, and the mix (`mix`: `MixTally.summary()`, against the log's
    `target/<source>` keys, or `target_shares` when given)."""
    series = series_from_records(records, target_shares, by)
    out: dict = {"steps": len(series.steps)}
    if not len(series.steps):
        return out

    def stat(values: Optional[np.ndarray], how) -> Optional[float]:
        if values is None:
            return None
        values = values[np.isfinite(values)]
        return float(how(values)) if values.size else None

    out.update({
        "first_step": stat(series.steps, np.min), "last_step": stat(series.steps, np.max),
        "fill_mean": stat(series.fill, np.mean),
        "tokens_per_step_p50": stat(series.tokens, np.median),
        "tokens_total": stat(series.tokens, np.sum),
        "imbalance_mean": stat(series.imbalance, np.mean),
        "imbalance_max": stat(series.imbalance, np.max),
        "max_deferral": stat(series.deferral, np.max),
    })
    totals = series.units.sum(axis=0)
    N = float(totals.sum())
    out["unit"] = series.unit
    out["sources"] = {name: {"share": float(totals[s] / N) if N > 0 else 0.0,
                             series.unit: float(totals[s])}
                      for s, name in enumerate(series.names)}
    out["mix"] = mix_from_records(records, series).summary()
    return out


def mix_from_records(records: Sequence[Mapping], series) -> MixTally:
    """The log's steps in a `MixTally`: units from the series (the job's tokens, where the log
    has them), the target from the series, the tail and run-outs from the records."""
    tally = MixTally(list(series.names))
    for i, record in enumerate(records):
        target = None
        if series.target is not None and np.isfinite(series.target[i]).all():
            target = series.target[i]
        ran_out = np.array([float(record.get(f"ran_out/{n}", 0.0)) > 0 for n in series.names],
                           dtype=bool)
        tally.add(int(record.get("epoch", 0)), int(series.steps[i]), series.units[i],
                  StepMix(target, float(record.get("tail", 0.0)) > 0, ran_out))
    return tally


def format_records_summary(summary: Mapping) -> list[str]:
    if not summary["steps"]:
        return ["no steps in the log"]

    def num(value, spec) -> str:
        return "n/a" if value is None else format(value, spec)

    lines = [f"{summary['steps']} steps ({num(summary['first_step'], '.0f')}.."
             f"{num(summary['last_step'], '.0f')}), "
             f"{num(summary['tokens_total'], ',.0f')} tokens",
             f"fill: mean {num(summary['fill_mean'], '.4f')}; tokens per step: p50 "
             f"{num(summary['tokens_per_step_p50'], ',.0f')}",
             f"imbalance: mean {num(summary['imbalance_mean'], '.4f')}, max "
             f"{num(summary['imbalance_max'], '.4f')}; max deferral "
             f"{num(summary['max_deferral'], '.0f')} step(s)"]
    if summary.get("sources"):
        lines.append(f"{summary['unit']} over the run: " + ", ".join(
            f"{name} {s[summary['unit']]:,.0f} ({s['share']:.4f})"
            for name, s in summary["sources"].items()))
        lines += format_mix(summary["mix"], summary["unit"])
        if summary["mix"]["sources"] and \
                next(iter(summary["mix"]["sources"].values()))["target"] is None:
            lines.append("  (no target in the log: a log written before targets were recorded; "
                         "--target NAME=SHARE,... sets one)")
    return lines


def run(args: argparse.Namespace) -> int:
    def fail(message: str, code: int) -> int:
        print(f"streamload report: {message}", file=sys.stderr)
        return code

    try:
        targets = parse_targets(args.target)
    except ValueError as exc:
        return fail(str(exc), 2)
    try:
        records = read_metrics(args.log)
    except OSError as exc:
        return fail(f"cannot read {args.log}: {exc.strerror or exc}", 2)
    except ValueError as exc:
        return fail(str(exc), 2)
    summary = summarize_records(records, targets, args.by)
    for line in format_records_summary(summary):
        print(line)
    if args.plot:
        try:
            plot_run(records, args.plot, target_shares=targets, by=args.by,
                     title=f"{args.log}: {summary['steps']} steps")
        except ImportError as exc:
            return fail(str(exc), 2)
        print(f"plot: {args.plot}")
    return 0
