"""What one byte range costs the loader's I/O side: the S3 request, and decoding it.

    python benchmarks/range_cost.py

1. Client CPU per ranged GET through `S3Store.read_range` against the moto server (its own
   process, so its CPU is not counted), by range size: the fixed part (botocore builds, signs
   and parses the request; aiohttp connects and sends) and the part per byte (the body through
   aiohttp's parser and StreamReader, and the kernel's loopback copy). Best of 3 loops of 30.
2. Decoding one 2 MiB range of the benchmark corpus's `web` JSONL source (`_corpus.py`), step
   by step as `JsonlStream._columns` and `transform.record_tokens` take it, then the whole of
   `decode_columns` + `records_to_block` (best of 20, one thread); beside it, when pyarrow is
   installed, `pyarrow.json.read_json` of the same lines into one UTF-8 buffer and offsets
   (the columns byte tokens need, in C++ with the GIL released; not what the loader does).
JSON last line: {"request_us": {size: us}, "decode_ms": {step: ms}, "docs_per_range": n}.
"""
from __future__ import annotations

import asyncio
import json
import re
import sys
import tempfile
import time
from operator import attrgetter
from pathlib import Path

import msgspec
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _corpus  # noqa: E402
from _moto import MotoServer  # noqa: E402

SIZES = (1_000, 256 << 10, 2 << 20, 8 << 20)


async def _requests(storage_options) -> dict:
    from streamload.storage.s3 import S3Store
    store = S3Store(storage_options)
    await store.read_range("s3://bench/x/object.bin", 0, 10)   # the client made
    out = {}
    for size in SIZES:
        best = float("inf")
        for _ in range(3):
            started = time.process_time()
            for i in range(30):
                start = (i % 4) * (2 << 20) % ((8 << 20) - size + 1)
                await store.read_range("s3://bench/x/object.bin", start, start + size)
            best = min(best, (time.process_time() - started) / 30)
        out[size] = round(best * 1e6)
    await store.aclose()
    return out


def _best_ms(fn, n: int = 20) -> float:
    best = float("inf")
    for _ in range(n):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return round(best * 1e3, 3)


def _decode(workdir: Path) -> tuple[dict, int]:
    from streamload.formats.base import Problems, decode_columns
    from streamload.formats.jsonl import JsonlStream
    from streamload.pipeline.transform import records_to_block
    from streamload.storage.base import ObjectInfo
    info = _corpus.main_corpus(workdir, 300, 8)
    shard = sorted((Path(info.root) / "jsonl" / "web").glob("*.jsonl"))[0]
    data = shard.read_bytes()[: 2 << 20]
    lines = memoryview(data)[: data.rfind(b"\n")]
    record = msgspec.defstruct("Record", [("text", str)])
    values = msgspec.json.Decoder(record).decode_lines(lines)
    texts = list(map(attrgetter("text"), values))

    def whole():
        stream = JsonlStream(ObjectInfo(str(shard), len(data)), problems=Problems("web", "s"),
                             chunk_bytes=len(data), compression=None, text_field="text")
        records_to_block(decode_columns(stream, data), 0, 65536, "split")

    steps = {
        "blank-line check (regex)": lambda: re.compile(rb"\n[ \t\r]*\n").search(data),
        "line count": lambda: data.count(b"\n"),
        "msgspec decode_lines": lambda: msgspec.json.Decoder(record).decode_lines(lines),
        "UTF-8 encode, per text": lambda: [t.encode("utf-8") for t in texts],
        "all of decode_columns + records_to_block": whole,
    }
    try:
        import io

        import pyarrow as pa
        import pyarrow.json as pj
    except ImportError:
        pa = None
    if pa is not None:
        whole_lines = bytes(lines) + b"\n"
        parse = pj.ParseOptions(explicit_schema=pa.schema([("text", pa.string())]),
                                unexpected_field_behavior="ignore")
        read = pj.ReadOptions(use_threads=False, block_size=4 << 20)

        def arrow():
            column = pj.read_json(io.BytesIO(whole_lines), read_options=read,
                                  parse_options=parse).column(0).combine_chunks()
            np.frombuffer(column.buffers()[1], np.int32).astype(np.int64)
            np.frombuffer(column.buffers()[2], np.uint8)
        steps["pyarrow.json.read_json to UTF-8 buffer + offsets (comparison)"] = arrow
    return {name: _best_ms(fn) for name, fn in steps.items()}, len(texts)


def main() -> int:
    workdir = Path("/tmp/streamload-bench")
    decode, docs = _decode(workdir)
    with tempfile.TemporaryDirectory() as tmp, MotoServer() as s3:
        (Path(tmp) / "object.bin").write_bytes(np.random.default_rng(0).bytes(8 << 20))
        s3.upload_dir(Path(tmp), "bench", "x/")
        requests = asyncio.run(_requests(s3.storage_options))
    for size, us in requests.items():
        print(f"ranged GET of {size:>9,} bytes: {us:,} us of client CPU", file=sys.stderr)
    for name, ms in decode.items():
        print(f"2 MiB range ({docs} documents), {name}: {ms} ms", file=sys.stderr)
    print(json.dumps({"request_us": requests, "decode_ms": decode, "docs_per_range": docs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
