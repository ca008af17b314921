"""The demo job: a multi-source corpus, an embedded S3 server, two gloo ranks, one epoch.

1. Generate the corpus (`corpus.py`) in a temporary directory, or in `--workdir`.
2. Start moto's S3 server on 127.0.0.1 and upload the S3 sources (`web`, `code`) to it.
3. Spawn the ranks. Each joins a gloo process group on 127.0.0.1 and iterates a `Loader` over
   all four sources for one epoch; rank 0 prints every step's tokens and predicted cost per rank.
4. Every rank sends the sample ids it received back to this process, which checks exactly-once
   delivery (the union over ranks is the whole corpus, with no duplicates) and prints a summary,
   then the same summary as one JSON line. The exit code is 1 when the check fails.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import queue as queue_module
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections import Counter

import numpy as np

from ...config import make_config
from ...observe import MetricsLog, read_metrics
from ...errors import ConfigError, StreamloadError
from . import corpus as corpus_module
from .report import (MAX_EMPTY_STEPS, fmt_count, print_corpus, print_header,
                     print_step, print_summary, should_print, summarize)

BUCKET = "streamload-demo"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plot", default="streamload-demo.png",
                   help="where to write the run's plot (mix, fill, balance, deferrals; needs "
                        "matplotlib); '' for none")
    p.add_argument("--workdir", default=None,
                   help="where to write the corpus (kept afterwards); default: a temporary "
                        "directory that is removed at the end")
    p.add_argument("--small", action="store_true",
                   help="a tiny corpus (about 200 KB) that runs in a few seconds (about 5 s "
                        "of CPU in all, most of it starting torch in the ranks)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every source's size by this (default 1: about 2.5M tokens)")
    p.add_argument("--planner", default="lookahead",
                   help="planning method passed to the Loader (default: lookahead, the "
                        "Loader's default)")
    p.add_argument("--micro-batch-tokens", type=int, default=4096, metavar="C",
                   help="token capacity of one packed row (default 4096)")
    p.add_argument("--micro-batches", type=int, default=2, metavar="M",
                   help="rows per rank per step (default 2)")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks to run (default 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many steps (default: the whole epoch)")
    p.add_argument("--seed", type=int, default=0, help="corpus and loader seed (default 0)")
    p.add_argument("--print-first", type=int, default=10, metavar="N",
                   help="print each of the first N steps (default 10)")
    p.add_argument("--print-every", type=int, default=None, metavar="K",
                   help="after those, print every K-th step (default: about 20 lines in all)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="give up when the ranks have not finished after this many seconds")


# --- the ranks -------------------------------------------------------------------------------

class DemoError(StreamloadError, RuntimeError):
    """The ranks failed or hung; the message holds what they reported."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, job: dict, results) -> None:
    """One rank: join the group, iterate the loader for an epoch, report what it received."""
    # A rank killed by SIGSEGV / SIGBUS / SIGABRT reports nothing; this at least leaves every
    # thread's Python stack on stderr (the demo's, which the tests show when they fail).
    faulthandler.enable(all_threads=True)
    for name, value in job["env"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        result = _iterate(rank, world, job)
        results.put((rank, "ok", result))
        if not result["stopped_early"]:
            dist.destroy_process_group()
        # The result is sent: leave now, without the interpreter's teardown. Tearing torch down
        # took 2-5 s per rank on a loaded 2-core machine, the longest part of `demo --small`
        # after importing torch. And a loader closed mid-epoch (`stopped_early`) may still have
        # a collective of its own in flight on its gloo group, whose teardown at exit aborts
        # the process with "terminate called without an active exception".
        sys.stdout.flush()
        sys.stderr.flush()
        results.close()
        results.join_thread()
        os._exit(0)
    except BaseException as exc:   # reported by the parent, which exits non-zero
        from streamload.errors import ConfigError
        message = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, ConfigError):   # a bad option needs no traceback
            message += "\n" + traceback.format_exc()
        results.put((rank, "error", message))


