"""What a non-zero rank does each step with the job-wide figures rank 0's reply carries under
control_plane="gather" (`StepTotals`: its own rank's tokens and row costs and the fixed-size
`StepCosts`; before, every rank's, R x M floats), against R:
decoding them from its reply (`decode_local_plan`) and recording them for stats()
(`StepMetrics.record`), in CPU ms per step (time.thread_time, no process group).

    python benchmarks/reply_totals.py                       # R = 2, 16, 1024, 4096; M = 2, 8
    python benchmarks/reply_totals.py --ranks 2,16 --micro-batches 2

Prints one line per (M, R) on stderr and the JSON last line on stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from streamload.collective.messages import (StepTotals, decode_local_plan,  # noqa: E402
                                            encode_local_plan)
from streamload.metrics import StepMetrics  # noqa: E402
from streamload.plan.cost import StepCosts  # noqa: E402
from streamload.mixreport import StepMix  # noqa: E402

SOURCES = 30


def measure(R: int, M: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    S = SOURCES
    tokens, rows = rng.random(R), rng.random((R, M))
    totals = StepTotals(tokens, rows, np.arange(S), 1, 2, 3, 4, 5, 0.5, np.zeros((R, M)),
                        StepCosts.of(tokens, rows.sum(axis=1), rows, 1, np.zeros(R)))
    reply = encode_local_plan(0, 0, 1, totals=totals, rank=1, units=np.ones(S),
                              mix=StepMix(np.ones(S), False, np.zeros(S, bool)))
    metrics = StepMetrics(step_tokens=R * M * 2048)
    started = time.thread_time()
    for _ in range(repeats):
        local = decode_local_plan(reply, S, R, M)
    decoded = time.thread_time()
    for _ in range(repeats):
        t = local.totals
        metrics.record(t.rank_tokens, t.row_cost, 1, encoder_cost=t.encoder_cost,
                       costs=t.costs)
    recorded = time.thread_time()
    return {"R": R, "M": M, "reply_bytes": int(reply.nbytes),
            "decode_ms": round((decoded - started) * 1e3 / repeats, 4),
            "record_ms": round((recorded - decoded) * 1e3 / repeats, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,16,1024,4096")
    ap.add_argument("--micro-batches", default="2,8")
    args = ap.parse_args(argv)
    rows = []
    for M in (int(m) for m in args.micro_batches.split(",")):
        for R in (int(r) for r in args.ranks.split(",")):
            row = measure(R, M, 2000 if R < 1000 else 200)
            print(f"M={M} R={R}: decode {row['decode_ms']:.4f} ms, record "
                  f"{row['record_ms']:.4f} ms, reply {row['reply_bytes']} B", file=sys.stderr)
            rows.append(row)
    print(json.dumps({"results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
