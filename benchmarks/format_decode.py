"""Each format's read path alone, in CPU time per epoch: decode a shard's ranges, then transform.

    python benchmarks/format_decode.py                              # every format below
    python benchmarks/format_decode.py --formats mds-tokens,megatron --repeat 5
    PYTHONPATH=/path/to/other/tree python benchmarks/format_decode.py   # the same, another tree
    python benchmarks/format_decode.py --workdir /tmp/fd   # the files kept there, and reused

`benchmarks/formats.py` runs each format through the whole Loader, whose step loop costs the
same whatever the format; this measures the part a format owns, on the same 20,000 documents
(`formats.corpus`, written by `formats.write`), with no Loader, no threads and no storage
server. Text formats: jsonl, parquet, mds, litdata, webdataset. Pre-tokenized ones (each
document's UTF-8 bytes as uint16 ids, as formats.py writes Megatron): megatron, tokens (a
`.tokens.npy` shard), mds-tokens (MDSWriter, an `ndarray:uint16` column), parquet-tokens (a
`list<uint16>` column), litdata-tokens (litdata.optimize, items {"tokens": uint16 array}; its
writer takes about a minute). Every shard's planned ranges (1 MiB) are read into memory
first, then, each timed with `time.thread_time`:

  decode      the stream's `decode_columns` over every range, then `finish_columns`
              (`formats.base`: what the loader's transform threads call)
  transform   `records_to_block` of each range's records (byte tokens, C = 32,768)

best of `--repeat` runs. With `--loader`, also `formats.py`'s Loader run over the same files
(1 rank, M = 2 rows of 32,768, planner naive, `--epochs` Loaders one after the other): the
process's CPU seconds (`loader_cpu_s`) and its threads' (`loop_cpu_s`: the step loop and the
fetchers; `transform_cpu_s`: decode and transform), from /proc, read at every step since a
Loader's threads end with it. JSON last line: {"results": [{"format", "decode_ms", "transform_ms",
"records", "mb_per_cpu_s"}]}, the times in ms per epoch (all 20,000 documents), MB the
documents' text bytes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import formats  # noqa: E402

TEXT = ("jsonl", "parquet", "mds", "litdata", "webdataset")
TOKENS = ("megatron", "tokens", "mds-tokens", "parquet-tokens", "litdata-tokens")
C = 32768


def token_item(ids: np.ndarray) -> dict:
    """One LitData item (module level: litdata.optimize pickles it for its worker)."""
    return {"tokens": ids}


def write(fmt: str, texts: list[str], root: Path) -> tuple[Path, str, str | None]:
    """The corpus in `fmt` under root (kept there: a directory already written is reused):
    (directory, the format's name, tokens_field)."""
    out = root / fmt
    name, tokens_field = fmt.split("-")[0], ("tokens" if fmt.endswith("-tokens") else None)
    if out.exists():
        return out, name, tokens_field
    if fmt in formats.FORMATS:
        return formats.write(fmt, texts, root), fmt, None
    ids = [np.frombuffer(t.encode(), np.uint8).astype(np.uint16) for t in texts]
    out.mkdir(parents=True)
    per = -(-len(ids) // 8)
    if fmt == "tokens":
        from streamload.formats import write_token_shard
        for k in range(0, len(ids), per):
            write_token_shard(out / f"part-{k // per:03d}", ids[k:k + per])
        return out, "tokens", None
    if fmt == "mds-tokens":
        MDSWriter, _ = formats._streaming()
        with MDSWriter(out=str(out), columns={"tokens": "ndarray:uint16"},
                       size_limit=per * 1400) as w:
            for array in ids:
                w.write({"tokens": array})
        return out, "mds", "tokens"
    if fmt == "parquet-tokens":
        import pyarrow as pa
        import pyarrow.parquet as pq
        for k in range(0, len(ids), per):
            pq.write_table(pa.table({"tokens": pa.array(ids[k:k + per], pa.list_(pa.uint16()))}),
                           out / f"part-{k // per:03d}.parquet", row_group_size=500)
        return out, "parquet", "tokens"
    if fmt == "litdata-tokens":
        from litdata import optimize
        optimize(fn=token_item, inputs=ids, output_dir=str(out), chunk_bytes="4MB",
                 num_workers=1, mode="overwrite")
        return out, "litdata", "tokens"
    raise SystemExit(f"unknown format {fmt!r}")


async def read_ranges(path: Path, name: str, tokens_field: str | None) -> list:
    """(stream, its ranges' bytes) of every shard under `path`, opened as the loader opens
    them (1 MiB ranges)."""
    from streamload.formats import format_for
    from streamload.formats.base import Problems
    from streamload.storage.base import ObjectInfo
    from streamload.storage.fs import LocalStore
    store, out = LocalStore(), []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        fmt = format_for(str(file), format_name=name, tokens_field=tokens_field)
        if fmt is None:   # a companion: an index, offsets
            continue
        shard = ObjectInfo(str(file), file.stat().st_size)
        stream = await fmt.open(store, shard, problems=Problems("bench", file.name),
                                chunk_bytes=1 << 20)
        out.append((stream, [await store.read_range(shard.uri, a, b) for a, b in stream.ranges()]))
    return out


def measure(path: Path, name: str, tokens_field: str | None, repeat: int) -> dict:
    from streamload.formats.base import decode_columns, finish_columns
    from streamload.pipeline.transform import records_to_block
    best = None
    for _ in range(repeat):
        shards = asyncio.run(read_ranges(path, name, tokens_field))
        started = time.thread_time()
        decoded = [decode_columns(stream, chunk) for stream, chunks in shards for chunk in chunks]
        decoded += [finish_columns(stream) for stream, _ in shards]
        between = time.thread_time()
        for records in decoded:
            records_to_block(records, 0, C, "split")
        run = (between - started, time.thread_time() - between, sum(map(len, decoded)))
        best = run if best is None or sum(run[:2]) < sum(best[:2]) else best
    return {"decode_ms": round(best[0] * 1e3, 1), "transform_ms": round(best[1] * 1e3, 1),
            "records": best[2]}


def thread_cpu(into: dict) -> None:
    """Each live thread's CPU seconds so far, by native id, into `into` ((name, seconds))."""
    tick = os.sysconf("SC_CLK_TCK")
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, TypeError):   # ended meanwhile
            continue
        into[thread.native_id] = (thread.name.rstrip("0123456789-_"),
                                  (int(fields[11]) + int(fields[12])) / tick)


def loader_cpu(path: Path, name: str, tokens_field: str | None, epochs: int) -> dict:
    """CPU seconds of `epochs` epochs of formats.py's Loader run over `path`."""
    import streamload as sl
    import streamload.loader  # noqa: F401  (torch and the Loader imported before the clock)
    threads: dict = {}
    started = time.process_time()
    for _ in range(epochs):
        with sl.Loader([sl.Source(str(path), format=name, tokens_field=tokens_field)],
                       micro_batch_tokens=32768, micro_batches=2, epochs=1,
                       planner="naive") as loader:
            for _ in loader:
                thread_cpu(threads)
    total = time.process_time() - started

    def of(thread: str) -> float:
        return round(sum(s for n, s in threads.values() if n == thread), 2)
    return {"loader_cpu_s": round(total, 2), "loop_cpu_s": of("streamload-loop"),
            "transform_cpu_s": of("streamload-transform")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--formats", default=",".join(TEXT + TOKENS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", help="keep the written files here, and reuse them")
    ap.add_argument("--loader", action="store_true", help="also the Loader's CPU, per thread")
    ap.add_argument("--epochs", type=int, default=2, help="Loader epochs (with --loader)")
    args = ap.parse_args(argv)
    texts = formats.corpus(args.docs)
    text_bytes = sum(len(t.encode()) for t in texts)
    root = Path(args.workdir) / str(args.docs) if args.workdir else \
        Path(tempfile.mkdtemp(prefix="streamload-format-decode-"))
    results = []
    for fmt in args.formats.split(","):
        path, name, tokens_field = write(fmt, texts, root)
        row = {"format": fmt, **measure(path, name, tokens_field, args.repeat)}
        row["mb_per_cpu_s"] = round(text_bytes / 1e3 / (row["decode_ms"] + row["transform_ms"]), 1)
        if args.loader:
            row.update(loader_cpu(path, name, tokens_field, args.epochs))
        print(f"{fmt}: decode {row['decode_ms']} ms, transform {row['transform_ms']} ms per "
              f"epoch of {row['records']:,} records ({row['mb_per_cpu_s']} MB per CPU s)",
              file=sys.stderr)
        results.append(row)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
