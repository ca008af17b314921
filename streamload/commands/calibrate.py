"""`streamload calibrate`: measure the cost model's a and b on the current device.

It times forward plus backward of a transformer block (real `scaled_dot_product_attention`,
document masking) over packed rows. Rows of the same total length hold different mixes of
document lengths (1 document of T tokens, 2 of T/2, ..., T/64 of 64, and one mixed row), so
they do the same linear work and different attention work; rows of different total lengths
(T, T/2, T/4) separate the linear part from a per-row constant. Then it fits

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

The a and b measured here are in seconds for `--layers` blocks (default 1). A model of n such
blocks costs about n times as much for both terms, which leaves the ratio a/b, and so the
plan, unchanged. This module imports torch; `streamload.plan` stays pure NumPy.
"""
from __future__ import annotations

import argparse
import functools
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


# ----------------------------------------------------------------------------------- model
def _torch():
    import torch
    return torch


def document_mask(lengths, device=None):
    """Boolean [T, T] block-diagonal causal mask (True = may attend), from document lengths.

    Reference only: `doc_attention` gives the same result without the T×T work.
    """
    torch = _torch()
    lengths = torch.as_tensor(list(lengths), dtype=torch.long, device=device)
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    pos = torch.arange(doc.numel(), device=device)
    return (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])


