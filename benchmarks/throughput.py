"""Throughput and memory: streamload beside raw GETs, MosaicML Streaming and LitData.

    python benchmarks/throughput.py            # ~300 MB 5-source corpus, 3 alternating reps
    python benchmarks/throughput.py --small    # ~20 MB, a quick smoke run

One moto S3 server (its own process, 127.0.0.1) serves the same 5-source JSONL text corpus, and
its conversions to MDS and LitData chunks. Every loader reads the same mixture: streamload mixes
by tokens (= UTF-8 bytes here) with the weights; the peers mix by samples, so they get sample
proportions w_i / mean_doc_bytes_i, which give the same byte mix. Each loader reads
--read-fraction of the corpus's text (default half, so no source runs out) and stops. Every
measurement runs in fresh processes; the parent samples the RSS of each process tree every 50 ms.
Repetitions alternate: rep 1 runs every loader once, then rep 2, ... and medians are reported.

Loaders
  raw-aiobotocore     GET every JSONL object whole, 16 requests in flight (the server's ceiling;
                      MB/s of bytes on the wire, no samples)
  raw-aiobotocore-ranged  the same objects in --range-mb (2 MiB) range GETs, 16 in flight:
                      streamload's access pattern. moto reads the whole object to serve any
                      range, so on this server ranged reads have a lower ceiling than whole GETs
  streamload          1 process, and 2 gloo ranks (2 processes, the step budget split between them)
  mosaicml-streaming  StreamingDataset over one Stream per source (proportion=...), shuffle=True
                      (without it, streams are read one after another: no mixing), batch 8,
                      0 and 2 DataLoader workers
  litdata             CombinedStreamingDataset(weights=...) over one StreamingDataset per source,
                      batch 8, 0 and 2 workers
  litdata+packing     the same work as streamload (0 workers): the consumer also makes each text
                      byte tokens and packs them into full steps of M rows of C tokens with
                      streamload's own pack_rows (`_RowPacker`); no balancing. The litdata rows
                      above hand over texts only, which is less work than streamload's rows
  streamload on litdata chunks  streamload (1 rank) reading LitData's chunks instead of the JSONL:
                      the same input as the litdata rows (its format reader, ranged GETs)

Measured: samples/s (documents; a document streamload splits into several rows counts once),
text MB/s (UTF-8 bytes of text delivered), time to first batch (from constructing the loader,
imports excluded: each loader's module and the S3 client library it imports on first use,
streamload.loader (torch with it) and streamload.storage.s3 / boto3 / obstore, are imported
before the clock starts), peak RSS of
the process tree (sum of the processes' RSS, so pages shared between forked workers count once
per process), and for streamload the loader's CPU time per
step (process CPU time minus the consuming thread's own CPU time, over the steps). Throughput is
end to end: delivered / (last sample - loader construction); *_steady variants start the clock at
the first batch. Also peak RSS with 1, 10 and 100 sources (one epoch of small equal sources), and
the time of next() when the prefetch queue is full.

Per row, server_cpu_util is the moto server's CPU seconds over the measured time: near 1.0 the
server (one Python process) is the bottleneck.

The last line on stdout is JSON: {"results": [...], "rss_vs_sources": [...], "next_us_median": ...}.
A human-readable table goes to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _corpus  # noqa: E402
from _corpus import log  # noqa: E402
from _options import add_loader_options, loader_options  # noqa: E402

BUCKET = "bench"
PEER_BATCH = 8


# ==== worker side (runs in a fresh process per measurement) ========================================

def _collate_list(items):
    return items


def _stop_at(text_bytes: int, budget: int) -> bool:
    return text_bytes >= budget


def w_raw(spec: dict) -> dict:
    import aiobotocore.session
    from aiobotocore.config import AioConfig

    async def main():
        session = aiobotocore.session.get_session()
        t0 = time.perf_counter()
        first = None
        total = 0
        async with session.create_client(
                "s3", endpoint_url=spec["endpoint"], region_name="us-east-1",
                aws_access_key_id="testing", aws_secret_access_key="testing",
                config=AioConfig(max_pool_connections=spec["concurrency"])) as client:
            objects = []
            paginator = client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=BUCKET, Prefix="jsonl/"):
                objects += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
            step = spec.get("range_bytes")          # None: whole objects
            requests = [(k, None) for k, _ in objects] if not step else \
                [(k, (a, min(a + step, size) - 1)) for k, size in objects
                 for a in range(0, size, step)]
            sem = asyncio.Semaphore(spec["concurrency"])

            async def get(key, byte_range):
                nonlocal first, total
                async with sem:
                    extra = {} if byte_range is None else {"Range": "bytes=%d-%d" % byte_range}
                    resp = await client.get_object(Bucket=BUCKET, Key=key, **extra)
                    async with resp["Body"] as body:
                        async for chunk in body.iter_chunks(1 << 20):
                            if first is None:
                                first = time.perf_counter() - t0
                            total += len(chunk)

            await asyncio.gather(*(get(k, r) for k, r in requests))
        return {"elapsed_s": time.perf_counter() - t0, "first_batch_s": first,
                "text_bytes": total, "samples": None, "objects": len(objects),
                "requests": len(requests)}

    return asyncio.run(main())


def _sl_loader_options(opts: dict) -> dict:
    """Drop options this streamload version does not know (the loader is changing under us)."""
    try:
        from streamload.config import LoaderConfig
        known = set(LoaderConfig.__struct_fields__)
    except Exception:
        return opts
    dropped = sorted(set(opts) - known)
    if dropped:
        log(f"streamload does not know option(s) {dropped}; running without them")
    return {k: v for k, v in opts.items() if k in known}


def _is_new_doc(sample_id: str) -> bool:
    # "source/shard/record" or "source/shard/record:k" for the k-th piece of a split document
    head, sep, k = sample_id.rpartition(":")
    return not sep or "/" in k or k == "0"


def _summarize_sl_stats(stats: dict) -> dict:
    out = {k: stats.get(k) for k in ("steps", "stall_s", "plan_ms_median", "imbalance_mean")}
    per = {}
    for name, s in (stats.get("sources") or {}).items():
        per[name] = {k: s.get(k) for k in ("bytes_fetched", "requests", "retries",
                                           "fetch_latency_ms", "transform_s") if k in s}
    out["sources"] = per
    return out


def w_streamload(spec: dict) -> dict:
    rank, world = spec.get("rank", 0), spec.get("world", 1)
    setup0 = time.perf_counter()
    if world > 1:
        import datetime

        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}",
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
    import streamload as sl
    import streamload.loader  # noqa: F401  (Loader's module, torch with it: sl.Loader imports it)
    import streamload.storage.s3  # noqa: F401  (imported on first use: an import, not loading)
    sources = [sl.Source(f"s3://{BUCKET}/{spec['prefix']}/{name}/", weight=w, name=name)
               for name, w in spec["sources"]]
    opts = _sl_loader_options(spec.get("options", {}))
    steps_budget = spec.get("steps")            # None: one whole epoch
    t0 = time.perf_counter()
    cpu0, thread0 = time.process_time(), time.thread_time()
    first = None
    docs = pieces = tokens = steps = 0
    mix: dict = {}
    trace = _RssTrace.from_env()
    with sl.Loader(sources, micro_batch_tokens=spec["C"], micro_batches=spec["M"], epochs=1,
                   seed=0, storage_options=spec["storage_options"], **opts) as loader:
        for batch in loader:
            if first is None:
                first = time.perf_counter() - t0
            if trace is not None:
                trace.step(steps, loader)
            for mb in batch.micro_batches:
                tokens += mb.num_tokens
                pieces += len(mb.sample_ids)
                docs += sum(1 for s in mb.sample_ids if _is_new_doc(s))
                bounds = mb.cu_seqlens.tolist()
                for s, a, b in zip(mb.sample_ids, bounds, bounds[1:]):
                    src = s.split("/", 1)[0]
                    mix[src] = mix.get(src, 0) + (b - a)
            steps += 1
            if steps_budget is not None and steps >= steps_budget:
                break
        elapsed = time.perf_counter() - t0
        cpu, thread = time.process_time() - cpu0, time.thread_time() - thread0
        stats = loader.stats()
        if trace is not None:
            trace.finish(stats)
        closing = time.perf_counter()
    close_s = time.perf_counter() - closing
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
    return {"elapsed_s": elapsed, "first_batch_s": first, "text_bytes": tokens, "samples": docs,
            "pieces": pieces, "steps": steps, "mix": mix, "close_s": close_s,
            "setup_s": t0 - setup0,
            "loader_cpu_ms_per_step": (cpu - thread) / max(1, steps) * 1e3,
            "process_cpu_s": cpu, "consumer_cpu_s": thread, "stats": _summarize_sl_stats(stats)}


class _RssTrace:
    """A diagnostic (env THROUGHPUT_RSS_TRACE=<file>): where a streamload worker's RSS goes
    over the run. Every 10 steps one line: step, VmRSS, the smaps_rollup's anonymous and file
    pages, and (THROUGHPUT_TRACEMALLOC=1) the bytes Python's allocators hold; at the end the
    tracemalloc sites that grew most since the first batch, and the loader's in-flight stats."""

    def __init__(self, path: str, tracing: bool):
        self.out = open(path, "a")
        self.tracing = tracing
        self.first = None
        self.large: dict = {}
        if tracing:
            import tracemalloc
            tracemalloc.start(8)

    @classmethod
    def from_env(cls):
        path = os.environ.get("THROUGHPUT_RSS_TRACE")
        return cls(path, os.environ.get("THROUGHPUT_TRACEMALLOC") == "1") if path else None

    @staticmethod
    def _memory() -> dict:
        out = {}
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Anonymous", "Private_Dirty", "Shared_Clean", "Private_Clean"):
                    out[key] = int(rest.split()[0]) // 1024
        return out

    def step(self, steps: int, loader) -> None:
        every = int(os.environ.get("THROUGHPUT_MALLOC_TRIM", "0"))   # an experiment
        if every and steps % every == 0:
            import ctypes
            started = time.thread_time()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            self.trim_s = getattr(self, "trim_s", 0.0) + time.thread_time() - started
        if steps % 10:
            return
        line = {"step": steps, **self._memory(), "threads": threading.active_count(),
                "trim_ms": round(getattr(self, "trim_s", 0.0) * 1e3, 2)}
        if self.tracing:
            import tracemalloc
            line["traced_mb"] = tracemalloc.get_traced_memory()[0] // 2**20
            snapshot = tracemalloc.take_snapshot()
            if self.first is None:
                self.first = snapshot
            # the live blocks glibc serves from its arenas once its mmap threshold has risen
            # (128 KiB to 32 MiB), by where they were allocated
            for trace in snapshot.traces:
                if 2**17 <= trace.size < 2**25:
                    key = tuple(str(f) for f in trace.traceback[-4:])
                    count, total = self.large.get(key, (0, 0))
                    self.large[key] = (count + 1, total + trace.size)
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()

    def finish(self, stats: dict) -> None:
        self.out.write(json.dumps({"end": self._memory()}) + "\n")
        self.out.flush()
        import ctypes   # glibc's per-arena figures (malloc_stats writes them to stderr)
        saved = os.dup(2)
        os.dup2(self.out.fileno(), 2)
        try:
            ctypes.CDLL("libc.so.6").malloc_stats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        for key, (count, total) in sorted(self.large.items(), key=lambda kv: -kv[1][1])[:15]:
            self.out.write(f"large live blocks: {count} seen, mean {total / count / 2**10:.0f} "
                           f"KiB at\n  " + "\n  ".join(key) + "\n")
        if self.tracing and self.first is not None:
            import tracemalloc
            diff = tracemalloc.take_snapshot().compare_to(self.first, "traceback")
            for d in diff[:12]:
                self.out.write(f"{d.size_diff / 2**20:+.2f} MB now {d.size / 2**20:.2f} MB "
                               f"count {d.count_diff:+d}\n  " +
                               "\n  ".join(d.traceback.format()[-8:]) + "\n")
        self.out.write(json.dumps(stats.get("sources", stats), default=str)[:4000] + "\n")
        self.out.close()


