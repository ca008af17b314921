"""Every shard format through the Loader, beside its reference library, on the same documents.

    python benchmarks/formats.py                       # 20,000 documents per format
    python benchmarks/formats.py --docs 5000 --formats parquet,mds

One corpus of texts (lengths 10..20k bytes, log-normal, median ~600) is written in each format
with that format's reference writer (JSONL: streamload's; Parquet: pyarrow; MDS:
mosaicml-streaming's MDSWriter; LitData: litdata.optimize; WebDataset: tarfile; Megatron:
the documented .bin/.idx layout, token ids = the UTF-8 bytes as uint16), into local files.
Per format:
  loader_mb_s, loader_samples_s   one epoch through `sl.Loader` (1 rank, byte tokens, M=2 rows
                                  of C=32,768, planner "naive"), text MB (tokens) per second
  reference_mb_s                  the reference library reading every document of the same files
                                  (pyarrow.read_table, StreamingDataset, litdata's
                                  StreamingDataset, tarfile, megatron.core's IndexedDataset or
                                  numpy), in the same run
  loader_mb_per_cpu_s             the same text MB per second of the process's CPU time
  raw_mb_s, vs_raw                the ceiling: the documents' text MB over the time to read
                                  the format's files raw (the Loader's local store, 1 MiB
                                  ranges, 8 at a time, nothing decoded), and loader_mb_s
                                  against it
  bytes_read, bytes_delivered     what the Loader read from storage over the epoch, against the
                                  documents' bytes it delivered
  first_step_bytes, files_bytes   what it read to deliver its first step (M=1 row of 1,024
                                  tokens, prefetch 1, one shard at a time), against the files'
                                  total size: a ranged format reads a small part
JSON last line: {"results": [{"format", ...}]}.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

FORMATS = ("jsonl", "parquet", "mds", "litdata", "webdataset", "megatron")


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(600), 1.0, n), 10, 20_000).astype(int)
    words = "the of and to in is that for it as with was on be by this are at from".split()
    out = []
    for k, length in enumerate(lengths):
        picks = rng.integers(0, len(words), length // 3 + 2)
        out.append((f"doc {k} " + " ".join(words[i] for i in picks))[:length])
    return out


def _streaming():
    """mosaicml-streaming's writer and dataset, without its package __init__ (torchvision)."""
    if "streaming" not in sys.modules and importlib.util.find_spec("torchvision") is None:
        spec = importlib.util.find_spec("streaming")
        package = types.ModuleType("streaming")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = package
    writer = importlib.import_module("streaming.base.format.mds.writer")
    dataset = importlib.import_module("streaming.base.dataset")
    return writer.MDSWriter, dataset.StreamingDataset


def litdata_item(text: str) -> dict:
    """One LitData item (module level: litdata.optimize pickles it for its worker)."""
    return {"text": text}