def _iterate(rank: int, world: int, job: dict) -> dict:

    import streamload as sl

    sources = [sl.Source(s["uri"], weight=s["weight"], name=s["name"], format=s["format"])
               for s in job["sources"]]
    names = [s.name for s in sources]
    C, M = job["micro_batch_tokens"], job["micro_batches"]
    ids: list[str] = []
    source_tokens = Counter()
    source_samples = Counter()
    imbalances: list[float] = []
    step_source_tokens: list[list[int]] = []      # [step][source] tokens this rank received
    job_tokens: list[int] = []                     # [step] the job's tokens
    rank_tokens_total = np.zeros(world)
    printed_last = -1
    last = None
    started = time.perf_counter()
    live = sys.stdout.isatty()   # a live progress line only on a terminal
    first_batch_s = None
    header_every = 25
    empty_steps = 0
    stalled = None
    stopped_early = False
    lines = 0
    metrics_log = MetricsLog(job["metrics_log"]) if rank == 0 and job.get("metrics_log") else None
    with sl.Loader(sources, micro_batch_tokens=C, micro_batches=M, seed=job["seed"], epochs=1,
                   planner=job["planner"], storage_options=job["storage_options"],
                   on_step=metrics_log) as loader:
        for batch in loader:
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - started
            this_step = [0] * len(names)
            for mb in batch.micro_batches:
                if mb.num_tokens > C:
                    raise AssertionError(f"step {batch.step}: a row holds {mb.num_tokens} > {C} tokens")
                lengths = np.diff(mb.cu_seqlens.numpy()).tolist()
                for sid, n in zip(mb.sample_ids, lengths):
                    ids.append((sid, n))
                    source = sid.split("/", 1)[0]
                    source_tokens[source] += n
                    source_samples[source] += 1
                    this_step[names.index(source)] += n
            step_source_tokens.append(this_step)
            if len(batch.micro_batches) != M:
                raise AssertionError(f"step {batch.step}: {len(batch.micro_batches)} rows, not {M}")
            imbalances.append(batch.imbalance)
            job_tokens.append(int(batch.rank_tokens.sum()))
            # Every rank sees the same rank_tokens, so every rank stops at the same step.
            empty_steps = empty_steps + 1 if not batch.rank_tokens.any() else 0
            rank_tokens_total += batch.rank_tokens
            last = batch
            if rank == 0 and should_print(batch.step, job):
                if live:
                    print("\r\x1b[2K", end="")   # clear the live progress line
                if lines % header_every == 0:
                    print_header(world)
                print_step(batch, rank_tokens_total.sum(), time.perf_counter() - started)
                printed_last = batch.step
                lines += 1
            elif rank == 0 and live:   # a terminal: one live progress line between table rows
                rate = rank_tokens_total.sum() / max(time.perf_counter() - started, 1e-9)
                print(f"\r  step {batch.step:>6} | {fmt_count(rate)} tokens/s | "
                      f"imbalance {batch.imbalance:.3f} | deferral {batch.max_deferral}",
                      end="", flush=True)
            if job["steps"] is not None and batch.step + 1 >= job["steps"]:
                stopped_early = True
                break
            if empty_steps >= MAX_EMPTY_STEPS:
                stalled = batch.step
                stopped_early = True
                if rank == 0:
                    print(f"{'':>6}   {MAX_EMPTY_STEPS} steps in a row delivered nothing: "
                          f"stopping (the loader is stuck)", flush=True)
                break
        stats = loader.stats()
        loader_summary = loader.summary()
    elapsed = time.perf_counter() - started
    if rank == 0 and live:
        print("\r\x1b[2K", end="")
    if rank == 0 and last is not None and printed_last != last.step:
        print_step(last, rank_tokens_total.sum(), elapsed)
    return {
        "rank": rank, "ids": ids, "steps": len(imbalances), "imbalances": imbalances,
        "source_tokens": dict(source_tokens), "source_samples": dict(source_samples),
        "tokens": int(sum(source_tokens.values())), "loader_s": elapsed,
        "first_batch_s": first_batch_s, "stats": stats, "sources": names,
        "stalled_at_step": stalled, "stopped_early": stopped_early,
        "all_rank_tokens": rank_tokens_total.tolist(), "step_source_tokens": step_source_tokens,
        "loader_summary": loader_summary, "job_tokens": job_tokens,
    }


def _predict(corpus, workdir: str, C: int, M: int, world: int, args) -> list[int]:
    """The job's tokens per step, as `streamload plan` predicts them (the same step machine on
    the corpus's scanned lengths, from its local copy: the shard names are the same)."""
    from ..dryrun import scan, simulate
    from ...configfile import load_config
    path = os.path.join(workdir, "demo.toml")
    with open(path, "w") as f:
        f.write(f'[loader]\nmicro_batch_tokens = {C}\nmicro_batches = {M}\nepochs = 1\n'
                f'seed = {args.seed}\nplanner = "{args.planner}"\n')
        for s in corpus.sources:
            f.write(f'[[source]]\nuri = "{s.local_dir}/"\nname = "{s.name}"\nweight = {s.weight}\n')
    spec = load_config(path)
    steps = args.steps if args.steps is not None else 10 ** 9
    return [int(r.tokens.sum()) for r in simulate(spec, scan(spec), steps=steps, ranks=world)]


def _write_plot(path: str, metrics_log: str, corpus) -> None:
    """The run's plot from rank 0's metrics log, and where it went."""
    if not path:
        return
    from ..plots import plot_run
    total = sum(s.weight for s in corpus.sources)
    try:
        plot_run(read_metrics(metrics_log), path,
                 target_shares={s.name: s.weight / total for s in corpus.sources})
    except ImportError as exc:   # matplotlib is an optional extra
        print(f"no plot: {exc}")
        return
    print(f"plot of the run (mix, fill, balance, deferrals): {os.path.abspath(path)}")