def w_streamload_next(spec: dict) -> dict:
    """Time next() with the prefetch queue full: sleep long enough for the loader to queue
    prefetch_steps batches, then time that many next() calls; repeat."""
    import streamload as sl
    import streamload.loader  # noqa: F401
    sources = [sl.Source(f"s3://{BUCKET}/{spec['prefix']}/{name}/", weight=w, name=name)
               for name, w in spec["sources"]]
    opts = _sl_loader_options(spec.get("options", {}))
    queued = opts.get("prefetch_steps", 2)
    times_ns = []
    steps = 0
    with sl.Loader(sources, micro_batch_tokens=spec["C"], micro_batches=spec["M"], epochs=1,
                   seed=0, storage_options=spec["storage_options"], **opts) as loader:
        it = iter(loader)
        next(it)
        time.sleep(1.0)                                   # warm up: fill buffers and the queue
        cpu0, thread0 = time.process_time(), time.thread_time()
        stall0 = loader.stats().get("stall_s", 0.0)
        try:
            for _ in range(spec["rounds"]):
                time.sleep(spec["sleep_s"])
                for _ in range(queued):
                    started = time.perf_counter_ns()
                    next(it)
                    times_ns.append(time.perf_counter_ns() - started)
                    steps += 1
        except StopIteration:
            pass
        cpu, thread = time.process_time() - cpu0, time.thread_time() - thread0
        stats = loader.stats()
    us = sorted(t / 1e3 for t in times_ns)

    def q(p):
        return us[min(len(us) - 1, int(p * len(us)))] if us else None
    return {"calls": len(us), "queued_per_round": queued, "next_us_median": statistics.median(us) if us else None,
            "next_us_p90": q(0.9), "next_us_p99": q(0.99), "next_us_max": us[-1] if us else None,
            "slow_calls_over_1ms": sum(1 for x in us if x > 1000),
            "loader_cpu_ms_per_step": (cpu - thread) / max(1, steps) * 1e3,
            "stall_s_during": stats.get("stall_s", 0.0) - stall0, "steps": steps}


