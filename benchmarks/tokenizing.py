"""Does tokenizing with a real tokenizer run in parallel? The tokenizer alone, and in the loader.

    python benchmarks/tokenizing.py              # ~3 min: direct, then 5 loader configs x 3 reps
    python benchmarks/tokenizing.py --quick      # smoke run: 40 steps, 1 rep, 2 MB direct sample
                                               # (its loader rates count the prefetched data)

Tokenizer: a byte-level BPE (Hugging Face `tokenizers`), trained in memory and deterministically
(--vocab, default 8192, is an upper bound: the generated corpus has a small word inventory) on
the first 500 documents (at most 4 MB) of each source of the cached 5-source JSONL corpus
(`benchmarks/_corpus.py`). Child processes rebuild it from its JSON. Its text bytes per token
are measured on the direct sample below.

Direct: the tokenizer alone on a fixed list of ~8 MB of held-out documents (each source's share
by its weight): per-document `encode` and `encode_batch_fast` (`encode_batch` on older
versions), each in 1 thread and in 2 threads (the list split in two halves of equal bytes).
Text MB/s, median of 3. `encode` holds the GIL; `encode_batch` releases it and encodes on the
library's Rust threads (as many as cores).

Loader: streamload over the local JSONL files, all 5 sources with their weights, 4 rows of 8192
tokens, planner "naive", --steps steps (default 160), each measurement in a fresh Python
process; the configs are listed in CONFIGS. Measured: the loader's tokenizing rate, tokenized/s
(the tokens its transforms produced, `stats()["sources"][*]["tokens"]`, from the first batch
to the last step: what a short run delivers understates it, since the loader tokenizes ahead
into its memory budget, up to a few million tokens here); delivered
tokens/s and documents/s (`len(mb.sample_ids)`: the pieces of a split document count apiece)
from the first batch to the last step; the first batch's time from constructing the loader; the CPU seconds of the loader
process and its children (the tokenizer processes) from constructing the loader to the last
step ("cores" in the table: CPU s / wall s); and `stats()["stall_s"]`. Text MB/s is an
estimate: tokenized/s times the direct sample's bytes per token. Repetitions alternate over the
configs (--reps); medians are reported.

Prints a table on stderr and a JSON last line on stdout: {"tokenizer": {"vocab",
"bytes_per_token"}, "direct": [{"method", "threads", "mb_per_s"}], "loader": [{"config",
"tokenized_per_s", "tokens_per_s", "docs_per_s", "mb_per_s_est", "wall_s", "first_batch_s", "cpu_s", "stall_s",
"reps"}]}.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _corpus

CONFIGS = {   # name: (tokenizer kind, Loader options)
    "per-document, threads, transform_workers=1": ("per-doc", {"transform_workers": 1}),
    "per-document, threads, transform_workers=2": ("per-doc", {"transform_workers": 2}),
    "per-document, processes (2)": ("per-doc", {"tokenize_in": "processes",
                                                "tokenizer_processes": 2}),
    "HF tokenizer (encode_batch per range), transform_workers=1": ("hf", {"transform_workers": 1}),
    "HF tokenizer (encode_batch per range), transform_workers=2": ("hf", {"transform_workers": 2}),
}


def train_tokenizer(texts: list[str], vocab: int) -> str:
    """A byte-level BPE trained on `texts`, as JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok.to_str()


class EncodeIds:
    """The per-document tokenizer: `text -> ids`. Pickles as its JSON (for the processes)."""

    def __init__(self, tok_json: str):
        from tokenizers import Tokenizer
        self.json, self.tok = tok_json, Tokenizer.from_str(tok_json)

    def __reduce__(self):
        return EncodeIds, (self.json,)

    def __call__(self, text: str) -> list[int]:
        return self.tok.encode(text).ids


