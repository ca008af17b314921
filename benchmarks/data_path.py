"""The data path alone, in CPU time per 262,144-token step: decode, transform, buffer, pack.

    python benchmarks/data_path.py                          # JSONL and token shards
    python benchmarks/data_path.py --formats jsonl --shards 2
    PYTHONPATH=/path/to/other/tree python benchmarks/data_path.py   # the same, another tree

What `benchmarks/loader_cpu.py` measures with everything else of a step around it (the step loop,
the planner, the collectives, asyncio), this measures alone, stage by stage, on the same cached
corpus (`_corpus.main_corpus`, the "web" and "code" sources, byte tokens), with no storage
server and no threads: a shard's 1 MiB ranges are read into memory first, then

  decode      the format's stream decodes every range (JSONL: msgspec; tokens: the .npy shard
              the same documents were written to as uint16, read as int32)
  transform   records -> buffer items (UTF-8 bytes or checked ids, long documents cut at C)
  buffer      items appended to a `SourceBuffer`, then per step: the head window (two steps'
              tokens) as the summary's columns (lengths, ages, ids), and `take` of the items
              a naive plan takes (in order, first fit into 4 rows of 65,536)
  pack        `pack_rows` of the taken items into the step's 4 rows (recycled memory)

Each stage is timed with `time.thread_time` around its calls (all of it runs on one thread),
the best of `--repeat` runs.
It runs against trees from before the columnar data path too (a buffer of `Item` objects,
`records_to_items`): the few calls that differ are chosen by what the tree has, so the same
script measures both sides of an A/B. JSON last line: {"results": [{"format", "steps",
"decode_ms", "transform_ms", "buffer_ms", "pack_ms", "total_ms", "mb_per_cpu_s"}]}, the
stage times in ms per step.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _corpus  # noqa: E402

C, M = 65536, 4
STEP = C * M


def shard_paths(root: Path, shards: int) -> list[Path]:
    return [p for name in ("web", "code")
            for p in sorted((root / name).glob("*.jsonl"))[:shards]]


def token_shards(paths: list[Path], out: Path) -> list[Path]:
    """The same documents as `.tokens.npy` shards (their UTF-8 bytes as uint16 ids)."""
    import msgspec
    from streamload.formats import write_token_shard
    made = []
    for path in paths:
        stem = out / path.stem
        if not Path(f"{stem}.tokens.npy").exists():
            texts = [msgspec.json.decode(line)["text"] for line in path.read_bytes().splitlines()
                     if line.strip()]
            write_token_shard(stem, [np.frombuffer(t.encode(), np.uint8) for t in texts])
        made.append(Path(f"{stem}.tokens.npy"))
    return made


async def read_ranges(fmt, path: Path):
    """The shard's stream, opened, and its planned ranges' bytes, in order."""
    from streamload.formats.base import Problems
    from streamload.storage.base import ObjectInfo
    from streamload.storage.fs import LocalStore
    store = LocalStore()
    shard = ObjectInfo(str(path), path.stat().st_size)
    stream = await fmt.open(store, shard, problems=Problems("bench", path.name),
                            chunk_bytes=1 << 20)
    chunks = [await store.read_range(shard.uri, a, b) for a, b in stream.ranges()]
    return stream, chunks


class Tree:
    """The calls that differ between a tree with the columnar path and one without."""

    def __init__(self):
        from streamload.pipeline import transform
        self.columnar = hasattr(transform, "records_to_block")
        self.transform = transform

    def decode(self, stream, chunk):
        if self.columnar:
            from streamload.formats.base import decode_columns
            return decode_columns(stream, chunk)
        return stream.decode(chunk)

    def finish(self, stream):
        if self.columnar:
            from streamload.formats.base import finish_columns
            return finish_columns(stream)
        return stream.finish()

    def items(self, records, shard: int):
        """Buffer entries of one range, and their count."""
        if self.columnar:
            block, _ = self.transform.records_to_block(records, shard, C, "split")
            return [block], len(block)
        items, _ = self.transform.records_to_items(records, shard, C, "split")
        return items, len(items)

    def window(self, buffer):
        """The window's lengths, ages and ids, as the step loop encodes them."""
        if self.columnar:
            window = buffer.window()
            return window.lengths, window.ages, window.ids
        items, _ = buffer.window()
        fields = np.array([(i.tokens.shape[0], i.age, i.shard, i.record, i.chunk)
                           for i in items], dtype=np.int64).reshape(-1, 5)
        return fields[:, 0], fields[:, 1], fields[:, 2:]

    def taken_tokens(self, taken):
        return taken.tokens if self.columnar else [i.tokens for i in taken]