def w_mosaic(spec: dict) -> dict:
    streaming = _corpus.import_streaming()
    import boto3  # noqa: F401  (Streaming's S3 client, imported on first download)
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader
    clean_stale_shared_memory()
    cache = Path(spec["cache"])
    t0 = time.perf_counter()
    streams = [streaming.Stream(remote=f"s3://{BUCKET}/{spec['prefix']}/{name}/",
                                local=str(cache / name), proportion=p)
               for name, p in spec["sources"]]
    ds = streaming.StreamingDataset(streams=streams, shuffle=spec.get("shuffle", True),
                                    shuffle_seed=0, batch_size=PEER_BATCH)
    dl = DataLoader(ds, batch_size=PEER_BATCH, num_workers=spec["workers"],
                    collate_fn=_collate_list)
    return _consume_peer(dl, t0, spec.get("budget"), cache=str(cache))


def w_litdata(spec: dict) -> dict:
    import litdata
    import obstore  # noqa: F401  (LitData's S3 client, imported on first download)
    from litdata.streaming import downloader
    from litdata.streaming.resolver import Dir
    # LitData fetches chunks with obstore (Rust object_store), which refuses plain-http
    # endpoints unless its client option allow_http is set, and LitData has no setting that
    # reaches it. The loopback moto server speaks http only, so we add that one key to
    # LitData's own obstore client options (everything else as shipped); without it every
    # chunk GET fails with "BadScheme". Forked DataLoader workers inherit the change.
    if isinstance(getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None), dict):
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    if spec.get("pack"):
        import streamload.plan.packing  # noqa: F401  (the packing's modules, before the clock)
        import streamload.pipeline.recycle  # noqa: F401
    cache = Path(spec["cache"])
    t0 = time.perf_counter()
    opts = spec["storage_options"]
    datasets = [litdata.StreamingDataset(
        input_dir=Dir(path=str(cache / name), url=f"s3://{BUCKET}/{spec['prefix']}/{name}"),
        storage_options=dict(opts), shuffle=False) for name, _ in spec["sources"]]
    if len(datasets) == 1:
        ds = datasets[0]
    else:
        # With no budget (one whole epoch of every source), iterate_over_all=True, which takes
        # no weights; otherwise mix by the weights and stop at the budget.
        whole = spec.get("budget") is None
        ds = litdata.CombinedStreamingDataset(
            datasets, weights=None if whole else [p for _, p in spec["sources"]],
            iterate_over_all=whole, seed=0)
    dl = litdata.StreamingDataLoader(ds, batch_size=PEER_BATCH, num_workers=spec["workers"],
                                     collate_fn=_collate_list)
    return _consume_peer(dl, t0, spec.get("budget"), spec.get("pack"), str(cache))


def _cached_bytes(cache: Optional[str]) -> Optional[int]:
    """Bytes a peer has downloaded into its local cache directory so far."""
    if cache is None:
        return None
    total = 0
    for folder, _, files in os.walk(cache):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:   # a chunk being renamed or evicted meanwhile
                pass
    return total


