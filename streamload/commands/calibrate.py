"""`streamload calibrate`: measure the cost model's a and b on the current device.

It times forward plus backward of a transformer block (real `scaled_dot_product_attention`,
document masking) over packed rows. Rows of the same total length hold different mixes of
document lengths (1 document of T tokens, 2 of about T/2, ..., T/64 of about 64, and one mixed
row), so they do the same linear work and different attention work; rows of different total
lengths (T, T/2, T/4) separate the linear part from a per-row constant. The documents of a row
have distinct lengths (T/2 - 1 and T/2 + 1, ...; `--equal-lengths` for exact ones), as real
data has: `doc_attention` batches a run of equal lengths into one call, so equal lengths would
time a cheaper kernel than real rows get. Then it fits

    time(row) = a · Σ L² + b · Σ L + c        (sums over the row's documents)

by least squares, prints each row's measured and predicted time and the relative residuals,
and prints the fit as a JSON object on its last line. `--output FILE` writes {"a", "b",
"document_masking"} for `CostModel.load(FILE)` (or `CostModel(**json.load(f))`). The constant c
is reported but not kept: every rank runs the same number of rows, so it cannot change the
balance.

Document masking. Attention must not cross document boundaries inside a packed row. Two ways
to do that with SDPA:

* one dense call with a block-diagonal causal boolean `attn_mask` built from cu_seqlens. It
  is simple, but the kernel still computes (or at least visits) the whole T×T square, so its
  cost grows with T² whatever the documents are. It would measure the wrong thing, and it is
  not what a production trainer does;
* one causal SDPA call per document, which does only Σ L² work, like the varlen
  flash-attention kernels that production trainers use. This is what `doc_attention` does. It
  batches consecutive documents of equal length into one call on a view of the row, so a row of
  64 documents of 64 tokens is one SDPA call and not 64, and it falls back to gathering equal
  lengths together when a row has very many distinct runs. The result is exactly that of the
  block-diagonal mask (tests check it against `document_mask`). On CUDA, a varlen
  flash-attention kernel would do the same work in one call; SDPA per document keeps one code
  path that runs on the CPU too.

What one a cannot capture. A real kernel's attention cost is not exactly a·L²: PyTorch's CPU
flash-attention kernel tiles the square in blocks whose size changes with L, so (issue 20,
`benchmarks/train_step.py`'s 2-layer d_model = 128 model, forward plus backward, one thread) a
document costs about 12 ns·L² below 256 tokens, 30 ns·L² at 256 to 512, 25 at 768, 19 at 2048
and 15 at 4096. The fit is a compromise over the lengths of its rows; a rank whose rows are
all mid-length documents runs up to about 15% above the prediction, one with documents of C
tokens a few % below (GPU kernels have tiles too). The rows' documents should span the
lengths of the data.

The a and b measured here are in seconds for `--layers` blocks (default 1). A model of n such
blocks costs about n times as much for both terms, which leaves the ratio a/b, and so the
plan, unchanged. This module imports torch; `streamload.plan` stays pure NumPy.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..plan.cost import CostModel


# ----------------------------------------------------------------------------------- fitting
@dataclass
class Fit:
    """A least-squares fit of time = a·ΣL² + b·ΣL + c."""
    a: float
    b: float
    c: float
    r2: float
    predicted: np.ndarray = field(repr=False)
    rel_residuals: np.ndarray = field(repr=False)   # (measured - predicted) / measured

    @property
    def max_rel_residual(self) -> float:
        return float(np.max(np.abs(self.rel_residuals))) if self.rel_residuals.size else 0.0

    def cost_model(self, document_masking: bool = True) -> CostModel:
        return CostModel.from_fit(self.a, self.b, document_masking=document_masking)


def fit_cost(sum_sq, sum_len, times, *, constant: bool = True, relative: bool = True) -> Fit:
    """Fit time = a·sum_sq + b·sum_len (+ c) with a, b, c >= 0.

    `relative=True` weights every row by 1/time, which minimises relative rather than absolute
    errors, so short rows count as much as long ones. Non-negativity is enforced exactly by
    trying every subset of the coefficients (at most 8 small least-squares problems) and
    keeping the best feasible one.
    """
    sum_sq = np.asarray(sum_sq, dtype=np.float64)
    sum_len = np.asarray(sum_len, dtype=np.float64)
    times = np.asarray(times, dtype=np.float64)
    n = times.shape[0]
    if not (sum_sq.shape == sum_len.shape == times.shape) or n == 0:
        raise ValueError("fit_cost: sum_sq, sum_len and times must be non-empty and of equal length")
    if np.any(times <= 0) or not np.all(np.isfinite(times)):
        raise ValueError("fit_cost: every time must be finite and > 0")
    columns = [sum_sq, sum_len] + ([np.ones(n)] if constant else [])
    X = np.stack(columns, axis=1)
    w = 1.0 / times if relative else np.ones(n)
    # Scale the columns so that lstsq is well conditioned (sum_sq is ~1e7, ones is 1).
    scale = np.maximum(np.abs(X).max(axis=0), 1e-300)
    Xs = X / scale
    k = X.shape[1]
    best, best_err = np.zeros(k), math.inf
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(Xs[:, cols] * w[:, None], times * w, rcond=None)
        if np.any(sol < 0):
            continue
        coef = np.zeros(k)
        coef[cols] = sol
        err = float(np.sum(((Xs @ coef - times) * w) ** 2))
        if err < best_err:
            best, best_err = coef, err
    coef = best / scale
    predicted = X @ coef
    ss_res = float(np.sum((times - predicted) ** 2))
    ss_tot = float(np.sum((times - times.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return Fit(a=float(coef[0]), b=float(coef[1]), c=float(coef[2]) if constant else 0.0,
               r2=r2, predicted=predicted, rel_residuals=(times - predicted) / times)


from .attention_model import (Block, Blocks, TinyTransformer, _torch, doc_attention,  # noqa: F401
                              document_mask)


# ----------------------------------------------------------------------------------- measuring
def resolve_device(name: str) -> str:
    torch = _torch()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"calibrate: --device {name} asked for, but CUDA is not available")
    return name


def synchronize(device: str) -> None:
    torch = _torch()
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def calibration_rows(totals, min_doc: int, distinct: bool = False) -> list[list[int]]:
    """For each total T: rows of T/L documents of L tokens (L = T, T/2, ..., >= min_doc), plus
    one mixed row (T/2, T/4, ..., min_doc, min_doc).

    `distinct=True` spreads the documents of each length in a row to distinct lengths with the
    same total (L-1, L+1, L-2, L+2, ..., and L itself when their count is odd), as in real
    packed rows. `doc_attention` makes one batched SDPA call of a run of equal lengths, so a
    row of k equal documents costs one call where k real documents cost k: rows of equal
    lengths measure a cheaper kernel than the data ever gets.
    """
    rows = []
    for T in totals:
        L = T
        while L >= min_doc:
            if T % L == 0:
                rows.append([L] * (T // L))
            L //= 2
        mixed, L = [], T // 2
        while L >= min_doc and sum(mixed) + L <= T:
            mixed.append(L)
            L //= 2
        if mixed and T - sum(mixed) > 0:
            mixed.append(T - sum(mixed))
            if len(set(mixed)) > 1:
                rows.append(mixed)
    return [spread(r) for r in rows] if distinct else rows


def spread(row: list[int]) -> list[int]:
    """The row with each group of n equal lengths L made distinct around L with the same sum:
    L-1, L+1, L-2, L+2, ... (and L when n is odd). Lengths stay >= 1."""
    out, seen = [], {}
    for L in row:
        j = seen.get(L, 0)
        seen[L] = j + 1
        out.append((j, L))
    counts = {L: n for L, n in seen.items()}
    result = []
    for j, L in out:
        n = counts[L]
        if n == 1 or (n % 2 and j == n - 1):
            result.append(L)
        else:
            result.append(L + (j // 2 + 1) * (1 if j % 2 else -1))
    if sum(result) != sum(row) or min(result) < 1:
        return list(row)     # too short to spread (documents of 1 or 2 tokens): keep them
    return result


def time_rows(model, rows, *, warmup: int = 1, repeats: int = 3, seed: int = 0,
              stat: str = "median", clock: str = "wall") -> list[float]:
    """Time forward+backward of each row: the median (or min) over `repeats` timed passes.

    `model` has `.device`, `make_input(row, generator)` and `step(x, lengths)`. Passes go
    round-robin over the rows, so slow drifts (clock, other load) spread over all rows instead
    of biasing some. `stat="min"` is the more robust choice on a machine shared with other work,
    since interference only ever adds time. `clock="cpu"` times with the calling thread's CPU
    time, which leaves out the time the thread sat descheduled by other load; it is only
    meaningful on the CPU device with one torch thread (the work then runs on this thread).
    """
    torch = _torch()
    if stat not in ("median", "min"):
        raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if clock == "cpu" and (str(model.device).startswith("cuda") or torch.get_num_threads() != 1):
        raise ValueError("clock='cpu' needs the CPU device and one torch thread (--threads 1)")
    now = time.perf_counter if clock == "wall" else time.thread_time
    gen = torch.Generator().manual_seed(seed)
    inputs = [model.make_input(r, gen) for r in rows]
    samples: list[list[float]] = [[] for _ in rows]
    for rep in range(warmup + max(repeats, 1)):
        for i, (row, x) in enumerate(zip(rows, inputs)):
            synchronize(model.device)
            t0 = now()
            model.step(x, row)
            synchronize(model.device)
            if rep >= warmup:
                samples[i].append(now() - t0)
    reduce = statistics.median if stat == "median" else min
    return [float(reduce(s)) for s in samples]


def fit_rows(rows, times, *, constant: bool = True) -> Fit:
    """`fit_cost` from rows given as lists of document lengths."""
    sum_len = np.array([sum(r) for r in rows], dtype=np.float64)
    sum_sq = np.array([sum(L * L for L in r) for r in rows], dtype=np.float64)
    return fit_cost(sum_sq, sum_len, times, constant=constant)


DEFAULTS = {
    # device kind -> (d_model, heads, totals, min_doc, dtype)
    "cpu": dict(d_model=256, heads=4, totals=[4096, 2048, 1024], min_doc=64, dtype="float32"),
    "cpu-quick": dict(d_model=256, heads=4, totals=[2048, 1024], min_doc=64, dtype="float32"),
    "cuda": dict(d_model=1024, heads=8, totals=[16384, 8192, 4096], min_doc=128, dtype="bfloat16"),
    "cuda-quick": dict(d_model=1024, heads=8, totals=[8192, 4096], min_doc=128, dtype="bfloat16"),
}


def describe(row) -> str:
    counts: dict[int, int] = {}
    for L in row:
        counts[L] = counts.get(L, 0) + 1
    return "+".join(f"{n}x{L}" if n > 1 else f"{L}" for L, n in sorted(counts.items(), reverse=True))


def calibrate(*, device: str = "auto", d_model: int | None = None, heads: int | None = None,
              ffn_mult: int = 4, layers: int = 1, totals=None, min_doc: int | None = None,
              dtype: str | None = None, warmup: int = 1, repeats: int = 3, quick: bool = False,
              threads: int | None = None, seed: int = 0, constant: bool = True,
              stat: str = "median", clock: str = "wall", distinct: bool = True) -> dict:
    """Measure and fit; returns the JSON-able record that `calibrate_main` prints last."""
    torch = _torch()
    device = resolve_device(device)
    kind = ("cuda" if device.startswith("cuda") else "cpu") + ("-quick" if quick else "")
    d = DEFAULTS[kind]
    d_model = d_model or d["d_model"]
    heads = heads or d["heads"]
    totals = list(totals or d["totals"])
    min_doc = min_doc or d["min_doc"]
    dtype_name = dtype or d["dtype"]
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        used_threads = torch.get_num_threads()
        torch.manual_seed(seed)
        model = Blocks(d_model, heads, ffn_mult, layers, device, getattr(torch, dtype_name))
        rows = calibration_rows(totals, min_doc, distinct=distinct)
        t0 = time.perf_counter()
        times = time_rows(model, rows, warmup=warmup, repeats=repeats, seed=seed, stat=stat,
                          clock=clock)
        elapsed = time.perf_counter() - t0
    finally:
        torch.set_num_threads(saved_threads)
    fit = fit_rows(rows, times, constant=constant)
    sum_sq = [sum(L * L for L in r) for r in rows]
    flops = CostModel.transformer(model.params(), layers, d_model)
    dev_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    return {
        "device": device, "device_name": dev_name, "dtype": dtype_name,
        "threads": used_threads, "stat": stat, "clock": clock,
        "repeats": repeats, "distinct_lengths": distinct,
        "d_model": d_model, "heads": heads, "ffn_mult": ffn_mult, "layers": layers,
        "a": fit.a, "b": fit.b, "c": fit.c, "r2": fit.r2,
        "max_rel_residual": fit.max_rel_residual,
        "crossover_length": fit.b / fit.a if fit.a > 0 else None,
        "flops_crossover_length": flops.crossover_length,
        "measure_s": elapsed,
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "rows": [{"docs": describe(r), "tokens": int(sum(r)), "num_docs": len(r),
                  "sum_sq": int(sq), "measured_s": float(t), "predicted_s": float(p),
                  "rel_residual": float(e)}
                 for r, sq, t, p, e in zip(rows, sum_sq, times, fit.predicted, fit.rel_residuals)],
    }


def format_table(result: dict) -> str:
    lines = [f"{'row (docs x len)':<34} {'tokens':>7} {'sum L^2':>12} {'measured ms':>12} "
             f"{'predicted ms':>13} {'rel resid':>10}"]
    for r in result["rows"]:
        docs = r["docs"] if len(r["docs"]) <= 34 else r["docs"][:31] + "..."
        lines.append(f"{docs:<34} {r['tokens']:>7} {r['sum_sq']:>12.4g} {r['measured_s'] * 1e3:>12.2f} "
                     f"{r['predicted_s'] * 1e3:>13.2f} {r['rel_residual']:>+10.2%}")
    lines.append("")
    lines.append(f"device {result['device']} ({result['device_name']}, {result['dtype']}, "
                 f"{result['threads']} threads), {result['layers']} block(s) d_model={result['d_model']} "
                 f"heads={result['heads']} ffn_mult={result['ffn_mult']}")
    lines.append("fit: time = a*sum(L^2) + b*sum(L) + c per row")
    lines.append(f"  a = {result['a']:.4e} s/token^2   b = {result['b']:.4e} s/token   c = {result['c']:.4e} s")
    lines.append(f"  R^2 = {result['r2']:.5f}   max |relative residual| = {result['max_rel_residual']:.2%}")
    co, fco = result["crossover_length"], result["flops_crossover_length"]
    lines.append(f"  attention = linear at L = b/a = {co:.0f} tokens (FLOP model: {fco:.0f})"
                 if co else "  a = 0: no attention cost visible at these lengths (or noisy timings)")
    load = result.get("loadavg_1m")
    if result["r2"] < 0.95 or result["max_rel_residual"] > 0.25:
        lines.append("warning: poor fit: the timings are noisy"
                     + (f" (1-minute load average {load:.1f} on {os.cpu_count()} CPUs)" if load else "")
                     + ". Rerun on a quiet machine, or with --stat min, or on the CPU with "
                       "--threads 1 --clock cpu.")
    return "\n".join(lines)


def calibrate_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="streamload calibrate",
        description="Measure the cost model's a (attention, per L^2) and b (per token) on this "
                    "device: time forward+backward of a transformer block over packed rows with "
                    "document masking, fit time = a*sum(L^2) + b*sum(L) + c by least squares.")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda if available)")
    p.add_argument("--d-model", type=int, default=None, help="model width (default 256 on CPU, 1024 on CUDA)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 4 on CPU, 8 on CUDA)")
    p.add_argument("--ffn-mult", type=int, default=4, help="MLP width multiple (default 4)")
    p.add_argument("--layers", type=int, default=1, help="blocks timed together (default 1)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="row lengths T to measure (default 4096 2048 1024 on CPU)")
    p.add_argument("--min-doc", type=int, default=None, help="shortest document length (default 64 on CPU)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--warmup", type=int, default=1, help="untimed passes over all rows (default 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes; median is kept (default 5, quick 3)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="per-row statistic over the repeats (default median; min resists other load)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall time (default), or this thread's CPU time (CPU device with --threads 1; "
                        "ignores time lost to other load)")
    p.add_argument("--no-constant", action="store_true", help="fit without the per-row constant c")
    p.add_argument("--equal-lengths", action="store_true",
                   help="rows of equal document lengths (one batched attention call per row) "
                        "instead of distinct lengths around them (one call per document, as "
                        "in real data; the default)")
    p.add_argument("--quick", action="store_true", help="smaller rows and fewer repeats (~10 s on 2 CPU cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", "-o", default=None,
                   help="write {a, b, document_masking} as JSON for CostModel.load()")
    args = p.parse_args(argv)
    try:
        result = calibrate(device=args.device, d_model=args.d_model, heads=args.heads,
                           ffn_mult=args.ffn_mult, layers=args.layers, totals=args.tokens,
                           min_doc=args.min_doc, dtype=args.dtype, warmup=args.warmup,
                           repeats=args.repeats or (3 if args.quick else 5), quick=args.quick,
                           threads=args.threads, seed=args.seed, constant=not args.no_constant,
                           stat=args.stat, clock=args.clock, distinct=not args.equal_lengths)
    except ValueError as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.output:
        CostModel.from_fit(result["a"], result["b"]).save(args.output)
        print(f"wrote {args.output}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(calibrate_main(sys.argv[1:]))
