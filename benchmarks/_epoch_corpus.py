"""The corpus of benchmarks/epoch.py: five JSONL sources shaped like a real pre-training mix,
generated once into a cache directory and reused.

Layout under `root` (one root per scale and seed):

    root/manifest.json                written last: its presence means the corpus is complete;
                                      holds every shard's document lengths (for exactly-once)
    root/<source>/part-00000.jsonl    {"text": ...}, ASCII text: 1 token = 1 byte = 1 character

Sources at --scale 1 (tokens = UTF-8 bytes; lognormal lengths clipped to [lo, hi]):

    source  weight  tokens  shards  median  sigma  lengths          note
    web     0.30    2.4M    8          900   1.3   10 .. 100k       long tail; one 100k document
    code    0.20    1.6M    4         1800   1.4   10 .. 100k
    wiki    0.20    1.2M    3         2500   0.9   50 .. 60k
    chat    0.15    0.4M    1          250   0.9   10 .. 8k         1 shard: fewer than ranks
    books   0.15    4.0M    6        11000   0.6   4k .. 40k        outlives the others

Largest / smallest source: 10x. `books` holds far more than its weight consumes while the
others have data, so once they run out (on_exhausted="renormalize") it alone fills the steps:
about a quarter of the epoch's tokens.

The schedule (`mixture`) switches weights once, at `SWITCH` of the corpus's tokens consumed
(schedule_unit="tokens", so the switch lands on the same data at every world size):

    at 0:            web 0.30  code 0.20  wiki 0.20  chat 0.15  books 0.15
    at 25% of total: web 0.25  code 0.25  wiki 0.20  chat 0.10  books 0.20
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VERSION = 1

# name, kind, weight at step 0, tokens at scale 1, shards, (median, sigma), (lo, hi)
SOURCES = (
    ("web", "prose", 0.30, 2_400_000, 8, (900, 1.3), (10, 100_000)),
    ("code", "code", 0.20, 1_600_000, 4, (1800, 1.4), (10, 100_000)),
    ("wiki", "prose", 0.20, 1_200_000, 3, (2500, 0.9), (50, 60_000)),
    ("chat", "prose", 0.15, 400_000, 1, (250, 0.9), (10, 8_000)),
    ("books", "prose", 0.15, 4_000_000, 6, (11000, 0.6), (4_000, 40_000)),
)
LATER_WEIGHTS = {"web": 0.25, "code": 0.25, "wiki": 0.20, "chat": 0.10, "books": 0.20}
SWITCH = 0.25          # the schedule's second point, as a fraction of the corpus's tokens
EXTREMES = {"web": 100_000, "chat": 10}   # one document of exactly this length (the range ends)


@dataclass
class EpochCorpus:
    root: str
    scale: float
    seed: int
    sources: list          # [{"name", "weight", "shards": [{"name", "lengths": [...]}, ...]}]

    @property
    def names(self) -> list[str]:
        return [s["name"] for s in self.sources]

    def source_tokens(self) -> dict[str, int]:
        return {s["name"]: sum(sum(sh["lengths"]) for sh in s["shards"]) for s in self.sources}

    @property
    def tokens(self) -> int:
        return sum(self.source_tokens().values())

    @property
    def documents(self) -> int:
        return sum(len(sh["lengths"]) for s in self.sources for sh in s["shards"])

    def lengths(self) -> np.ndarray:
        return np.array([n for s in self.sources for sh in s["shards"] for n in sh["lengths"]],
                        dtype=np.int64)

    def expected_items(self, capacity: int) -> dict[str, int]:
        """Every item one epoch delivers (long_documents="split": ":k" per piece), with its
        tokens."""
        from streamload.commands.demo.corpus import expected_items
        return expected_items(((s["name"], sh["name"], sh["lengths"]) for s in self.sources
                               for sh in s["shards"]), capacity)

    def describe(self) -> list[dict]:
        out = []
        for s in self.sources:
            lengths = np.array([n for sh in s["shards"] for n in sh["lengths"]])
            out.append({"name": s["name"], "weight": s["weight"], "shards": len(s["shards"]),
                        "documents": int(lengths.size), "tokens": int(lengths.sum()),
                        "min": int(lengths.min()), "median": int(np.median(lengths)),
                        "max": int(lengths.max())})
        return out


def mixture_points(total_tokens: float) -> list[tuple[float, dict]]:
    """The schedule as (at tokens, weights) for a corpus of `total_tokens`."""
    first = {name: w for name, _, w, *_ in SOURCES}
    return [(0.0, first), (float(round(SWITCH * total_tokens)), dict(LATER_WEIGHTS))]


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[epoch {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _pool(kind: str, seed: int) -> bytes:
    """A few MB of ASCII prose or code (the demo's generators, non-ASCII words dropped), twice
    over so that any slice up to its length fits."""
    from streamload.commands.demo.corpus import code, prose
    rng = np.random.default_rng([seed, 7 if kind == "code" else 3])
    text = code(rng, 1_500_000) if kind == "code" else prose(rng, 2_000_000, paragraphs=True)
    data = text.encode("ascii", errors="ignore")
    while len(data) < 200_000:
        data += data
    return data + data


def _lengths(rng: np.random.Generator, budget: int, median: float, sigma: float, lo: int,
             hi: int) -> np.ndarray:
    out, total = [], 0
    while total < budget:
        draw = np.clip(rng.lognormal(math.log(median), sigma, 512), lo, hi).astype(np.int64)
        for n in draw.tolist():
            out.append(n)
            total += n
            if total >= budget:
                break
    return np.array(out, dtype=np.int64)


def load_or_generate(workdir, scale: float = 1.0, seed: int = 0) -> EpochCorpus:
    root = Path(workdir) / f"epoch-x{scale:g}-s{seed}-v{VERSION}"
    manifest = root / "manifest.json"
    if manifest.exists():
        try:
            raw = json.loads(manifest.read_text())
            if raw.get("version") == VERSION:
                return EpochCorpus(raw["root"], raw["scale"], raw["seed"], raw["sources"])
        except ValueError:
            pass
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    started = time.perf_counter()
    log(f"generating the corpus (scale {scale:g}) in {root} (once; reused later)")
    pools: dict = {}
    sources = []
    for i, (name, kind, weight, tokens, shards, (median, sigma), (lo, hi)) in enumerate(SOURCES):
        rng = np.random.default_rng([seed, i, 1234])
        lengths = _lengths(rng, int(tokens * scale), median, sigma, lo, hi)
        if name in EXTREMES:   # pin one end of the range, so it is there at every scale
            at = int(np.argmax(lengths)) if EXTREMES[name] >= median else int(np.argmin(lengths))
            lengths[at] = EXTREMES[name]
        pool = pools.setdefault(kind, _pool(kind, seed))
        half = len(pool) // 2
        starts = rng.integers(0, half, size=lengths.size)
        bounds = np.linspace(0, lengths.size, shards + 1).round().astype(int)
        shard_list = []
        out = root / name
        out.mkdir()
        for k in range(shards):
            part = f"part-{k:05d}.jsonl"
            lines = []
            for n, s in zip(lengths[bounds[k]:bounds[k + 1]].tolist(),
                            starts[bounds[k]:bounds[k + 1]].tolist()):
                lines.append(json.dumps({"text": pool[s:s + n].decode("ascii")}))
            (out / part).write_text("\n".join(lines) + "\n")
            shard_list.append({"name": part,
                               "lengths": lengths[bounds[k]:bounds[k + 1]].tolist()})
        sources.append({"name": name, "weight": weight, "shards": shard_list})
    corpus = EpochCorpus(str(root), scale, seed, sources)
    manifest.write_text(json.dumps({"version": VERSION, "root": str(root), "scale": scale,
                                    "seed": seed, "sources": sources}))
    log(f"corpus: {corpus.documents:,} documents, {corpus.tokens:,} tokens, "
        f"{sum(len(s['shards']) for s in sources)} shards, {time.perf_counter() - started:.1f}s")
    return corpus