def samples(info, direct_mb: float) -> tuple[list[str], list[str]]:
    """Training texts (the first 500 documents, at most 4 MB, of each source) and the direct
    sample (the documents after those, each source's weight times `direct_mb`)."""
    train, held_out = [], []
    for s in info.sources:
        texts = _corpus.iter_texts(info.root, s.name)
        for out, budget, most in ((train, 4e6, 500), (held_out, direct_mb * 1e6 * s.weight, None)):
            size = 0
            for text in itertools.islice(texts, most):
                out.append(text)
                size += len(text.encode())
                if size >= budget:
                    break
    return train, held_out


def halves(texts: list[str]) -> list[list[str]]:
    """Two lists of about equal bytes (longest first, each to the lighter half)."""
    parts, sizes = [[], []], [0, 0]
    for text in sorted(texts, key=len, reverse=True):
        k = sizes.index(min(sizes))
        parts[k].append(text)
        sizes[k] += len(text)
    return parts


def direct(tok_json: str, texts: list[str], reps: int = 3) -> list[dict]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(tok_json)
    batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
    methods = {"encode (per document)": lambda part: [tok.encode(t) for t in part],
               batch.__name__: batch}
    mb = sum(len(t.encode()) for t in texts) / 1e6
    out = []
    for (name, fn), threads in itertools.product(methods.items(), (1, 2)):
        parts = [texts] if threads == 1 else halves(texts)
        times = []
        for _ in range(reps):
            workers = [threading.Thread(target=fn, args=(p,)) for p in parts]
            started = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            times.append(time.perf_counter() - started)
        out.append({"method": name, "threads": threads,
                    "mb_per_s": round(mb / statistics.median(times), 2)})
        _corpus.log(f"direct: {name}, {threads} thread(s): {out[-1]['mb_per_s']} MB/s")
    return out


def tokenized_so_far(loader) -> int:
    return sum(s["tokens"] for s in loader.stats()["sources"].values())


def run_loader(spec: dict) -> dict:
    """One measurement (in a fresh process: `--child`, the spec on stdin)."""
    import psutil
    from tokenizers import Tokenizer

    import streamload as sl
    kind, options = CONFIGS[spec["config"]]
    tok_json = spec["tok_json"]
    tokenizer = EncodeIds(tok_json) if kind == "per-doc" else Tokenizer.from_str(tok_json)
    sources = [sl.Source(f"{spec['root']}/{name}/", weight=w, name=name)
               for name, w in spec["weights"].items()]
    me = psutil.Process()
    tokens = docs = 0
    cpu0, started = sum(me.cpu_times()[:2]), time.perf_counter()
    with sl.Loader(sources, micro_batch_tokens=8192, micro_batches=4, tokenizer=tokenizer,
                   epochs=1, seed=0, planner="naive", **options) as loader:
        for done, batch in enumerate(loader, 1):
            if done == 1:
                first = time.perf_counter()
                tokenized0 = tokenized_so_far(loader)
            else:
                tokens += batch.num_tokens
                docs += sum(len(mb.sample_ids) for mb in batch.micro_batches)
            if done >= spec["steps"]:
                break
        end = time.perf_counter()
        stats = loader.stats()
        stall = stats["stall_s"]
        tokenized = tokenized_so_far(loader) - tokenized0
        cpu = sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)]) - cpu0
    return {"tokenized_per_s": tokenized / (end - first), "tokens_per_s": tokens / (end - first), "docs_per_s": docs / (end - first),
            "wall_s": end - started, "first_batch_s": first - started, "cpu_s": cpu,
            "stall_s": stall}


