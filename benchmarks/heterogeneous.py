"""Heterogeneous sources: does every source's buffer stay fed?

    python benchmarks/heterogeneous.py            # 200 steps at 100 ms of simulated compute
    python benchmarks/heterogeneous.py --small    # 80 steps, for a smoke run

Three sources with equal weights, served by one moto S3 server on 127.0.0.1 (its own process):
  heavy   every document costs 20 ms to transform: the loader has one tokenizer for all sources,
          and ours spends 20 ms (time.sleep by default: a tokenizer that releases the GIL;
          --busy spins the CPU holding the GIL instead) on documents that start with a marker,
          which only this source's documents carry
  laggy   read through a proxy (same server process) that holds every request for 100 ms
          before forwarding it: about 100 ms more time to first byte per request
  normal  as is

A simulated trainer takes --step-ms of compute per step (time.sleep, so the loader has the CPU).
For every step we record how long next() blocked (our own timing) and the loader's cumulative
stats()["stall_s"], and every step we sample each source's buffer fill (buffer_tokens /
buffer_capacity_tokens). After --warmup-steps, a step "waited on data" when next() blocked
longer than --wait-threshold-ms (default 5 ms: a next() with a batch ready takes tens of µs, but
up to CPython's 5 ms GIL switch interval when a loader thread holds the GIL; waits over 1 ms
are counted too).

stderr: a fill timeline per source and a summary. Last line on stdout: JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _corpus  # noqa: E402
from _corpus import log  # noqa: E402
from _options import add_loader_options, loader_options  # noqa: E402
from _moto import MotoServer, apply_env  # noqa: E402

MARKER = "\u00a7HEAVY\u00a7 "
BUCKET = "bench"


def make_tokenizer(cost_s: float, busy: bool):
    import numpy as np

    def tokenize(text: str):
        if text.startswith(MARKER):
            if busy:
                end = time.perf_counter() + cost_s
                while time.perf_counter() < end:
                    pass
            else:
                time.sleep(cost_s)
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    return tokenize


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "streamload-bench"))
    ap.add_argument("--steps", type=int, default=None, help="default 200 (80 with --small)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="default 20 (10 with --small)")
    ap.add_argument("--step-ms", type=float, default=100.0, help="simulated compute per step")
    ap.add_argument("--transform-ms", type=float, default=20.0, help="heavy source, per document")
    ap.add_argument("--first-byte-ms", type=float, default=100.0, help="laggy source, per request")
    ap.add_argument("--busy", action="store_true", help="heavy transform spins holding the GIL")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--wait-threshold-ms", type=float, default=5.0,
                    help="a step waited on data if next() blocked longer (default 5 ms, CPython's "
                         "GIL switch interval: a ready batch can take that long to hand over "
                         "while a loader thread holds the GIL)")
    add_loader_options(ap)
    args = ap.parse_args(argv)
    steps = args.steps or (80 if args.small else 200)
    warmup = args.warmup_steps if args.warmup_steps is not None else (10 if args.small else 20)
    C, M = args.micro_batch_tokens, args.micro_batches
    opts = loader_options(args.sl_opt, planner="naive")

    # Enough data that no source runs dry: steps * C * M tokens, a third per source, twice over.
    per_source_mb = max(2.0, round(steps * C * M / 3 / 1e6 * 2, 1))
    info = _corpus.hetero_corpus(args.workdir, per_source_mb, 1.0, MARKER)

    import streamload as sl
    with MotoServer(delay_s=args.first_byte_ms / 1e3) as s3:
        n, size = s3.upload_dir(Path(info.root) / "jsonl", BUCKET, "jsonl/")
        log(f"moto on {s3.endpoint_url} (delaying proxy {s3.delayed_url}): {n} objects, "
            f"{size / 1e6:.1f} MB")
        apply_env(s3.env)
        lagged = {**s3.storage_options, "endpoint_url": s3.delayed_url}
        sources = [
            sl.Source(f"s3://{BUCKET}/jsonl/heavy/", weight=1.0, name="heavy"),
            sl.Source(f"s3://{BUCKET}/jsonl/laggy/", weight=1.0, name="laggy",
                      storage_options=lagged),
            sl.Source(f"s3://{BUCKET}/jsonl/normal/", weight=1.0, name="normal"),
        ]
        try:
            from streamload.config import LoaderConfig
            unknown = sorted(set(opts) - set(LoaderConfig.__struct_fields__))
            for k in unknown:
                log(f"streamload does not know option {k!r}; dropped")
                opts.pop(k)
        except Exception:
            pass
        tokenizer = make_tokenizer(args.transform_ms / 1e3, args.busy)
        waits, stalls, timeline = [], [], []
        names = [s.name for s in sources]
        t0 = time.perf_counter()
        first = None
        with sl.Loader(sources, micro_batch_tokens=C, micro_batches=M, tokenizer=tokenizer,
                       epochs=None, seed=0, storage_options=s3.storage_options,
                       **opts) as loader:
            it = iter(loader)
            delivered = {n: 0 for n in names}
            for step in range(steps):
                started = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    log(f"loader ended at step {step}")
                    break
                waits.append(time.perf_counter() - started)
                if first is None:
                    first = time.perf_counter() - t0
                stats = loader.stats()
                stalls.append(stats.get("stall_s"))
                for mb in batch.micro_batches:
                    b = mb.cu_seqlens.tolist()
                    for sid, lo, hi in zip(mb.sample_ids, b, b[1:]):
                        src = sid.split("/", 1)[0]
                        delivered[src] = delivered.get(src, 0) + hi - lo
                row = {"step": step, "t": round(time.perf_counter() - t0, 3),
                       "wait_ms": round(waits[-1] * 1e3, 3)}
                for name in names:
                    s = (stats.get("sources") or {}).get(name, {})
                    cap = s.get("buffer_capacity_tokens")
                    row[name] = round(s["buffer_tokens"] / cap, 3) if cap else s.get("buffer_tokens")
                timeline.append(row)
                time.sleep(args.step_ms / 1e3)          # the trainer's compute
            final = loader.stats()
        elapsed = time.perf_counter() - t0

    after = waits[warmup:]
    threshold = args.wait_threshold_ms / 1e3
    waited = [warmup + i for i, w in enumerate(after) if w > threshold]
    over_1ms = sum(1 for w in after if w > 1e-3)
    stall_after = (stalls[-1] - stalls[warmup - 1]) if len(stalls) > warmup and warmup > 0 \
        and stalls[-1] is not None else (stalls[-1] if stalls else None)

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    # stderr: timeline every ~5% of the run, then a summary
    p = lambda s="": print(s, file=sys.stderr)  # noqa: E731
    p()
    p("buffer fill per source (buffer_tokens / capacity) and next() wait:")
    p(f"{'step':>5} {'t (s)':>7} {'wait ms':>9} " + " ".join(f"{n:>7}" for n in names))
    every = max(1, len(timeline) // 20)
    for row in timeline[::every] + ([timeline[-1]] if timeline and (len(timeline) - 1) % every else []):
        p(f"{row['step']:>5} {row['t']:>7.2f} {row['wait_ms']:>9.2f} "
          + " ".join(f"{row[n]:>7.2f}" if isinstance(row[n], (int, float)) else f"{'?':>7}"
                     for n in names))
    p()
    total_delivered = sum(delivered.values()) or 1
    p(f"steps {len(waits)}, warm-up {warmup}, compute {args.step_ms:g} ms/step, "
      f"first batch {first:.2f} s, run {elapsed:.1f} s")
    if after:
        p(f"after warm-up: next() wait median {statistics.median(after) * 1e3:.3f} ms, "
          f"p99 {pct(after, 0.99) * 1e3:.2f} ms, max {max(after) * 1e3:.2f} ms; "
          f"steps that waited > {args.wait_threshold_ms:g} ms: {len(waited)}"
          + (f" (steps {waited[:20]}{' ...' if len(waited) > 20 else ''})" if waited else "")
          + f"; over 1 ms: {over_1ms}")
    p(f"stall_s (loader stats) total {final.get('stall_s')}, after warm-up {stall_after}")
    p("delivered token mix: " + ", ".join(f"{k} {v / total_delivered:.2f}"
                                           for k, v in delivered.items()))
    per_source = {}
    for name in names:
        s = (final.get("sources") or {}).get(name, {})
        per_source[name] = {k: _jsonable(v) for k, v in s.items()}
        p(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in s.items()
                                    if k not in ("skip_reasons",)))
    extra = {k: _jsonable(v) for k, v in final.items() if k != "sources"}
    p("  loader: " + ", ".join(f"{k}={v}" for k, v in extra.items()))

    out = {
        "steps": len(waits), "warmup_steps": warmup, "step_compute_ms": args.step_ms,
        "first_batch_s": round(first, 3) if first is not None else None,
        "wait_ms_after_warmup": {
            "median": round(statistics.median(after) * 1e3, 4) if after else None,
            "p90": round(pct(after, 0.9) * 1e3, 4) if after else None,
            "p99": round(pct(after, 0.99) * 1e3, 4) if after else None,
            "max": round(max(after) * 1e3, 4) if after else None},
        "steps_waited_after_warmup": len(waited),
        "steps_over_1ms_after_warmup": over_1ms,
        "waited_after_warmup": bool(waited),
        "waited_steps": waited,
        "stall_s_total": final.get("stall_s"), "stall_s_after_warmup": stall_after,
        "delivered_mix": {k: round(v / total_delivered, 3) for k, v in delivered.items()},
        "fill_timeline": timeline,
        "sources": per_source, "loader": extra,
        "config": {"micro_batch_tokens": C, "micro_batches": M, "transform_ms": args.transform_ms,
                   "first_byte_ms": args.first_byte_ms, "busy": args.busy,
                   "wait_threshold_ms": args.wait_threshold_ms, "options": opts,
                   "per_source_mb": per_source_mb},
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
