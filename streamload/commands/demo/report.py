"""What the demo prints: the corpus, the steps as they go, and the run's summary."""
from __future__ import annotations

from collections import Counter

from . import corpus as corpus_module


MAX_EMPTY_STEPS = 20   # this many steps in a row with no tokens at all: the loader is stuck


def fmt_count(x: float) -> str:
    x = float(x)
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.1f}{unit}"
    return f"{x:.0f}"


def per_rank(values, width: int, fmt) -> str:
    values = list(values)
    if len(values) <= 4:
        return " ".join(f"{fmt(v):>{width}}" for v in values)
    return f"min {fmt(min(values))} max {fmt(max(values))}"


def should_print(step: int, job: dict) -> bool:
    if step < job["print_first"]:
        return True
    return (step - job["print_first"] + 1) % job["print_every"] == 0


def print_header(world: int) -> None:
    per = "per rank" if world <= 4 else "min / max"
    print(f"{'step':>6} | {'tokens ' + per:>{max(17, 8 * min(world, 4))}} | "
          f"{'predicted cost ' + per:>{max(24, 8 * min(world, 4))}} | {'imbal.':>6} | "
          f"{'defer':>5} | {'tok/s so far':>12}", flush=True)


def print_step(batch, tokens_so_far: float, elapsed: float) -> None:
    world = len(batch.rank_tokens)
    tokens = per_rank(batch.rank_tokens, 7, lambda v: f"{int(v):,}")
    costs = per_rank(batch.rank_cost, 7, fmt_count)
    rate = tokens_so_far / elapsed if elapsed > 0 else 0.0
    print(f"{batch.step:>6} | {tokens:>{max(17, 8 * min(world, 4))}} | "
          f"{costs:>{max(24, 8 * min(world, 4))}} | {batch.imbalance:>6.3f} | "
          f"{batch.max_deferral:>5} | {fmt_count(rate):>12}", flush=True)


def print_corpus(c: corpus_module.Corpus, capacity: int) -> None:
    print(f"corpus: {c.docs:,} documents, {c.tokens:,} tokens in {c.root}")
    print(f"  {'source':<7} {'where':<6} {'format':<7} {'shards':>6} {'docs':>6} {'tokens':>10} "
          f"{'weight':>6} {'longest':>8} {'>C':>5}")
    for s in c.sources:
        print(f"  {s.name:<7} {s.location:<6} {s.format:<7} {len(s.shards):>6} {s.docs:>6} "
              f"{s.tokens:>10,} {s.weight:>6.2f} {s.longest:>8,} {s.longer_than(capacity):>5}")


def summarize(corpus: corpus_module.Corpus, ranks: list[dict], args, wall: float) -> dict:
    C = args.micro_batch_tokens
    stalled = ranks[0]["stalled_at_step"]
    complete = args.steps is None or any(r["steps"] < args.steps for r in ranks) or \
        stalled is not None
    expected = corpus.expected_items(C)
    check = corpus_module.check_delivery((tuple(p) for r in ranks for p in r["ids"]), expected)
    duplicates, unexpected, missing = check["duplicates"], check["unexpected"], check["missing"]
    no_duplicates = not duplicates and not unexpected and not check["untiled"]
    missing = missing + check["partial"]   # a cut piece whose rest never came
    complete = complete or not missing
    exactly_once = (no_duplicates and not missing) if complete else None
    if not complete:
        missing = []   # stopped early by --steps: what was not reached is not missing
    steps = {r["steps"] for r in ranks}
    total_tokens = sum(r["tokens"] for r in ranks)
    source_tokens = Counter()
    for r in ranks:
        source_tokens.update(r["source_tokens"])
    # The loader's own account of the mix (`mixreport`): the target as configured, the mix
    # while every source had data (before the epoch's tail), and where each source ran out.
    # Over the whole epoch the realized mix is the corpus's own, whatever the weights.
    names = ranks[0]["sources"]
    loader_mix, mix_steps = ranks[0]["stats"]["mix"], ranks[0]["stats"]["mix_steps"]
    mix = {name: {"target": loader_mix[name]["target"],
                  "realized_all_active": loader_mix[name]["realized_all_active"],
                  "realized": source_tokens[name] / total_tokens if total_tokens else 0.0,
                  "corpus": corpus.source(name).tokens / corpus.tokens,
                  "tokens": int(source_tokens[name]),
                  "ran_out_at_step": next((e["ran_out_at_step"] for e in
                                           loader_mix[name]["epochs"]), None)}
           for name in names}
    active_steps = mix_steps["steps_all_active"]
    skipped = {"records": 0, "shards": 0, "empty_documents": 0, "dropped_documents": 0,
               "truncated_documents": 0}
    for r in ranks:
        for metrics in r["stats"]["sources"].values():
            skipped["records"] += metrics["skipped_records"]
            skipped["shards"] += metrics["skipped_shards"]
            skipped["empty_documents"] += metrics["empty_documents"]
            skipped["dropped_documents"] += metrics["dropped_documents"]
            skipped["truncated_documents"] += metrics["truncated_documents"]
    imbalances = ranks[0]["imbalances"]
    loader_s = max(r["loader_s"] for r in ranks)
    rank_tokens = ranks[0]["all_rank_tokens"]
    return {
        "ok": bool(no_duplicates and (exactly_once is not False) and len(steps) == 1
                   and stalled is None),
        "stalled_at_step": stalled,
        "ranks": len(ranks), "planner": args.planner,
        "micro_batch_tokens": C, "micro_batches": args.micro_batches,
        "steps": ranks[0]["steps"], "equal_steps_on_every_rank": len(steps) == 1,
        "epoch_complete": complete,
        "samples": sum(len(r["ids"]) for r in ranks), "expected_samples": len(expected),
        "documents": corpus.docs, "tokens": total_tokens, "corpus_tokens": corpus.tokens,
        "tokens_per_rank": [int(t) for t in rank_tokens],
        "fill": total_tokens / (ranks[0]["steps"] * len(ranks) * args.micro_batches * C)
        if ranks[0]["steps"] else 0.0,
        "tokens_per_step": ranks[0]["stats"]["tokens_per_step"],
        "step_capacity_tokens": ranks[0]["stats"]["step_capacity_tokens"],
        "mix": mix, "steps_with_all_sources": active_steps,
        "imbalance_mean": sum(imbalances) / len(imbalances) if imbalances else None,
        "imbalance_max": max(imbalances) if imbalances else None,
        "exactly_once": exactly_once, "duplicates": len(duplicates), "missing": len(missing),
        "unexpected": len(unexpected),
        "examples": {"duplicates": duplicates[:3], "missing": missing[:3],
                     "unexpected": unexpected[:3]},
        "skipped": skipped,
        "wall_s": round(wall, 3), "loader_s": round(loader_s, 3),
        "first_batch_s": round(ranks[0]["first_batch_s"] or 0.0, 3),
        "tokens_per_s": total_tokens / loader_s if loader_s > 0 else 0.0,
    }