def measure(spec: dict) -> dict:
    """run_loader in a fresh interpreter; a child that fails, even on its way out, fails the run."""
    proc = subprocess.run([sys.executable, __file__, "--child"], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=600, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{spec['config']}: exit code {proc.returncode}\n{proc.stderr}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/streamload-bench")
    ap.add_argument("--steps", type=int, default=None, help="steps per loader run (default 160, "
                                                           "--quick 40)")
    ap.add_argument("--reps", type=int, default=None, help="loader repetitions (default 3, "
                                                           "--quick 1)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--quick", action="store_true", help="a smoke run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_loader(json.load(sys.stdin))))
        return 0
    steps = args.steps or (40 if args.quick else 160)
    reps = args.reps or (1 if args.quick else 3)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    info = _corpus.main_corpus(workdir, 300, 8)
    weights = {s.name: s.weight for s in info.sources}

    train, texts = samples(info, 2 if args.quick else 8)
    started = time.perf_counter()
    tok_json = train_tokenizer(train, args.vocab)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(tok_json)
    text_bytes = sum(len(t.encode()) for t in texts)
    bytes_per_token = text_bytes / sum(len(e.ids) for e in tok.encode_batch(texts))
    _corpus.log(f"tokenizer: vocab {tok.get_vocab_size()} (asked {args.vocab}), trained on "
                f"{sum(len(t) for t in train) / 1e6:.1f} MB in {time.perf_counter() - started:.1f}s;"
                f" {bytes_per_token:.2f} bytes/token on {text_bytes / 1e6:.1f} MB, {len(texts)} docs")
    direct_results = direct(tok_json, texts)

    runs: dict = {name: [] for name in CONFIGS}
    for rep in range(reps):
        for name in CONFIGS:
            r = measure({"config": name, "tok_json": tok_json, "steps": steps,
                         "root": str(Path(info.root) / "jsonl"), "weights": weights})
            runs[name].append(r)
            _corpus.log(f"rep {rep + 1}: {name}: {r['tokenized_per_s']:,.0f} tokenized/s, "
                        f"{r['cpu_s']:.1f} CPU s, {r['wall_s']:.1f}s")
    loader_results = []
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        loader_results.append({
            "config": name, "tokenized_per_s": round(med["tokenized_per_s"]),
            "tokens_per_s": round(med["tokens_per_s"]),
            "docs_per_s": round(med["docs_per_s"]),
            "mb_per_s_est": round(med["tokenized_per_s"] * bytes_per_token / 1e6, 2),
            "wall_s": round(med["wall_s"], 2), "first_batch_s": round(med["first_batch_s"], 2),
            "cpu_s": round(med["cpu_s"], 2), "stall_s": round(med["stall_s"], 2), "reps": len(rs)})

    print(f"\ntokenizer: byte-level BPE, vocab {tok.get_vocab_size()}, "
          f"{bytes_per_token:.2f} text bytes/token\n\ndirect ({text_bytes / 1e6:.1f} MB of text, "
          f"median of 3)\n  {'method':<28}{'threads':>8}{'MB/s':>8}", file=sys.stderr)
    for d in direct_results:
        print(f"  {d['method']:<28}{d['threads']:>8}{d['mb_per_s']:>8.2f}", file=sys.stderr)
    print(f"\nloader ({steps} steps of 4 x 8192 tokens, median of {reps})\n  {'config':<60}"
          f"{'tokenized/s':>12}{'MB/s~':>7}{'delivered/s':>12}{'docs/s':>8}{'wall s':>8}{'first s':>8}{'CPU s':>7}"
          f"{'cores':>6}{'stall s':>8}", file=sys.stderr)
    for r in loader_results:
        print(f"  {r['config']:<60}{r['tokenized_per_s']:>12,}{r['mb_per_s_est']:>7.2f}"
              f"{r['tokens_per_s']:>12,}{r['docs_per_s']:>8,}{r['wall_s']:>8.2f}{r['first_batch_s']:>8.2f}"
              f"{r['cpu_s']:>7.2f}{r['cpu_s'] / r['wall_s']:>6.2f}{r['stall_s']:>8.2f}", file=sys.stderr)
    print(json.dumps({"tokenizer": {"vocab": tok.get_vocab_size(),
                                    "bytes_per_token": round(bytes_per_token, 3)},
                      "direct": direct_results, "loader": loader_results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