def write(fmt: str, texts: list[str], root: Path) -> Path:
    out = root / fmt
    out.mkdir(parents=True)
    shards = 8
    per = -(-len(texts) // shards)
    parts = [texts[i:i + per] for i in range(0, len(texts), per)]
    if fmt == "jsonl":
        from streamload.formats import write_jsonl
        for k, part in enumerate(parts):
            write_jsonl(out / f"part-{k:03d}.jsonl", part)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        for k, part in enumerate(parts):
            pq.write_table(pa.table({"text": part}), out / f"part-{k:03d}.parquet",
                           row_group_size=500)
    elif fmt == "mds":
        MDSWriter, _ = _streaming()
        with MDSWriter(out=str(out), columns={"text": "str"}, size_limit=per * 700) as w:
            for text in texts:
                w.write({"text": text})
    elif fmt == "litdata":
        from litdata import optimize
        optimize(fn=litdata_item, inputs=texts, output_dir=str(out), chunk_bytes="4MB", num_workers=1,
                 mode="overwrite")
    elif fmt == "webdataset":
        import io
        import tarfile
        for k, part in enumerate(parts):
            with tarfile.open(out / f"shard-{k:03d}.tar", "w") as tar:
                for i, text in enumerate(part):
                    data = text.encode()
                    info = tarfile.TarInfo(f"{i:08d}.txt")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    elif fmt == "megatron":
        from streamload.formats.megatron import write_megatron_dataset
        for k, part in enumerate(parts):
            write_megatron_dataset(
                str(out / f"part-{k:03d}"),
                [np.frombuffer(t.encode(), np.uint8).astype(np.uint16) for t in part], np.uint16)
    return out


def reference_read(fmt: str, path: Path) -> int:
    """Bytes of text (tokens) the reference library reads from `path`."""
    total = 0
    if fmt == "jsonl":
        import msgspec
        for f in sorted(path.glob("*.jsonl")):
            for line in f.read_bytes().splitlines():
                total += len(msgspec.json.decode(line)["text"].encode())
    elif fmt == "parquet":
        import pyarrow.parquet as pq
        for f in sorted(path.glob("*.parquet")):
            total += sum(len(t.encode()) for t in pq.read_table(f).column("text").to_pylist())
    elif fmt == "mds":
        _, StreamingDataset = _streaming()
        dataset = StreamingDataset(local=str(path), shuffle=False, batch_size=1)
        total = sum(len(dataset[i]["text"].encode()) for i in range(len(dataset)))
    elif fmt == "litdata":
        from litdata import StreamingDataset
        dataset = StreamingDataset(str(path))
        total = sum(len(dataset[i]["text"].encode()) for i in range(len(dataset)))
    elif fmt == "webdataset":
        import tarfile
        for f in sorted(path.glob("*.tar")):
            with tarfile.open(f) as tar:
                for member in tar:
                    total += len(tar.extractfile(member).read())
    elif fmt == "megatron":
        try:
            from megatron.core.datasets.indexed_dataset import IndexedDataset
            for f in sorted(path.glob("*.bin")):
                dataset = IndexedDataset(str(f)[:-4])
                total += sum(len(dataset[i]) for i in range(len(dataset)))
        except ImportError:
            for f in sorted(path.glob("*.bin")):
                total += f.stat().st_size // 2
    return total


def loader_epoch(fmt: str, path: Path) -> dict:
    import streamload as sl
    started, cpu = time.perf_counter(), time.process_time()
    tokens = samples = 0
    with sl.Loader([sl.Source(str(path), format=fmt)], micro_batch_tokens=32768, micro_batches=2,
                   epochs=1, planner="naive") as loader:
        for batch in loader:
            for mb in batch.micro_batches:
                tokens += mb.num_tokens
                samples += len(mb.sample_ids)
        stats = loader.stats()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    read = stats["bytes_read"]
    return {"seconds": elapsed, "cpu_seconds": cpu, "tokens": tokens, "samples": samples,
            "bytes_read": read}


def raw_read_seconds(path: Path, chunk_bytes: int = 1 << 20) -> float:
    """The ceiling: every file under `path` read once through the store the Loader reads local
    files with, in ranges of the Loader's default chunk_bytes, 8 ranges at a time, nothing
    decoded."""
    import asyncio

    from streamload.storage.fs import LocalStore
    ranges = [(str(f), start, min(start + chunk_bytes, f.stat().st_size))
              for f in sorted(path.rglob("*")) if f.is_file()
              for start in range(0, f.stat().st_size, chunk_bytes)]

    async def read_all() -> None:
        store, limit = LocalStore(), asyncio.Semaphore(8)

        async def one(uri: str, start: int, end: int) -> None:
            async with limit:
                await store.read_range(uri, start, end)
        await asyncio.gather(*(one(*r) for r in ranges))

    started = time.perf_counter()
    asyncio.run(read_all())
    return time.perf_counter() - started


def first_step_bytes(fmt: str, path: Path) -> int:
    import streamload as sl
    with sl.Loader([sl.Source(str(path), format=fmt)], micro_batch_tokens=1024, micro_batches=1,
                   epochs=1, planner="naive", prefetch_steps=1, shard_prefetch=1,
                   max_shard_prefetch=1, range_readahead=1, autoscale=False,
                   chunk_bytes=64 << 10) as loader:
        next(iter(loader))
        stats = loader.stats()
    return stats["bytes_read"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args(argv)
    import streamload.loader  # noqa: F401  (torch and the Loader imported before any timing)
    texts = corpus(args.docs)
    text_bytes = sum(len(t.encode()) for t in texts)
    root = Path(tempfile.mkdtemp(prefix="streamload-formats-"))
    results = []
    for fmt in args.formats.split(","):
        path = write(fmt, texts, root)
        files = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        run = loader_epoch(fmt, path)
        raw_s = min(raw_read_seconds(path) for _ in range(3))
        started = time.perf_counter()
        ref_bytes = reference_read(fmt, path)
        ref_s = time.perf_counter() - started
        row = {"format": fmt, "documents": args.docs,
               "loader_mb_s": round(run["tokens"] / run["seconds"] / 1e6, 2),
               "loader_samples_s": round(run["samples"] / run["seconds"]),
               # what load on a shared machine does not change: MB per second of the process's
               # CPU (every thread: decode, plan, pack, the consumer)
               "loader_mb_per_cpu_s": round(run["tokens"] / run["cpu_seconds"] / 1e6, 2),
               "reference_mb_s": round(ref_bytes / ref_s / 1e6, 2),
               # the documents' text read at the raw ranged-read rate of the files holding it
               "raw_mb_s": round(text_bytes / raw_s / 1e6, 2),
               "vs_raw": round(run["tokens"] / run["seconds"] / (text_bytes / raw_s), 3),
               "bytes_read": run["bytes_read"], "bytes_delivered": run["tokens"],
               "delivered_all": run["tokens"] == text_bytes,
               "first_step_bytes": first_step_bytes(fmt, path), "files_bytes": files}
        print(f"{fmt}: loader {row['loader_mb_s']} MB/s ({row['loader_samples_s']:,} samples/s), "
              f"{row['vs_raw']}x the raw read ceiling ({row['raw_mb_s']} MB/s), "
              f"reference {row['reference_mb_s']} MB/s; read {row['bytes_read']:,} B for "
              f"{row['bytes_delivered']:,} B delivered; first step read "
              f"{row['first_step_bytes']:,} of {files:,} B", file=sys.stderr)
        results.append(row)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