def _runs(lengths: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive equal lengths: (start token, length, count)."""
    runs, start = [], 0
    for L in lengths:
        if runs and runs[-1][1] == L:
            s0, _, n = runs[-1]
            runs[-1] = (s0, L, n + 1)
        else:
            runs.append((start, L, 1))
        start += L
    return runs


def doc_attention(q, k, v, lengths, causal: bool = True, max_calls: int = 32):
    """Attention within each document of a packed row. q, k, v: [T, H, hd]; returns [T, H, hd].

    The work is Σ L², not T². Consecutive documents of equal length are one batched SDPA call
    on a view of the row (no copy); a row with more than `max_calls` such runs instead stacks
    all documents of equal length with a gather, so the number of calls is the number of
    distinct lengths.
    """
    torch = _torch()
    F = torch.nn.functional
    lengths = [int(x) for x in lengths]
    T, H, hd = q.shape
    if sum(lengths) != T:
        raise ValueError(f"doc_attention: document lengths sum to {sum(lengths)}, row has {T} tokens")

    def attend(qs, ks, vs, n, L):
        qs, ks, vs = (x.reshape(n, L, H, hd).transpose(1, 2) for x in (qs, ks, vs))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        return out.transpose(1, 2).reshape(n * L, H, hd)

    runs = _runs(lengths)
    if len(runs) == 1:
        return attend(q, k, v, runs[0][2], runs[0][1])
    if len(runs) <= max_calls:
        return torch.cat([attend(q[s:s + n * L], k[s:s + n * L], v[s:s + n * L], n, L)
                          for s, L, n in runs], 0)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    arr = np.asarray(lengths)
    parts, perm = [], []
    for L in sorted(set(lengths), reverse=True):
        group = starts[arr == L]
        idx = (group[:, None] + np.arange(L)[None, :]).reshape(-1)
        perm.append(idx)
        it = torch.as_tensor(idx, device=q.device)
        parts.append(attend(q.index_select(0, it), k.index_select(0, it), v.index_select(0, it),
                            group.shape[0], L))
    inverse = np.empty(T, dtype=np.int64)
    inverse[np.concatenate(perm)] = np.arange(T)
    return torch.cat(parts, 0).index_select(0, torch.as_tensor(inverse, device=q.device))


@functools.lru_cache(maxsize=None)
def _build_modules():
    torch = _torch()
    nn = torch.nn

    class Block(nn.Module):
        """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)). Input [T, d]."""

        def __init__(self, d_model: int, heads: int, ffn_mult: int = 4):
            super().__init__()
            if d_model % heads:
                raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
            self.heads = heads
            self.ln1 = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
            self.proj = nn.Linear(d_model, d_model, bias=False)
            self.ln2 = nn.LayerNorm(d_model)
            self.up = nn.Linear(d_model, ffn_mult * d_model, bias=False)
            self.down = nn.Linear(ffn_mult * d_model, d_model, bias=False)

        def forward(self, x, lengths):
            T, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(T, 3, self.heads, d // self.heads).unbind(1)
            x = x + self.proj(doc_attention(q, k, v, lengths).reshape(T, d))
            return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))

    class TinyTransformer(nn.Module):
        """Embedding, n blocks, final norm and output head; loss is next-token cross-entropy."""

        def __init__(self, vocab: int, d_model: int, heads: int, ffn_mult: int, n_layers: int):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.blocks = nn.ModuleList(Block(d_model, heads, ffn_mult) for _ in range(n_layers))
            self.ln = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)
            self.d_model, self.n_layers = d_model, n_layers

        def compute_params(self) -> int:
            """Parameters every token multiplies through (all but the embedding lookup)."""
            return sum(p.numel() for n, p in self.named_parameters() if not n.startswith("embed."))

        def cost_model(self, document_masking: bool = True) -> CostModel:
            return CostModel.transformer(self.compute_params(), self.n_layers, self.d_model,
                                         causal=True, document_masking=document_masking)

        @property
        def device(self):
            return str(self.head.weight.device)

        def make_input(self, row, generator):
            tokens = torch.randint(0, self.head.out_features, (sum(row),), generator=generator)
            return tokens.to(self.head.weight.device)

        def step(self, tokens, lengths):
            """One forward plus backward of a packed row; gradients accumulate."""
            self(tokens, lengths).backward()

        def forward(self, tokens, lengths):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, lengths)
            logits = self.head(self.ln(x))
            return torch.nn.functional.cross_entropy(logits[:-1].float(), tokens[1:])

    return Block, TinyTransformer


def Block(d_model: int, heads: int, ffn_mult: int = 4):
    return _build_modules()[0](d_model, heads, ffn_mult)


def TinyTransformer(vocab: int, d_model: int, heads: int, ffn_mult: int = 4, n_layers: int = 2):
    return _build_modules()[1](vocab, d_model, heads, ffn_mult, n_layers)


class Blocks:
    """`n_layers` blocks applied to a [T, d] input; what calibrate times.

    Anything with `make_input(row, generator)` and `step(x, lengths)` (one forward plus
    backward of a packed row) can be timed by `time_rows`; the train_step benchmark times its
    whole model that way.
    """

    def __init__(self, d_model, heads, ffn_mult, n_layers, device, dtype):
        torch = _torch()
        self.layers = torch.nn.ModuleList(Block(d_model, heads, ffn_mult) for _ in range(n_layers))
        self.layers.to(device=device, dtype=dtype)
        self.d_model, self.device, self.dtype = d_model, device, dtype

    def params(self) -> int:
        return sum(p.numel() for p in self.layers.parameters())

    def make_input(self, row, generator):
        torch = _torch()
        return torch.randn(sum(row), self.d_model, generator=generator).to(self.device, self.dtype)

    def step(self, x, lengths):
        for p in self.layers.parameters():
            p.grad = None
        y = x
        for layer in self.layers:
            y = layer(y, lengths)
        y.float().square().mean().backward()


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


def calibration_rows(totals, min_doc: int) -> list[list[int]]:
    """For each total T: rows of T/L documents of L tokens (L = T, T/2, ..., >= min_doc), plus
    one mixed row (T/2, T/4, ..., min_doc, min_doc)."""
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
    return rows


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
              stat: str = "median", clock: str = "wall") -> dict:
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
        rows = calibration_rows(totals, min_doc)
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
        "repeats": repeats,
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
                           stat=args.stat, clock=args.clock)
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
