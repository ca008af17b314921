"""What a resume costs: bytes read, tokenizer work and time, resuming late in a shard.

    python benchmarks/resume.py                  # ~1 min: 24 MB shards, stop at 80%
    python benchmarks/resume.py --mb 8 --stop 0.5

One source, one shard (the worst case: the whole epoch is one shard in progress), in two forms
holding the same documents (random words, 200..20k bytes each, cached under --workdir):
  jsonl   a JSONL shard tokenized by a byte-level BPE (Hugging Face `tokenizers`, trained in
          memory on the first 500 documents, as benchmarks/tokenizing.py does);
  tokens  a token shard (`*.tokens.npy` + offsets) of the documents' UTF-8 bytes.
Per form, one rank (R = 1), M = 4 rows of C = 8192 tokens, planner naive, chunk_bytes 1 MiB:
  1. an uninterrupted epoch: its steps, bytes read and CPU seconds;
  2. a run stopped after --stop of those steps, whose `state_dict()` is kept;
  3. a fresh Loader resumed from that state, run to the end of the epoch: time to its first
     batch, bytes read and CPU seconds (process time, every thread: the tokenizer's work
     shows there).
Checked: the head and the resumed tail together deliver every item of the epoch exactly once.
"Wasted" is what the resumed run read beyond the epoch's remaining (1 - stop) share of what the
uninterrupted run read.

streamload is imported from the checkout this file sits in, so a copy of this file in another
checkout measures that one. Prints a table on stderr and one JSON object as its last stdout line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

C, M = 8192, 4


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_corpus(workdir: Path, mb: float, seed: int) -> Path:
    """The documents, as one JSONL shard and one token shard (cached by size and seed)."""
    from streamload.formats import write_jsonl, write_token_shard
    root = workdir / f"resume-{mb:g}mb-{seed}"
    if (root / "done").exists():
        return root
    rng = np.random.default_rng(seed)
    words = ["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 10)))
             for _ in range(5000)]
    texts, total = [], 0
    while total < mb * 1e6:
        n = int(rng.integers(200, 20_000))
        text = " ".join(rng.choice(words, n // 6))[:n]
        texts.append(text)
        total += len(text)
    (root / "jsonl").mkdir(parents=True, exist_ok=True)
    (root / "tokens").mkdir(parents=True, exist_ok=True)
    write_jsonl(root / "jsonl" / "part-000.jsonl", texts)
    write_token_shard(root / "tokens" / "part-000",
                      [np.frombuffer(t.encode(), np.uint8).astype(np.uint16) for t in texts])
    (root / "done").write_text(str(len(texts)))
    return root


def tokenizer_for(root: Path):
    from tokenizers import Tokenizer
    from tokenizing import train_tokenizer
    path = root / "bpe.json"
    if not path.exists():
        with open(root / "jsonl" / "part-000.jsonl") as f:
            texts = [json.loads(line)["text"] for _, line in zip(range(500), f)]
        path.write_text(train_tokenizer(texts, 8192))
    return Tokenizer.from_str(path.read_text())


def loader(root: Path, form: str, tokenizer):
    import streamload as sl
    return sl.Loader([sl.Source(str(root / form), name=form)], micro_batch_tokens=C,
                     micro_batches=M, epochs=1, planner="naive", seed=0, chunk_bytes=1 << 20,
                     tokenizer=tokenizer if form == "jsonl" else None)


def ids_of(batch) -> list[str]:
    return [i for mb in batch.micro_batches for i in mb.sample_ids]


def measure(root: Path, form: str, stop_fraction: float, tokenizer) -> dict:
    cpu, started = time.process_time(), time.perf_counter()
    with loader(root, form, tokenizer) as run:
        full_ids = [i for b in run for i in ids_of(b)]
        steps = run.stats()["steps"]
        full = dict(bytes=run.stats()["bytes_read"], cpu_s=time.process_time() - cpu, wall_s=time.perf_counter() - started)
    stop = int(steps * stop_fraction)
    with loader(root, form, tokenizer) as run:
        head_ids = [i for _, b in zip(range(stop), run) for i in ids_of(b)]
        state = run.state_dict()
    cpu, started = time.process_time(), time.perf_counter()
    with loader(root, form, tokenizer) as run:
        run.load_state_dict(state)
        batches = iter(run)
        first = next(batches)
        first_s = time.perf_counter() - started
        tail_ids = ids_of(first) + [i for b in batches for i in ids_of(b)]
        stats = run.stats()
    resumed = dict(bytes=stats["bytes_read"], cpu_s=time.process_time() - cpu, wall_s=time.perf_counter() - started,
                   first_batch_s=first_s)
    together = head_ids + tail_ids
    remaining = 1 - stop / steps
    return {
        "form": form, "steps": steps, "stopped_after": stop,
        "exactly_once": len(together) == len(set(together)) and set(together) == set(full_ids),
        "full": {k: round(v, 3) for k, v in full.items()},
        "resumed": {k: round(v, 3) for k, v in resumed.items()},
        "remaining_share": round(remaining, 4),
        "bytes_wasted_share": round(resumed["bytes"] / full["bytes"] - remaining, 4),
        "cpu_share": round(resumed["cpu_s"] / full["cpu_s"], 4),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=24.0, help="text megabytes in the shard")
    p.add_argument("--stop", type=float, default=0.8, help="share of the epoch's steps done")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="/tmp/streamload-resume")
    args = p.parse_args(argv)
    root = make_corpus(Path(args.workdir), args.mb, args.seed)
    tokenizer = tokenizer_for(root)
    results = [measure(root, form, args.stop, tokenizer) for form in ("jsonl", "tokens")]
    log(f"{'form':<7}{'steps':>6}{'stop':>6}{'once':>6}{'full MB':>9}{'resumed MB':>11}"
        f"{'MB wasted':>10}{'full cpu':>9}{'res cpu':>8}{'1st batch':>10}")
    for r in results:
        full, res = r["full"], r["resumed"]
        log(f"{r['form']:<7}{r['steps']:>6}{r['stopped_after']:>6}{str(r['exactly_once']):>6}"
            f"{full['bytes'] / 1e6:>9.1f}{res['bytes'] / 1e6:>11.1f}"
            f"{r['bytes_wasted_share'] * full['bytes'] / 1e6:>10.1f}"
            f"{full['cpu_s']:>9.2f}{res['cpu_s']:>8.2f}"
            f"{res['first_batch_s']:>10.2f}")
    print(json.dumps({"mb": args.mb, "stop": args.stop, "micro_batch_tokens": C,
                      "micro_batches": M, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
