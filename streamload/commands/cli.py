"""The `streamload` command.

    streamload demo [--small] [--planner NAME] ...   a multi-source job on 2 gloo ranks
    streamload inspect URI [--format jsonl|tokens]   a source's shards, counts, length histogram
    streamload calibrate [...]                       measure the cost model on this device
    streamload plan CONFIG.toml --steps N [--ranks R] [--plot OUT.png]
                                                     dry-run a configuration's plan (lengths only)
    streamload report METRICS.jsonl [--plot OUT.png] a run's metrics log in numbers and a plot

Each subcommand lives in its own module and is imported only when it runs, so `streamload
inspect` does not pay for torch.multiprocessing and a missing optional piece breaks only the
subcommand that needs it.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _demo(args: argparse.Namespace) -> int:
    from .demo.run import run
    return run(args)


def _inspect(args: argparse.Namespace) -> int:
    from .inspection import run
    return run(args)


def _plan(args: argparse.Namespace) -> int:
    from .dryrun import run
    return run(args)


def _report(args: argparse.Namespace) -> int:
    from .report import run
    return run(args)


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    # Here rather than in dryrun.py, so that building the parser does not import the planner.
    parser.add_argument("config", metavar="CONFIG.toml", help="the configuration file")
    parser.add_argument("--steps", type=int, default=100, help="steps to plan (default 100)")
    parser.add_argument("--ranks", type=int, default=8,
                        help="data-parallel ranks R to plan for (default 8)")
    parser.add_argument("--planner", metavar="NAME", default=None,
                        help="the planner to plan with (naive, balanced, lookahead), instead "
                             "of the configuration file's")
    parser.add_argument("--max-docs", type=int, default=None, metavar="K",
                        help="read at most K documents per source (a sample, repeated as "
                             "needed); default: every document")
    parser.add_argument("--every", type=int, default=1, metavar="K",
                        help="print every K-th step in the table (default 1)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON line with the summary and every step, no table")
    parser.add_argument("--plot", metavar="OUT.png", default=None,
                        help="also draw the plan per step into a PNG: mix against the target, "
                             "fill, balance, deferral (needs matplotlib: "
                             "pip install streamload[plot])")


def _calibrate(argv: Sequence[str]) -> int:
    try:
        from .calibrate import calibrate_main
    except ImportError as exc:
        print(f"streamload calibrate is not available: {exc}", file=sys.stderr)
        return 2
    result = calibrate_main(list(argv))
    return int(result or 0)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="streamload",
        description="Multi-source streaming data loader that balances compute cost across "
                    "data-parallel ranks.")
    parser.add_argument("--version", action="version", version=f"streamload {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from .demo.run import add_arguments as demo_arguments
    demo = sub.add_parser(
        "demo", help="run a small multi-source job (embedded S3 server, 2 gloo ranks)",
        description="Generate a small multi-source corpus with long-tailed lengths (web and code "
                    "on an embedded moto S3 server on 127.0.0.1, books and math on local disk), "
                    "stream one epoch on 2 gloo ranks, print per-step tokens and predicted cost "
                    "per rank, and check that every sample arrived exactly once.")
    demo_arguments(demo)
    demo.set_defaults(handler=_demo)

    from .inspection import add_arguments as inspect_arguments
    inspect = sub.add_parser(
        "inspect", help="list a source's shards, record counts and a length histogram",
        description="List the shards of a source URI (local path, file://, s3://, a prefix, "
                    "directory or glob) and read them: record counts, token counts and a "
                    "histogram of document lengths (tokens = UTF-8 bytes for text).")
    inspect_arguments(inspect)
    inspect.set_defaults(handler=_inspect)

    plan = sub.add_parser(
        "plan", help="dry-run a configuration: realized mix and balance per step, no training",
        description="Read only the sources' lengths (token shards: their offsets index; JSONL: "
                    "a fast length scan) and run the loader's planning loop on them for N "
                    "steps: the mixture's quotas, the planner, the head windows. Prints the "
                    "realized mix against the target and the cost balance across ranks per "
                    "step, a summary, and the summary as a JSON last line. Exit status 2 for "
                    "a configuration error.")
    _plan_arguments(plan)
    plan.set_defaults(handler=_plan)

    from .report import add_arguments as report_arguments
    report = sub.add_parser(
        "report", help="summarize a run's metrics log and plot it",
        description="Read a metrics log (one JSON record per step, written by "
                    "streamload.observe.MetricsLog) and print the run in a few lines: steps, "
                    "fill, tokens per step, imbalance, deferral, the realized mix against the "
                    "target when known. With --plot, draw it into a PNG.")
    report_arguments(report)
    report.set_defaults(handler=_report)

    # Parsed by calibrate_main itself; listed here for --help.
    sub.add_parser("calibrate", add_help=False,
                   help="measure the cost model's a and b on this device "
                        "(streamload calibrate --help)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "calibrate":
        return _calibrate(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # `streamload inspect ... | head`
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
