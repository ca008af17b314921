"""Process CPU per sample over S3, per thread, trees alternating against one moto server.

    python benchmarks/s3_cpu.py --rounds 3 /path/to/main .        # A/B two trees
    python benchmarks/s3_cpu.py --rounds 3 . '.@{"memory_budget": 268435456}'   # A/B options
    python benchmarks/s3_cpu.py --delay 0.05 /path/to/main .      # 50 ms more to first byte
    python benchmarks/s3_cpu.py . '.@{"input": "litdata"}'   # JSONL against LitData's chunks

`throughput.py`'s streamload measurement (1 rank, the 5-source JSONL corpus, half of it read,
4 rows of 65,536 tokens, planner "naive") with what a loaded two-core machine cannot give by
wall clock: CPU time. Each TREE (a directory holding `streamload/`, put first on PYTHONPATH;
`TREE@{json}` adds Loader options) runs in a fresh process, the trees in turn, `--rounds` times,
against the same server. Per run, from the first batch to the last: samples/s, CPU per step
and per sample (the whole process: loop, transforms, bridge, consumer), each thread's CPU
seconds (`streamload-loop` is the step loop and the fetchers' asyncio side: requests, bodies,
buffer puts; `streamload-transform` decodes and tokenizes), S3 requests, the seconds steps
waited for a source (`step_wait_s`), peak RSS (ru_maxrss). Medians at the end; JSON last line.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _corpus  # noqa: E402
from _moto import MotoServer, merged_env  # noqa: E402

BUCKET = "bench"

WORKER = r'''
import json, os, re, resource, sys, threading, time
spec = json.loads(sys.argv[1])
import streamload as sl, streamload.loader, streamload.storage.s3  # noqa: E401,F401 (before the clock)

def thread_cpu():
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = re.sub(r"[-_]\d+$", "", names.get(int(tid), "other"))
        out[name] = out.get(name, 0.0) + (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return out

sources = [sl.Source(f"s3://{spec['bucket']}/{spec['prefix']}/{n}/", weight=w, name=n)
           for n, w in spec["sources"]]
t0 = time.perf_counter()
docs = steps = 0
first = None
with sl.Loader(sources, micro_batch_tokens=65536, micro_batches=4, epochs=1, seed=0,
               storage_options=spec["storage_options"], planner="naive", **spec["options"]) as loader:
    for batch in loader:
        if first is None:
            first, t1, cpu1, threads1 = time.perf_counter() - t0, time.perf_counter(), time.process_time(), thread_cpu()
        else:
            docs += sum(len(mb.sample_ids) for mb in batch.micro_batches)
        steps += 1
        if steps >= spec["steps"]:
            break
    t2, cpu2, threads2 = time.perf_counter(), time.process_time(), thread_cpu()
    stats = loader.stats()["sources"]
print(json.dumps({
    "first_batch_s": first, "samples_per_s": docs / (t2 - t1),
    "cpu_ms_per_step": (cpu2 - cpu1) * 1e3 / (steps - 1), "cpu_us_per_sample": (cpu2 - cpu1) * 1e6 / docs,
    "threads_cpu_s": {k: round(v - threads1.get(k, 0.0), 2) for k, v in threads2.items()},
    "requests": sum(s.get("requests", 0) for s in stats.values()),
    "step_wait_s": sum(s.get("step_wait_s", 0.0) for s in stats.values()),
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="+", help="TREE or TREE@{json Loader options}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.5, help="of the corpus's text read")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds added to first byte")
    ap.add_argument("--workdir", default="/tmp/streamload-bench")
    args = ap.parse_args(argv)
    info = _corpus.main_corpus(Path(args.workdir), 300, 8)
    steps = math.ceil(info.text_bytes * args.fraction / (4 * 65536))
    runs: dict[str, list] = {tree: [] for tree in args.trees}
    # {"input": "litdata"} among a TREE's options: the same corpus as LitData's chunks
    # (`_corpus.to_litdata`, as throughput.py's peers read it) instead of the JSONL
    inputs = {tree: json.loads(tree.partition("@")[2] or "{}").get("input", "jsonl")
              for tree in args.trees}
    if "litdata" in inputs.values():
        _corpus.to_litdata(info, 8)
    with MotoServer(delay_s=args.delay) as s3:
        for prefix in sorted(set(inputs.values())):
            s3.upload_dir(Path(info.root) / prefix, BUCKET, f"{prefix}/")
        storage = dict(s3.storage_options)
        if args.delay:
            storage["endpoint_url"] = s3.delayed_url
        for r in range(args.rounds):
            for tree in args.trees:
                path, _, options = tree.partition("@")
                env = merged_env(s3.env)
                env["PYTHONPATH"] = str(Path(path).resolve())
                options = json.loads(options or "{}")
                options.pop("input", None)   # LitData's "text" leaf is the reader's default
                spec = {"bucket": BUCKET, "sources": [(s.name, s.weight) for s in info.sources],
                        "storage_options": storage, "steps": steps, "options": options,
                        "prefix": inputs[tree]}
                # -P: `python -c` would put the working directory first on sys.path, so a
                # run from a worktree's root imported that tree's streamload whatever TREE was
                done = subprocess.run([sys.executable, "-P", "-c", WORKER, json.dumps(spec)],
                                      env=env,
                                      capture_output=True, text=True)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                if done.returncode or not lines:
                    print(f"{tree} round {r}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
                    continue
                run = json.loads(lines[-1])
                runs[tree].append(run)
                threads = " ".join(f"{k}={v:.2f}" for k, v in sorted(
                    run["threads_cpu_s"].items(), key=lambda kv: -kv[1]) if v >= 0.05)
                print(f"{tree} r{r}: {run['samples_per_s']:,.0f} samples/s, "
                      f"{run['cpu_ms_per_step']:.2f} ms CPU/step, "
                      f"{run['cpu_us_per_sample']:.0f} us CPU/sample, first "
                      f"{run['first_batch_s']:.2f} s, {run['requests']} requests, waits "
                      f"{run['step_wait_s']:.2f} s, RSS {run['peak_rss_mb']:.0f} MB | {threads}",
                      file=sys.stderr, flush=True)
    medians = {}
    for tree, rows in runs.items():
        if rows:
            medians[tree] = {k: statistics.median(row[k] for row in rows) for k in
                             ("samples_per_s", "cpu_ms_per_step", "cpu_us_per_sample",
                              "first_batch_s", "requests", "step_wait_s", "peak_rss_mb")}
            print(f"median {tree}: " + ", ".join(f"{k} {v:,.2f}" for k, v in medians[tree].items()),
                  file=sys.stderr)
    print(json.dumps({"medians": medians, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
