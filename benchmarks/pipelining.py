"""Does planning hide behind the training step? A trainer that takes --step-ms per step reads a
3-source local corpus through the loader; we report rank 0's planning time per step and how
long the trainer waited in next() after warm-up. Prints a JSON last line."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from corpus import write_jsonl_source  # noqa: E402

import streamload as sl  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=220)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--planner", default="balanced")
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--micro-batches", type=int, default=8)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i, name in enumerate("abc"):
            write_jsonl_source(root, name, shards=4, per_shard=1500, median=800,
                               compression="zst", seed=i)
        with sl.Loader([sl.Source(str(root / n)) for n in "abc"], epochs=None,
                       micro_batch_tokens=args.micro_batch_tokens,
                       micro_batches=args.micro_batches, planner=args.planner) as loader:
            batches, waits = iter(loader), []
            for _ in range(args.steps):
                started = time.perf_counter()
                next(batches)
                waits.append(time.perf_counter() - started)
                time.sleep(args.step_ms / 1e3)   # the training step
            stats = loader.stats()
    waits_ms = np.array(waits[args.warmup:]) * 1e3
    result = {"planner": args.planner, "step_ms": args.step_ms,
              "plan_ms_median": stats["plan_ms_median"],
              "wait_ms_median": float(np.median(waits_ms)), "wait_ms_p99": float(np.percentile(waits_ms, 99)),
              "wait_ms_max": float(waits_ms.max()),
              "steps_waiting_over_1ms": int((waits_ms > 1).sum()), "steps": int(waits_ms.size)}
    print(f"planning {result['plan_ms_median']:.2f} ms/step; trainer waited median "
          f"{result['wait_ms_median']:.3f} ms, max {result['wait_ms_max']:.2f} ms", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
