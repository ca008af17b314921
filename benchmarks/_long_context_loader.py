"""The loader half of benchmarks/long_context.py: one epoch through the public `streamload.Loader`
on R real gloo ranks (one spawned process per rank, as in benchmarks/epoch.py).

Corpus: `_long_tail.corpus(tokens, seed=0)`, written once as token shards (`*.tokens.npy` +
`*.offsets.npy`, uint16 zeros: only the lengths matter) under
/tmp/streamload-long-context/<hash of its parameters>/<source>/part-NNNNN, a different number of
shards per source (`SHARDS`; `math` has one, fewer than the ranks). `tokens` is
`args.loader_tokens`, or by default `LOADER_STEPS` full steps of R x M x C.

Each rank runs one epoch with `long_context.options(C, M, P, planner)` (long_documents="split",
the default) over `long_context.sources()` pointed at the shard directories, and records per
step the row cost of each micro-batch from its cu_seqlens (a*L^2 + b*L per segment), the tokens
per source (the sample id up to its first '/'), every (sample id, tokens) and `batch.step`. The
records come back through a multiprocessing queue and are scored with long_context's
`summarize` against `baseline_rows` of the same documents (waits: the loader reports none per
item, so waited_items/mean are null and waited_max is the largest `batch.max_deferral`). The
baseline drops the corpus's remainder, the epoch's last step holds it: `*_but_last` leave that
step out. A CP configuration runs R data-parallel ranks with rows of C (CP is not modelled).
exactly_once: every rank saw the same steps, no sample id twice, the tokens delivered are the
corpus's, and the ids tile exactly its items (every document, ":k" for each piece of a split
one; `streamload.commands.demo.corpus.check_delivery`).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _long_tail  # noqa: E402
from epoch import spawn_ranks  # noqa: E402   (sets OMP_NUM_THREADS & co. to 1 if unset)

VERSION = 1
WORKDIR = "/tmp/streamload-long-context"
LOADER_STEPS = 96   # full steps of R x M x C in the corpus: the mix and fill need an epoch of length
SHARDS = {"web": 6, "code": 4, "math": 1, "books": 5, "longmix": 3}
TIMEOUT_S = 1800.0


# -- the corpus, as token shards ------------------------------------------------------------
def shard_bounds(n_docs: int, shards: int) -> np.ndarray:
    return np.linspace(0, n_docs, shards + 1).round().astype(np.int64)


def write_corpus(total_tokens: float, seed: int = 0, workdir: str = WORKDIR):
    """(root, corpus): `_long_tail.corpus(total_tokens, seed)` as token shards under root,
    generated once (a `done` file marks it complete)."""
    corpus = _long_tail.corpus(total_tokens, seed=seed)
    key = json.dumps({"v": VERSION, "tokens": float(total_tokens), "seed": seed,
                      "shards": SHARDS}, sort_keys=True)
    root = Path(workdir) / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (root / "done").exists():
        return root, corpus
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    for name, lengths in corpus.items():
        bounds = shard_bounds(lengths.size, SHARDS[name])
        for k in range(SHARDS[name]):
            part = lengths[bounds[k]:bounds[k + 1]]
            offsets = np.zeros(part.size + 1, dtype="<i8")
            np.cumsum(part, out=offsets[1:])
            stem = root / name / f"part-{k:05d}"
            stem.parent.mkdir(parents=True, exist_ok=True)
            np.save(f"{stem}.tokens.npy", np.zeros(int(offsets[-1]), dtype="<u2"))
            np.save(f"{stem}.offsets.npy", offsets)
    (root / "done").write_text(key)
    return root, corpus


def expected_ids(corpus: dict, C: int) -> dict[str, int]:
    from streamload.commands.demo.corpus import expected_items
    shards = []
    for name, lengths in corpus.items():
        bounds = shard_bounds(lengths.size, SHARDS[name])
        shards += [(name, f"part-{k:05d}.tokens.npy", lengths[bounds[k]:bounds[k + 1]].tolist())
                   for k in range(SHARDS[name])]
    return expected_items(shards, C)


def loader_sources(root):
    """`long_context.sources()` (names, weights) with URIs at the shard directories."""
    import msgspec
    import long_context
    return [msgspec.structs.replace(s, uri=f"{root}/{s.name}/") for s in long_context.sources()]


# -- one rank -------------------------------------------------------------------------------
def run_rank(rank: int, world: int, port: int, root: str, options: dict, queue) -> None:
    try:
        import torch
        torch.set_num_threads(1)
        if world > 1:
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=300))
        import streamload as sl
        names = list(_long_tail.WEIGHTS)
        index = {n: i for i, n in enumerate(names)}
        a, b, M = options["cost_a"], options["cost_b"], options["micro_batches"]
        steps, row_cost, by_source, ids, deferral = [], [], [], [], []
        started = time.perf_counter()
        with sl.Loader(loader_sources(root), **options) as loader:
            for batch in loader:
                if len(batch.micro_batches) > M:
                    raise RuntimeError(f"step {batch.step}: {len(batch.micro_batches)} "
                                       f"micro-batches, M = {M}")
                rows = [0.0] * M
                per_source = [0] * len(names)
                for m, mb in enumerate(batch.micro_batches):
                    seg = np.diff(mb.cu_seqlens.numpy()).astype(np.int64)
                    if len(mb.sample_ids) != seg.size:
                        raise RuntimeError(f"step {batch.step}: {len(mb.sample_ids)} sample ids "
                                           f"for {seg.size} cu_seqlens segments")
                    rows[m] = float((a * seg * seg + b * seg).sum())
                    for sid, n in zip(mb.sample_ids, seg.tolist()):
                        per_source[index[sid.split("/", 1)[0]]] += n
                        ids.append((sid, n))
                steps.append(int(batch.step))
                deferral.append(int(batch.max_deferral))
                row_cost.append(rows)
                by_source.append(per_source)
        wall = time.perf_counter() - started
        queue.put({"rank": rank, "steps": steps, "row_cost": row_cost, "by_source": by_source,
                   "ids": ids, "deferral": deferral, "wall_s": wall})
        if world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})
        raise


def run_ranks(world: int, root, options: dict, timeout: float = TIMEOUT_S) -> list[dict]:
    """Spawn `world` ranks of one epoch; their records, by rank. Raises if a rank fails."""
    return spawn_ranks(run_rank, world, timeout, str(root), options)


# -- scoring --------------------------------------------------------------------------------
def score(ranks: list[dict], corpus: dict, C: int, M: int, P: int, base_eff: float,
          expected: dict) -> dict:
    import long_context
    from streamload.commands.demo.corpus import check_delivery
    R = len(ranks)
    S = len(_long_tail.WEIGHTS)
    same_steps = all(r["steps"] == ranks[0]["steps"] for r in ranks)
    T = max(len(r["steps"]) for r in ranks)
    row_cost = np.zeros((T, R, M))
    tokens_by_source = np.zeros((T, S))
    for q, r in enumerate(ranks):
        n = len(r["steps"])
        if n:
            row_cost[:n, q] = np.asarray(r["row_cost"], dtype=np.float64).reshape(n, M)
            tokens_by_source[:n] += np.asarray(r["by_source"], dtype=np.float64).reshape(n, S)
    last = [int(nz[-1]) if nz.size else -1
            for nz in (np.flatnonzero(tokens_by_source[:, s] > 0) for s in range(S))]
    active = np.arange(T)[:, None] <= np.array(last)[None, :]
    fill = tokens_by_source.sum(axis=1) / (R * M * C)
    res = long_context.summarize(row_cost, P, tokens_by_source, active, fill,
                                 np.zeros(T), np.zeros(T), np.zeros(0), base_eff)
    # The baseline drops the corpus's remainder (< one step); the epoch's last step holds it.
    if T > 1:
        eff = long_context.efficiency(row_cost[:-1], P)
        res["efficiency_but_last"] = round(eff, 4)
        res["speedup_vs_baseline_but_last"] = round(eff / base_eff, 4)
    # The loader reports no per-item waits; its batches carry the step's longest deferral.
    res.update({"waited_items": None, "waited_mean": None,
                "waited_max": max((d for r in ranks for d in r["deferral"]), default=0)})
    parts = [tuple(i) for r in ranks for i in r["ids"]]
    check = check_delivery(parts, expected)
    delivered = int(sum(n for _, n in parts))
    corpus_tokens = int(sum(int(v.sum()) for v in corpus.values()))
    res.update({"tokens": delivered, "corpus_tokens": corpus_tokens, "samples": len(parts),
                "same_steps_all_ranks": same_steps,
                "steps_in_order": all(r["steps"] == sorted(r["steps"]) for r in ranks),
                **{k: len(v) for k, v in check.items()}})
    res["exactly_once"] = bool(same_steps and delivered == corpus_tokens
                               and not any(check.values()))
    return res


def measure(config: str, C: int, M: int, P: int, R: int, planners, total_tokens: float,
            seed: int = 0, workdir: str = WORKDIR, timeout: float = TIMEOUT_S) -> list[dict]:
    """The baseline row, then one row per planner: one epoch at R ranks of (C, M, P)."""
    import long_context
    root, corpus = write_corpus(total_tokens, seed, workdir)
    base = long_context.baseline_rows(np.concatenate(list(corpus.values())), C, R, M, seed)
    base_eff = long_context.efficiency(base, P)
    expected = expected_ids(corpus, C)
    out = [{"config": config, "mode": "loader", "ranks": R, "planner": "megatron_baseline",
            "steps": int(base.shape[0]), "efficiency": round(base_eff, 4),
            "speedup_vs_baseline": 1.0, "fill": 1.0}]
    for planner in planners:
        options = long_context.options(C, M, P, planner, seed)
        started = time.perf_counter()
        ranks = run_ranks(R, root, options, timeout)
        elapsed = time.perf_counter() - started
        res = score(ranks, corpus, C, M, P, base_eff, expected)
        out.append({"config": config, "mode": "loader", "ranks": R, "planner": planner,
                    "wall_s": round(max(r["wall_s"] for r in ranks), 1),
                    "wall_with_spawn_s": round(elapsed, 1), **res})
    return out


def run(name: str, R: int, planners: list[str], args) -> list[dict]:
    """long_context.py's loader runs: configuration `name` at R ranks, every planner.
    `args.loader_tokens` (optional): the corpus's tokens; default LOADER_STEPS full steps."""
    import long_context
    C, M, P, CP = long_context.CONFIGS[name]
    tokens = getattr(args, "loader_tokens", None) or LOADER_STEPS * R * M * C
    return measure(name, C, M, P, R, planners, tokens,
                   timeout=getattr(args, "timeout", None) or TIMEOUT_S)