def _describe_exit(code: int) -> str:
    """"exit code 1", or "killed by SIGBUS (exit code -7)" for a process a signal ended."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exit code {code}"


def _run_ranks(world: int, job: dict, timeout: float) -> list[dict]:
    # The standard library's: the ranks send back plain data, and this process (moto, the dry
    # run, the summary) never imports torch, which would put seconds before the ranks start.
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, job, results), daemon=True,
                         name=f"streamload-demo-rank{r}") for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, status, value = results.get(timeout=1.0)
                out[rank] = (status, value)
                if status != "ok":   # the others should fail soon too; do not wait for long
                    deadline = min(deadline, time.monotonic() + 30.0)
                continue
            except queue_module.Empty:
                pass
            if time.monotonic() > deadline:
                if any(status != "ok" for status, _ in out.values()):
                    break
                raise DemoError(f"the ranks did not finish within {timeout:g} s")
            dead = [p for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
            if dead:
                time.sleep(1.0)   # a report may still be in flight
                while True:
                    try:
                        rank, status, value = results.get_nowait()
                        out[rank] = (status, value)
                    except queue_module.Empty:
                        break
                silent = [f"rank {r} ({_describe_exit(p.exitcode)})" for r, p in enumerate(procs)
                          if r not in out and p.exitcode is not None]
                if silent:
                    raise DemoError(f"{', '.join(silent)} exited without reporting")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failed = {r: v for r, (s, v) in out.items() if s != "ok"}
    if failed:
        first = min(failed)
        lines = [f"rank {first} failed:\n{failed[first]}"]
        for r, message in sorted(failed.items()):
            if r != first:
                lines.append(f"rank {r} failed: {message.splitlines()[0]}")
        lines += [f"rank {r} did not report" for r in range(world) if r not in out]
        raise DemoError("\n".join(lines))
    return [out[r][1] for r in range(world)]


# --- the job ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    C, M, world = args.micro_batch_tokens, args.micro_batches, args.ranks
    for key, value in (("--micro-batch-tokens", C), ("--micro-batches", M), ("--ranks", world)):
        if value < 1:
            print(f"streamload demo: {key} must be >= 1", file=sys.stderr)
            return 2
    try:   # the loader's own validation, before a corpus is made and ranks are started
        make_config(micro_batch_tokens=C, micro_batches=M, planner=args.planner)
    except ConfigError as exc:
        print(f"streamload demo: {exc}", file=sys.stderr)
        return 2
    workdir = os.path.abspath(args.workdir) if args.workdir else \
        tempfile.mkdtemp(prefix="streamload-demo-")
    try:
        corpus = corpus_module.generate(os.path.join(workdir, "corpus"), scale=args.scale,
                                        small=args.small, seed=args.seed, capacity=C)
        print_corpus(corpus, C)
        from .s3server import ServerUnavailable, local_s3, require_server

        try:
            require_server()
        except ServerUnavailable as exc:
            print(f"streamload demo: {exc}", file=sys.stderr)
            return 2
        with local_s3() as s3:
            for s in corpus.sources:
                if s.location == "s3":
                    s.uri = f"s3://{BUCKET}/{s.name}/"
                    n = s3.upload_dir(s.local_dir, s.uri)
                    print(f"uploaded {n} objects to {s.uri} on the embedded S3 server "
                          f"{s3.endpoint_url}")
                else:
                    s.uri = s.local_dir + "/"
            step_tokens = world * M * C
            predicted = _predict(corpus, workdir, C, M, world, args)
            est_steps = len(predicted)
            print_every = args.print_every or max(1, math.ceil(
                max(0, est_steps - args.print_first) / 10))
            job = {
                "sources": [{"uri": s.uri, "name": s.name, "weight": s.weight, "format": s.format}
                            for s in corpus.sources],
                "storage_options": {"endpoint_url": s3.endpoint_url},   # for the s3:// sources
                "micro_batch_tokens": C, "micro_batches": M, "seed": args.seed,
                "planner": args.planner, "steps": args.steps, "print_first": args.print_first,
                "print_every": print_every, "env": s3.env,
                "metrics_log": os.path.join(workdir, "metrics.jsonl"),
            }
            print(f"running {world} gloo ranks: C={C} tokens per row, M={M} rows per rank, "
                  f"planner={args.planner!r}; the dry run (streamload plan) predicts {est_steps} "
                  f"steps of up to {step_tokens:,} tokens",
                  flush=True)
            try:
                ranks = _run_ranks(world, job, args.timeout)
            except DemoError as exc:
                print(f"streamload demo: {exc}", file=sys.stderr)
                return 1
        wall = time.perf_counter() - started
        summary = summarize(corpus, ranks, args, wall)
        summary["predicted_steps"] = len(predicted)
        # The dry run drives the loader's own step machine: every step's tokens should match.
        summary["prediction_matches"] = predicted == ranks[0]["job_tokens"]
        print_summary(summary)
        print(f"  prediction     the dry run predicted {len(predicted)} steps: "
              + ("every step's tokens as run" if summary["prediction_matches"] else
                 f"DIFFERENT from the run's {summary['steps']} steps"))
        print(ranks[0]["loader_summary"])
        _write_plot(args.plot, job["metrics_log"], corpus)
        print(json.dumps(summary), flush=True)
        return 0 if summary["ok"] else 1
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