def _consume_peer(dl, t0: float, budget, pack: Optional[dict] = None,
                  cache: Optional[str] = None) -> dict:
    """Iterate a peer's loader until `budget` bytes of text. `pack` ({"C", "M"}): also do what
    streamload's loader does with each sample before the trainer sees it (`_RowPacker`), so the
    peer's figure counts the same work; None: the texts only (the peers' own output). `cache`:
    the peer's cache directory, whose size at the first batch tells how much of what it will
    read it had downloaded before its steady state began (the look-up's time is left out)."""
    first = None
    cached_at_first = None
    docs = text = 0
    mix: dict = {}
    packer = None if pack is None else _RowPacker(pack["C"], pack["M"])
    cpu0, thread0 = time.process_time(), time.thread_time()
    for batch in dl:
        if first is None:
            first = time.perf_counter() - t0
            looked = time.perf_counter()
            cached_at_first = _cached_bytes(cache)
            t0 += time.perf_counter() - looked
        for item in batch:
            encoded = item["text"].encode()
            n = len(encoded)
            docs += 1
            text += n
            mix[item["src"]] = mix.get(item["src"], 0) + n
            if packer is not None:
                packer.add(encoded, item["src"], docs)
        if budget is not None and text >= budget:
            break
    elapsed = time.perf_counter() - t0
    out = {"elapsed_s": elapsed, "first_batch_s": first, "text_bytes": text, "samples": docs,
           "mix": mix, "process_cpu_s": time.process_time() - cpu0,
           "consumer_cpu_s": time.thread_time() - thread0, "cached_at_first": cached_at_first,
           "cached_at_end": _cached_bytes(cache)}
    if packer is not None:
        out.update(steps=packer.steps, pack_cpu_s=packer.cpu_s)
    del dl
    return out


class _RowPacker:
    """A peer's samples made into what streamload's loader hands the trainer, without the
    balancing: each text's UTF-8 bytes as tokens (streamload's default tokenizer), cut into
    steps of M rows of exactly C tokens (concatenate and cut, a document split across rows as
    streamload's full steps split one), packed by streamload's own `pack_rows` into recycled
    step memory (int64 tokens, positions, labels, float32 loss mask, cu_seqlens), five tensors
    and a sample id per document piece per row. The same packing code as the loader's, so
    what differs between the two columns is the data path and the planning, not the rows."""

    def __init__(self, C: int, M: int):
        import numpy as np
        from streamload.pipeline.recycle import ArrayRecycler
        from streamload.plan.packing import row_memory_words
        self.C, self.M, self.np = C, M, np
        self.step_tokens = C * M
        self.memory = ArrayRecycler(row_memory_words(self.step_tokens), np.int64, 4)
        self.counting = np.arange(C, dtype=np.int64)
        self.pending: list = []       # (tokens, id) not yet in a step
        self.pending_tokens = 0
        self.steps = 0
        self.cpu_s = 0.0
        self.held = None              # the last step, alive as a trainer's batch would be

    def add(self, encoded: bytes, src: str, index: int) -> None:
        started = time.thread_time()
        self.pending.append((self.np.frombuffer(encoded, self.np.uint8), f"{src}/{index}"))
        self.pending_tokens += len(encoded)
        while self.pending_tokens >= self.step_tokens:
            self._step()
        self.cpu_s += time.thread_time() - started

    def _step(self) -> None:
        import torch
        from streamload.plan.packing import pack_rows, split_row_memory
        np, C = self.np, self.C
        pieces, rows, ids = [], [], []
        row, room = 0, C
        while row < self.M:
            tokens, sid = self.pending[0]
            take = min(room, len(tokens))
            pieces.append(tokens[:take])
            rows.append(row)
            ids.append(sid)
            if take < len(tokens):     # the rest starts the next row (or the next step)
                self.pending[0] = (tokens[take:], sid + ":+")
            else:
                self.pending.pop(0)
            room -= take
            if room == 0:
                row, room = row + 1, C
        self.pending_tokens -= self.step_tokens
        memory = self.memory.take()
        packed = pack_rows(pieces, np.array(rows, np.int64), self.M, C,
                           out=split_row_memory(memory, self.step_tokens),
                           counting=self.counting)
        self.held = [(torch.from_numpy(r.tokens), torch.from_numpy(r.cu_seqlens),
                      torch.from_numpy(r.position_ids), torch.from_numpy(r.labels),
                      torch.from_numpy(r.loss_mask),
                      [ids[k] for k in r.item_indices.tolist()], r.max_seqlen)
                     for r in packed]
        self.steps += 1


def w_imports(spec: dict) -> dict:
    """Import what a loader needs and nothing else: the RSS floor of its process."""
    kind = spec["loader"]
    if kind == "raw":
        import aiobotocore.session  # noqa: F401
    elif kind == "streamload":
        import streamload.loader  # noqa: F401  (`import streamload` alone leaves torch out)
    elif kind == "mosaic":
        _corpus.import_streaming()
        import torch.utils.data  # noqa: F401
    elif kind == "litdata":
        import litdata  # noqa: F401
    time.sleep(0.3)          # a few RSS samples
    return {"imported": kind}


WORKERS = {"imports": w_imports, "raw": w_raw, "streamload": w_streamload, "streamload_next": w_streamload_next,
           "mosaic": w_mosaic, "litdata": w_litdata}


def worker_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    started = time.perf_counter()
    result = WORKERS[spec["kind"]](spec)
    result["worker_s"] = time.perf_counter() - started
    sys.stdout.flush()
    print("RESULT " + json.dumps(result), flush=True)
    if spec["kind"] in ("mosaic", "litdata"):
        os._exit(0)       # skip slow/fragile interpreter teardown of worker pools and shm