def print_summary(s: dict) -> None:
    print()
    print(f"summary ({s['ranks']} ranks, planner {s['planner']!r}, "
          f"C={s['micro_batch_tokens']}, M={s['micro_batches']})")
    print(f"  steps          {s['steps']}"
          + ("" if s["equal_steps_on_every_rank"] else "  (ranks stopped at DIFFERENT steps)")
          + (f"  (STUCK: only empty steps since step {s['stalled_at_step'] - MAX_EMPTY_STEPS + 1})"
             if s["stalled_at_step"] is not None else ""))
    print(f"  samples        {s['samples']:,} ({s['documents']:,} documents; long ones split)")
    print(f"  tokens         {s['tokens']:,} of {s['corpus_tokens']:,} in the corpus, "
          f"rows {s['fill']:.1%} full")
    print(f"  tokens/rank    {', '.join(f'{t:,}' for t in s['tokens_per_rank'])}")
    per_step = s["tokens_per_step"]
    if per_step["p50"] is not None:
        print(f"  tokens/step    p1 {per_step['p1']:,}, p50 {per_step['p50']:,}, "
              f"p99 {per_step['p99']:,} of {s['step_capacity_tokens']:,} (R x M x C); "
              f"steps below 90% full: {per_step['steps_below_90pct']}")
    active = s["steps_with_all_sources"]
    span = f"steps 0-{active - 1}" if active > 0 else "(none)"
    print(f"  mix            {'source':<8} {'target':>6}  {span:>12}  {'epoch':>6}  ran out at"
          f"   (realized token shares)")
    for name, m in s["mix"].items():
        early = m["realized_all_active"]
        early = f"{early:.1%}" if early is not None else "-"
        out = f"step {m['ran_out_at_step']}" if m["ran_out_at_step"] is not None else "-"
        print(f"                 {name:<8} {m['target']:>6.1%}  {early:>12}  {m['realized']:>6.1%}  {out}")
    if s["imbalance_mean"] is not None:
        print(f"  imbalance      mean {s['imbalance_mean']:.3f}, max {s['imbalance_max']:.3f} "
              f"(predicted max rank cost / mean rank cost)")
    print(f"  time           {s['wall_s']:.1f} s wall, {s['loader_s']:.1f} s in the loader "
          f"(first batch after {s['first_batch_s']:.1f} s)")
    print(f"  throughput     {s['tokens_per_s']:,.0f} tokens/s")
    if s["exactly_once"] is None:
        verdict = ("not checked: stopped early by --steps; no duplicates" if s["ok"]
                   else "FAILED: duplicates or unknown ids")
    else:
        verdict = "OK" if s["exactly_once"] else "FAILED"
    print(f"  exactly-once   {verdict} (duplicates {s['duplicates']}, missing {s['missing']}, "
          f"unexpected {s['unexpected']})")
    if not s["ok"]:
        for kind, ids in s["examples"].items():
            if ids:
                print(f"                 e.g. {kind}: {', '.join(ids)}")
    sk = s["skipped"]
    print(f"  skipped        {sk['records']} records, {sk['shards']} shards, "
          f"{sk['empty_documents']} empty, {sk['dropped_documents']} dropped, "
          f"{sk['truncated_documents']} truncated")
