"""`pack_rows` alone: CPU per step into hot and into cold row memory, and its parts.

    python benchmarks/pack_rows.py

One step of the loader's geometry (4 rows of 65,536 tokens) filled with byte-token documents of
2.5-12 KB (uint8 items, as JSONL text gives them). *hot*: every call packs into the same step
array, in cache. *cold*: the calls take the recycler's `keep` = 4 arrays in turn and read 32 MB
of other data before each call, as the loader does (its array was last written three steps
before). The parts are timed alone, hot: the tokens' concatenation, the labels' copy, the loss
mask's fill, the positions. CPU time (process_time), medians of 5 rounds. Prints a JSON last
line.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from streamload.plan.packing import pack_rows, row_memory_words, split_row_memory

M, C = 4, 65536
STEP = M * C


def step_items(seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays, rows = [], []
    for row in range(M):
        used = 0
        while True:
            n = int(rng.integers(2500, 12000))
            if used + n > C:
                break
            arrays.append(rng.integers(0, 256, n).astype(np.uint8))
            rows.append(row)
            used += n
    return arrays, np.array(rows, np.int64)


def cpu_ms(fn, calls: int) -> float:
    fn()
    total = 0.0
    for _ in range(calls):
        total += fn()
    return total / calls * 1e3


def main() -> int:
    arrays, rows = step_items()
    n = sum(a.shape[0] for a in arrays)
    memories = [np.zeros(row_memory_words(STEP), np.int64) for _ in range(4)]
    other = [np.ones(8 << 20, np.uint8) for _ in range(4)]
    turn = [0]

    def packed(memory) -> float:
        started = time.process_time()
        pack_rows(arrays, rows, M, C, out=split_row_memory(memory, STEP))
        return time.process_time() - started

    def hot() -> float:
        return packed(memories[0])

    def cold() -> float:
        turn[0] += 1
        for array in other:   # what else a step reads: evicts the row memory from cache
            array.sum()
        return packed(memories[turn[0] % len(memories)])

    tokens, positions, labels, loss_mask = split_row_memory(memories[0], STEP)
    counting = np.arange(C)
    lengths = [a.shape[0] for a in arrays]

    def timed(fn):
        def run() -> float:
            started = time.process_time()
            fn()
            return time.process_time() - started
        return run

    parts = {
        "tokens": timed(lambda: np.concatenate(arrays, out=tokens[:n], casting="safe")),
        "labels": timed(lambda: labels.__setitem__(slice(0, n - 1), tokens[1:n])),
        "loss_mask": timed(lambda: loss_mask[:n].fill(1.0)),
        "positions": timed(lambda: np.concatenate([counting[:k] for k in lengths],
                                                  out=positions[:n])),
    }
    result = {"items": len(arrays), "tokens": n}
    rounds = {"hot_ms": [], "cold_ms": [], **{f"{k}_ms": [] for k in parts}}
    for _ in range(5):
        rounds["hot_ms"].append(cpu_ms(hot, 200))
        rounds["cold_ms"].append(cpu_ms(cold, 100))
        for name, fn in parts.items():
            rounds[f"{name}_ms"].append(cpu_ms(fn, 200))
    for key, values in rounds.items():
        result[key] = round(statistics.median(values), 3)
    print(f"pack_rows, {len(arrays)} items, {n:,} tokens: {result['hot_ms']} ms hot, "
          f"{result['cold_ms']} ms cold; parts (hot): tokens {result['tokens_ms']}, labels "
          f"{result['labels_ms']}, loss mask {result['loss_mask_ms']}, positions "
          f"{result['positions_ms']} ms", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