def naive_plan(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions and rows: the window's items in order, each into the first of M rows of C
    tokens with room; the plan stops at the first item that fits nowhere."""
    room = [C] * M
    positions, rows = [], []
    for p, n in enumerate(lengths.tolist()):
        row = next((r for r in range(M) if room[r] >= n), None)
        if row is None:
            break
        room[row] -= n
        positions.append(p)
        rows.append(row)
    return np.array(positions, np.int64), np.array(rows, np.int64)


def run(paths: list[Path], fmt, tree: Tree) -> dict:
    from streamload.pipeline.buffer import SourceBuffer
    from streamload.plan.packing import pack_rows, row_memory_words, split_row_memory
    read = [asyncio.run(read_ranges(fmt, p)) for p in paths]
    times = dict(decode=0.0, transform=0.0, buffer=0.0, pack=0.0)
    entries, tokens_in = [], 0
    for shard, (stream, chunks) in enumerate(read):
        for chunk in [*chunks, None]:
            t0 = time.thread_time()
            records = tree.decode(stream, chunk) if chunk is not None else tree.finish(stream)
            t1 = time.thread_time()
            items, n = tree.items(records, shard)
            t2 = time.thread_time()
            times["decode"] += t1 - t0
            times["transform"] += t2 - t1
            if n:
                entries.extend(items)
    buffer = SourceBuffer(1 << 40, 2 * STEP)
    memory = np.empty(row_memory_words(STEP), np.int64)
    t0 = time.thread_time()
    asyncio.run(buffer.put(entries))
    times["buffer"] += time.thread_time() - t0
    steps = 0
    while True:
        t0 = time.thread_time()
        lengths, _, _ = tree.window(buffer)
        positions, rows = naive_plan(lengths)
        if not positions.size:
            break
        taken = tree.taken_tokens(buffer.take(positions, lengths.shape[0]))
        t1 = time.thread_time()
        pack_rows(taken, rows, M, C, out=split_row_memory(memory, STEP))
        t2 = time.thread_time()
        times["buffer"] += t1 - t0
        times["pack"] += t2 - t1
        tokens_in += int(lengths[positions].sum())
        steps += 1
    return {"steps": steps, "tokens": tokens_in, **times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="jsonl,tokens")
    ap.add_argument("--shards", type=int, default=3, help="shards per source (web, code)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/streamload-bench")
    args = ap.parse_args(argv)
    from streamload.formats import JsonlFormat, TokensFormat
    info = _corpus.main_corpus(Path(args.workdir), 300, 8)
    paths = shard_paths(Path(info.root) / "jsonl", args.shards)
    tree = Tree()
    results = []
    for name in args.formats.split(","):
        if name == "jsonl":
            fmt, files = JsonlFormat(), paths
        else:
            out = Path(args.workdir) / "data-path-tokens"
            out.mkdir(parents=True, exist_ok=True)
            fmt, files = TokensFormat(), token_shards(paths, out)
        best = None
        for _ in range(args.repeat):
            r = run(files, fmt, tree)
            total = r["decode"] + r["transform"] + r["buffer"] + r["pack"]
            if best is None or total < best[1]:
                best = (r, total)
        r, total = best
        per = 1e3 / max(r["steps"], 1)
        row = {"format": name, "columnar": tree.columnar, "steps": r["steps"],
               **{f"{k}_ms": round(r[k] * per, 3) for k in ("decode", "transform", "buffer",
                                                           "pack")},
               "total_ms": round(total * per, 3),
               "mb_per_cpu_s": round(r["tokens"] / total / 1e6, 1)}
        print(f"{name}: {row['total_ms']} ms CPU per step (decode {row['decode_ms']}, transform "
              f"{row['transform_ms']}, buffer {row['buffer_ms']}, pack {row['pack_ms']}); "
              f"{row['mb_per_cpu_s']} MB per CPU second", file=sys.stderr)
        results.append(row)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