# ==== parent side ====================================================================================

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TreeSampler:
    """Peak of the summed RSS of some process trees, sampled every 50 ms."""

    def __init__(self, pids: list[int], period: float = 0.05):
        import psutil
        self.psutil = psutil
        self.roots = [psutil.Process(p) for p in pids]
        self.period = period
        self.peak_total = 0
        self.peak_per_root = [0] * len(pids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree_rss(self, root) -> int:
        total = 0
        try:
            procs = [root] + root.children(recursive=True)
        except self.psutil.Error:
            return 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except self.psutil.Error:
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            per = [self._tree_rss(r) for r in self.roots]
            self.peak_total = max(self.peak_total, sum(per))
            self.peak_per_root = [max(a, b) for a, b in zip(self.peak_per_root, per)]
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


SERVER_PID = None      # the moto server's pid: its CPU time per measurement is reported


def _server_cpu() -> float:
    if SERVER_PID is None:
        return 0.0
    import psutil
    try:
        t = psutil.Process(SERVER_PID).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def run_workers(specs: list[dict], env: dict, timeout: float) -> dict:
    """Run one worker process per spec (ranks of one job); returns their results and RSS."""
    server_cpu0 = _server_cpu()
    procs = []
    wall0 = time.perf_counter()
    for spec in specs:
        procs.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True))
    outs = [None] * len(procs)
    errs = [None] * len(procs)

    def collect(i, p):
        outs[i], errs[i] = p.communicate()
    readers = [threading.Thread(target=collect, args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    sampler = TreeSampler([p.pid for p in procs])
    deadline = time.monotonic() + timeout
    timed_out = False
    with sampler:
        for t in readers:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                timed_out = True
                break
    if timed_out:
        for p in procs:
            try:
                os.killpg(p.pid, 9)         # the worker's own session: it and its children
            except ProcessLookupError:
                pass
        for t in readers:
            t.join(10)
    results, failures = [], []
    for i, p in enumerate(procs):
        line = next((l for l in reversed((outs[i] or "").splitlines()) if l.startswith("RESULT ")),
                    None)
        if line is None:
            tail = "\n".join((errs[i] or "").strip().splitlines()[-15:])
            failures.append(f"worker {i} {'timed out' if timed_out else f'exit {p.returncode}'}:"
                            f"\n{tail}")
        else:
            results.append(json.loads(line[len("RESULT "):]))
    return {"results": results, "failures": failures, "wall_s": time.perf_counter() - wall0,
            "server_cpu_s": _server_cpu() - server_cpu0,
            "peak_rss_mb": sampler.peak_total / 2**20,
            "peak_rss_mb_per_rank": max(sampler.peak_per_root) / 2**20}


def combine(loader: str, ranks: int, workers, run: dict) -> dict:
    """One measurement row from the ranks' results."""
    rs = run["results"]
    row = {"loader": loader, "ranks": ranks, "workers": workers,
           "peak_rss_mb": round(run["peak_rss_mb"], 1),
           "peak_rss_mb_per_rank": round(run["peak_rss_mb_per_rank"], 1)}
    if run["failures"] or len(rs) != ranks:
        row["error"] = "\n".join(run["failures"])[-3000:]
        return row
    elapsed = max(r["elapsed_s"] for r in rs)
    firsts = [r["first_batch_s"] for r in rs if r["first_batch_s"] is not None]
    if not firsts:
        row["error"] = "no batch delivered"
        return row
    first = max(firsts)
    text = sum(r["text_bytes"] for r in rs)
    samples = None if rs[0]["samples"] is None else sum(r["samples"] for r in rs)
    steady = max(1e-9, elapsed - first)
    # The server idles while workers import; its CPU over the measured window is about this
    # (a busy server shows server_cpu_util near 1.0: one core, one GIL).
    row["server_cpu_s"] = round(run.get("server_cpu_s", 0.0), 2)
    row["server_cpu_util"] = round(run.get("server_cpu_s", 0.0) / elapsed, 2)
    row.update({
        "samples": samples, "text_mb": round(text / 1e6, 2), "elapsed_s": round(elapsed, 3),
        "samples_per_s": None if samples is None else round(samples / elapsed, 1),
        "mb_per_s": round(text / 1e6 / elapsed, 2),
        "first_batch_s": round(first, 3),
        "samples_per_s_steady": None if samples is None else round(samples / steady, 1),
        "mb_per_s_steady": round(text / 1e6 / steady, 2),
    })
    mix: dict = {}
    for r in rs:
        for k, v in (r.get("mix") or {}).items():
            mix[k] = mix.get(k, 0) + v
    if mix:
        total = sum(mix.values()) or 1
        row["mix"] = {k: round(v / total, 3) for k, v in sorted(mix.items())}
    if all("process_cpu_s" in r for r in rs) and samples:
        # CPU time of the loader's processes (every thread) per sample from construction on;
        # with 0 workers a peer's whole work is in this process (its downloads included), so
        # this compares the work done per sample whatever the machine's load
        row["process_cpu_us_per_sample"] = round(
            sum(r["process_cpu_s"] for r in rs) / samples * 1e6, 1)
    if rs[0].get("cached_at_first") is not None:   # a peer: downloaded before its first batch
        row["cached_mb_at_first_batch"] = round(rs[0]["cached_at_first"] / 1e6, 1)
        row["cached_mb_at_end"] = round(rs[0]["cached_at_end"] / 1e6, 1)
    if "pack_cpu_s" in rs[0]:   # litdata+packing: the consumer's CPU, and its packing's
        row["consumer_cpu_us_per_sample"] = round(
            rs[0]["consumer_cpu_s"] / max(1, rs[0]["samples"]) * 1e6, 1)
        row["pack_cpu_us_per_sample"] = round(
            rs[0]["pack_cpu_s"] / max(1, rs[0]["samples"]) * 1e6, 1)
    if "loader_cpu_ms_per_step" in rs[0]:
        row["loader_cpu_ms_per_step"] = round(statistics.mean(
            r["loader_cpu_ms_per_step"] for r in rs), 3)
        row["steps"] = rs[0]["steps"]
        row["stall_s"] = round(max(r["stats"].get("stall_s") or 0 for r in rs), 3)
        row["plan_ms_median"] = rs[0]["stats"].get("plan_ms_median")
    return row


def median_row(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return {**rows[0], "reps": 0}
    out = dict(ok[0])
    for key, value in ok[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and key not in ("ranks", "workers", "steps"):
            vals = [r[key] for r in ok if r.get(key) is not None]
            out[key] = round(statistics.median(vals), 3) if vals else None
    out["reps"] = len(ok)
    out["failed_reps"] = len(rows) - len(ok)
    return out


def fmt(x, spec="{:.1f}"):
    return "—" if x is None else spec.format(x)


def print_tables(results, rss_sources, nxt, ceiling):
    p = lambda s="": print(s, file=sys.stderr)  # noqa: E731
    p()
    p("| loader | ranks | workers | samples/s | text MB/s | first batch | peak RSS (tree) "
      "| peak RSS per rank | RSS after imports | reps |")
    p("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r.get("reps") == 0:
            p(f"| {r['loader']} | {r['ranks']} | {fmt(r['workers'], '{}')} | FAILED | | | | | | 0 |")
            continue
        p(f"| {r['loader']} | {r['ranks']} | {fmt(r['workers'], '{}')} "
          f"| {fmt(r.get('samples_per_s'), '{:,.0f}')} | {fmt(r.get('mb_per_s'))} "
          f"| {fmt(r.get('first_batch_s'), '{:.2f} s')} | {fmt(r['peak_rss_mb'], '{:,.0f} MB')} "
          f"| {fmt(r['peak_rss_mb_per_rank'], '{:,.0f} MB')} "
          f"| {fmt(r.get('import_rss_mb'), '{:,.0f} MB')} | {r.get('reps')} |")
    p()
    p("steady state (clock starts at the first batch):")
    for r in results:
        if r.get("reps"):
            p(f"  {r['loader']:<20} ranks={r['ranks']} workers={fmt(r['workers'], '{}'):<2} "
              f"samples/s={fmt(r.get('samples_per_s_steady'), '{:,.0f}'):>8}  "
              f"MB/s={fmt(r.get('mb_per_s_steady'))}  server CPU={fmt(r.get('server_cpu_util'), '{:.2f}')}"
              + (f"  loader CPU/step={r['loader_cpu_ms_per_step']:.2f} ms  stall={r['stall_s']:.2f} s"
                 f"  plan_ms_median={fmt(r.get('plan_ms_median'), '{:.2f}')}"
                 if "loader_cpu_ms_per_step" in r else "")
              + (f"  process CPU/sample={r['process_cpu_us_per_sample']:.0f} µs"
                 if r.get("process_cpu_us_per_sample") else "")
              + (f"  cached at first batch={r['cached_mb_at_first_batch']:.0f} of "
                 f"{r['cached_mb_at_end']:.0f} MB" if r.get("cached_mb_at_end") is not None else "")
              + (f"  consumer CPU/sample={r['consumer_cpu_us_per_sample']:.1f} µs (packing "
                 f"{r['pack_cpu_us_per_sample']:.1f})" if "pack_cpu_us_per_sample" in r else "")
              + ("  mix " + " ".join(f"{k}={v:.2f}" for k, v in r["mix"].items())
                 if r.get("mix") else ""))
    if rss_sources:
        p()
        p("| loader | sources | peak RSS (tree) |")
        p("|---|---|---|")
        for r in rss_sources:
            p(f"| {r['loader']} | {r['sources']} | "
              f"{'FAILED' if r.get('peak_rss_mb') is None else format(r['peak_rss_mb'], ',.0f') + ' MB'} |")
    if nxt:
        p()
        p(f"next() with the prefetch queue full: median {fmt(nxt.get('next_us_median'), '{:.1f}')} µs, "
          f"p90 {fmt(nxt.get('next_us_p90'), '{:.1f}')} µs, p99 {fmt(nxt.get('next_us_p99'), '{:.1f}')} µs "
          f"over {nxt.get('calls')} calls; loader CPU per step with a slow trainer "
          f"{fmt(nxt.get('loader_cpu_ms_per_step'), '{:.2f}')} ms")
    for name, value in (ceiling or {}).items():
        if value is not None:
            p(f"{name} ceiling: {value:.1f} MB/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="~20 MB corpus: a quick smoke run")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "streamload-bench"),
                    help="where corpora and their conversions are cached (default %(default)s)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--read-fraction", type=float, default=0.5,
                    help="fraction of the corpus's text each loader reads (default %(default)s)")
    ap.add_argument("--loaders", default="raw,streamload,mosaic,litdata",
                    help="comma list of raw, streamload, mosaic, litdata")
    ap.add_argument("--no-rss-sources", action="store_true", help="skip RSS vs number of sources")
    ap.add_argument("--no-same-work", action="store_true",
                    help="skip the rows 'litdata+packing' (LitData, 0 workers, whose consumer "
                         "also tokenizes and packs every sample into streamload's rows) and "
                         "'streamload on litdata chunks' (streamload reading LitData's input)")
    ap.add_argument("--peer-rss-sources", choices=("auto", "yes", "no"), default="auto",
                    help="also measure the peers' RSS vs sources (auto: not with --small)")
    ap.add_argument("--micro-batch-tokens", type=int, default=65536)
    ap.add_argument("--micro-batches", type=int, default=4)
    add_loader_options(ap)
    ap.add_argument("--range-mb", type=float, default=2.0,
                    help="range size of the ranged raw-GET ceiling (streamload's default "
                         "chunk_bytes is 2 MiB)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per measurement, seconds")
    args = ap.parse_args(argv)

    small = args.small
    args.no_peer_rss_sources = args.peer_rss_sources == "no" or (
        args.peer_rss_sources == "auto" and small)
    total_mb, shard_mb = (20, 1) if small else (300, 8)
    many_kb = 200 if small else 400
    wanted = set(args.loaders.split(","))
    sl_opts = loader_options(args.sl_opt, planner="naive")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    info = _corpus.main_corpus(workdir, total_mb, shard_mb)
    peers = wanted & {"mosaic", "litdata"}
    if "mosaic" in peers:
        _corpus.to_mds(info, shard_mb)
    if "litdata" in peers:
        _corpus.to_litdata(info, shard_mb)
    many = None
    if not args.no_rss_sources:
        many = _corpus.many_corpus(workdir, 100, many_kb)
        if not args.no_peer_rss_sources:
            if "mosaic" in peers:
                _corpus.to_mds(many, many_kb / 2e3)
            if "litdata" in peers:
                _corpus.to_litdata(many, many_kb / 2e3)

    weights = [(s.name, s.weight) for s in info.sources]
    proportions = list(zip([s.name for s in info.sources], info.sample_proportions()))
    budget = int(info.text_bytes * args.read_fraction)
    C, M = args.micro_batch_tokens, args.micro_batches
    range_bytes = int(args.range_mb * 2**20)
    log(f"corpus {info.text_bytes / 1e6:.0f} MB text in {info.docs} docs; each loader reads "
        f"~{budget / 1e6:.0f} MB; token weights {dict(weights)}; peer sample proportions "
        f"{ {k: round(v, 4) for k, v in proportions} }")

    cache_root = Path(tempfile.mkdtemp(prefix="cache-", dir=workdir))
    with _corpus_server(info, many, peers, args) as s3:
        global SERVER_PID
        SERVER_PID = s3.pid
        env = _moto_env(s3)
        so = s3.storage_options

        def job(name):
            """(loader, ranks, workers, [specs]) for one configuration."""
            def cache_dir():
                return str(Path(tempfile.mkdtemp(dir=cache_root)))
            if name == "raw":
                return ("raw-aiobotocore", 1, None,
                        lambda: [{"kind": "raw", "endpoint": s3.endpoint_url, "concurrency": 16}])
            if name == "raw-ranged":
                return ("raw-aiobotocore-ranged", 1, None,
                        lambda: [{"kind": "raw", "endpoint": s3.endpoint_url, "concurrency": 16,
                                  "range_bytes": range_bytes}])
            if name == "streamload-litdata":   # the same input as LitData: its chunks
                steps = math.ceil(budget / (M * C))
                return ("streamload on litdata chunks", 1, None, lambda: [
                    {"kind": "streamload", "rank": 0, "world": 1, "prefix": "litdata",
                     "sources": weights, "C": C, "M": M, "steps": steps,
                     "storage_options": so, "options": sl_opts}])   # the "text" leaf: the default
            if name.startswith("streamload"):
                world = 2 if name.endswith("2") else 1
                steps = math.ceil(budget / (world * M * C))

                def specs():
                    port = free_port()
                    return [{"kind": "streamload", "rank": r, "world": world, "port": port,
                             "prefix": "jsonl", "sources": weights, "C": C, "M": M,
                             "steps": steps, "storage_options": so, "options": sl_opts}
                            for r in range(world)]
                return ("streamload", world, None, specs)
            if name == "litdata-packed":   # LitData, 0 workers, doing streamload's packing
                return ("litdata+packing", 1, 0,
                        lambda: [{"kind": "litdata", "workers": 0, "prefix": "litdata",
                                  "sources": proportions, "budget": budget,
                                  "cache": cache_dir(), "storage_options": so,
                                  "pack": {"C": C, "M": M}}])
            kind, workers = name.rsplit("-", 1)
            prefix = "mds" if kind == "mosaic" else "litdata"
            label = "mosaicml-streaming" if kind == "mosaic" else "litdata"
            return (label, 1, int(workers),
                    lambda: [{"kind": kind, "workers": int(workers), "prefix": prefix,
                              "sources": proportions, "budget": budget, "cache": cache_dir(),
                              "storage_options": so}])

        configs = []
        if "raw" in wanted:
            configs += ["raw", "raw-ranged"]
        if "streamload" in wanted:
            configs += ["streamload-1", "streamload-2"]
        for kind in ("mosaic", "litdata"):
            if kind in wanted:
                configs += [f"{kind}-0", f"{kind}-2"]
        if "litdata" in wanted and not args.no_same_work:
            configs += ["litdata-packed"]
            if "streamload" in wanted:
                configs += ["streamload-litdata"]

        rows: dict[str, list] = {c: [] for c in configs}
        for rep in range(args.reps):
            for c in configs:
                label, ranks, workers, specs = job(c)
                run = run_workers(specs(), env, args.timeout)
                row = combine(label, ranks, workers, run)
                rows[c].append(row)
                _clear(cache_root)
                if "error" in row:
                    log(f"rep {rep + 1} {c}: FAILED\n{row['error']}")
                else:
                    log(f"rep {rep + 1} {c}: {fmt(row.get('samples_per_s'), '{:,.0f}')} samples/s "
                        f"{row['mb_per_s']:.1f} MB/s first {row['first_batch_s']:.2f}s "
                        f"rss {row['peak_rss_mb']:.0f} MB (measured {row['elapsed_s']:.1f}s of "
                        f"{run['wall_s']:.1f}s)")
        results = [median_row(rows[c]) for c in configs]

        # RSS of a process that only imports each loader's modules (torch alone is ~230 MB)
        baseline = {}
        for kind in (["raw", "streamload", "mosaic", "litdata"] if not small else ["streamload"]):
            if kind in wanted:
                run = run_workers([{"kind": "imports", "loader": kind}], env, args.timeout)
                if not run["failures"]:
                    baseline[kind] = round(run["peak_rss_mb"], 1)
        labels = {"raw-aiobotocore": "raw", "raw-aiobotocore-ranged": "raw",
                  "streamload": "streamload",
                  "mosaicml-streaming": "mosaic", "litdata": "litdata",
                  "litdata+packing": "litdata",
                  "streamload on litdata chunks": "streamload"}
        for r in results:
            if labels.get(r["loader"]) in baseline:
                r["import_rss_mb"] = baseline[labels[r["loader"]]]
        log(f"RSS after imports only: {baseline}")
        ceiling = {r["loader"]: r.get("mb_per_s") for r in results
                   if r["loader"].startswith("raw-") and r.get("reps")}

        rss_sources = []
        if many is not None:
            names = [s.name for s in many.sources]
            loaders = ["streamload"]
            if not args.no_peer_rss_sources:
                loaders += [k for k in ("mosaic", "litdata") if k in peers]
            for k in (1, 10, 100):
                for kind in loaders:
                    if kind == "streamload":
                        spec = {"kind": "streamload", "prefix": "many/jsonl",
                                "sources": [(n, 1.0) for n in names[:k]], "C": C, "M": M,
                                "steps": None, "storage_options": so, "options": sl_opts}
                        label = "streamload"
                    else:
                        spec = {"kind": kind, "workers": 0,
                                "prefix": "many/mds" if kind == "mosaic" else "many/litdata",
                                "sources": [(n, 1.0 / k) for n in names[:k]], "budget": None,
                                "cache": str(Path(tempfile.mkdtemp(dir=cache_root))),
                                "storage_options": so}
                        label = "mosaicml-streaming" if kind == "mosaic" else "litdata"
                    run = run_workers([spec], env, args.timeout)
                    _clear(cache_root)
                    ok = not run["failures"]
                    entry = {"loader": label, "sources": k,
                             "peak_rss_mb": round(run["peak_rss_mb"], 1) if ok else None}
                    if ok:
                        r = run["results"][0]
                        entry.update(text_mb=round(r["text_bytes"] / 1e6, 2),
                                     elapsed_s=round(r["elapsed_s"], 2))
                        if kind != "streamload":
                            entry["workers"] = 0
                    else:
                        entry["error"] = "\n".join(run["failures"])[-2000:]
                        log(f"rss vs sources {label} {k}: FAILED\n{entry['error']}")
                    log(f"rss vs sources: {label} x{k}: {fmt(entry['peak_rss_mb'])} MB")
                    rss_sources.append(entry)

        nxt = {}
        if "streamload" in wanted:
            spec = {"kind": "streamload_next", "prefix": "jsonl", "sources": weights, "C": C,
                    "M": M, "storage_options": so, "rounds": 25, "sleep_s": 0.3,
                    "options": {**sl_opts, "prefetch_steps": 8}}
            run = run_workers([spec], env, args.timeout)
            if run["failures"]:
                log("next() overhead: FAILED\n" + "\n".join(run["failures"]))
            else:
                nxt = run["results"][0]
                log(f"next(): median {nxt['next_us_median']:.1f} µs over {nxt['calls']} calls")

    shutil.rmtree(cache_root, ignore_errors=True)
    print_tables(results, rss_sources, nxt, ceiling)
    log(f"total {time.perf_counter() - started:.0f}s")
    out = {"results": results, "rss_vs_sources": rss_sources,
           "next_us_median": nxt.get("next_us_median"),
           "next_overhead": nxt,
           "loader_cpu_ms_per_step": nxt.get("loader_cpu_ms_per_step"),
           "ceiling_mb_per_s": ceiling,
           "config": {"small": small, "reps": args.reps, "corpus_text_mb": round(info.text_bytes / 1e6, 1),
                      "corpus_docs": info.docs, "read_mb": round(budget / 1e6, 1),
                      "micro_batch_tokens": C, "micro_batches": M, "peer_batch": PEER_BATCH,
                      "streamload_options": sl_opts, "token_weights": dict(weights),
                      "peer_sample_proportions": {k: round(v, 5) for k, v in proportions}}}
    print(json.dumps(out), flush=True)
    return 0


def _clear(cache_root: Path) -> None:
    for child in cache_root.iterdir():
        shutil.rmtree(child, ignore_errors=True)


def _moto_env(s3) -> dict:
    from _moto import merged_env
    env = merged_env(s3.env)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class _corpus_server:
    """Start moto and upload the corpus and its conversions."""

    def __init__(self, info, many, peers, args):
        self.info, self.many, self.peers, self.args = info, many, peers, args

    def __enter__(self):
        from _moto import MotoServer
        self.server = MotoServer().__enter__()
        started = time.perf_counter()
        root = Path(self.info.root)
        n, size = self.server.upload_dir(root / "jsonl", BUCKET, "jsonl/")
        for kind, sub in (("mosaic", "mds"), ("litdata", "litdata")):
            if kind in self.peers:
                n2, s2 = self.server.upload_dir(root / sub, BUCKET, f"{sub}/")
                n, size = n + n2, size + s2
        if self.many is not None:
            mroot = Path(self.many.root)
            subs = ["jsonl"] + ([] if self.args.no_peer_rss_sources else
                                [s for k, s in (("mosaic", "mds"), ("litdata", "litdata"))
                                 if k in self.peers])
            for sub in subs:
                n2, s2 = self.server.upload_dir(mroot / sub, BUCKET, f"many/{sub}/")
                n, size = n + n2, size + s2
        log(f"moto on {self.server.endpoint_url}: uploaded {n} objects, {size / 1e6:.0f} MB "
            f"in {time.perf_counter() - started:.1f}s")
        return self.server

    def __exit__(self, *exc):
        self.server.__exit__(*exc)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2])
    else:
        sys.exit(main())
