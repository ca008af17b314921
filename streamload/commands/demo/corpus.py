"""A small multi-source corpus with realistic, long-tailed document lengths.

Four sources, each in a different format, as a real pre-training mixture would have:

=======  ============  =============  ===========================================================
source   where         format         lengths (tokens = UTF-8 bytes, or token ids for `math`)
=======  ============  =============  ===========================================================
web      S3            .jsonl.zst     lognormal, median ~600, many small shards
code     S3            .jsonl.gz      lognormal, heavier tail (median ~1.4k)
books    local         .jsonl         Pareto: a few documents far longer than one packed row,
                                      so the loader has to split them
math     local         .tokens.npy    pre-tokenized (uint16 ids), lognormal, median ~350
=======  ============  =============  ===========================================================

Text is made of words drawn from a small vocabulary with Zipf-like frequencies, a few of them
non-ASCII, so that byte-level tokenization gives lengths that differ from character counts.
Everything is a deterministic function of the seed. `Corpus.expected_items(C)` lists the sample
ids that one epoch must deliver, which is what the demo checks exactly-once delivery against.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ...formats.writers import write_jsonl, write_token_shard

_WORDS = """
the of and to in a is that for it as was with be by on not he this are or his from at which
but have an they you were her she all one their there been has more if when will would who so
no what up out about into than them can only other new some time could these two may then do
first any my now such like our over man me even most made after also did many before must
through back years where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between both life being
under never day same another know while last might us great old year off come since against go
came right used take three data model train token batch rank loader stream shard bucket memory
compute attention gradient layer tensor learning sequence length cost balance sample source
mixture weight epoch step packed window buffer fetch network storage cluster device latency
river mountain city garden winter summer morning evening letter story chapter voice window
market history science music village harbor forest island desert signal engine theory proof
café naïve über façade jalapeño résumé coöperate smörgåsbord Zürich São Paulo Kraków
東京 数据 模型 学习 ñandú Ελλάδα мир данные 🙂 λ π ∑ ∞
""".split()

_IDENTIFIERS = """
x y n i j k idx buf data batch rows cols size offset length total count value result item
items key keys node tree left right parent child queue stack cache store shard rank world
tokens lengths costs weights plan step epoch config source sink reader writer stream chunk
""".split()
_FUNCTIONS = """
load save parse pack split merge fetch read write update apply reduce gather scatter encode
decode compute balance assign select sort filter build flush close open reset check visit
""".split()
_CLASSES = "Loader Buffer Planner Shard Reader Writer Tree Node Cache Stream Config Batch".split()
_MODULES = "os sys json math time asyncio numpy torch itertools functools pathlib re".split()


def check_delivery(parts, expected: dict[str, int]) -> dict[str, list[str]]:
    """What an epoch delivered, `parts` = (sample id, tokens) pairs over every rank, against
    `expected` ({id: tokens}, `expected_items`). A piece the planner cut to fill a row arrives
    in parts, ":k" then ":k+offset" (`streamload.pieces`): its parts must tile it. Returns the
    ids delivered twice, the items never delivered, the ids that are no item, the pieces whose
    parts overlap or leave a gap (`untiled`), and those whose parts stop short of their end
    (`partial`: only right for a run stopped early)."""
    seen, by_item = set(), {}
    duplicates = []
    for sid, n in parts:
        if sid in seen:
            duplicates.append(sid)
        seen.add(sid)
        base, _, offset = sid.partition("+")
        by_item.setdefault(base, []).append((int(offset or 0), int(n)))
    untiled, partial = [], []
    for base, got in by_item.items():
        got.sort()
        starts = [offset for offset, _ in got]
        ends = np.cumsum([n for _, n in got])
        if base not in expected:
            continue
        if starts != [0] + ends[:-1].tolist() or int(ends[-1]) > expected[base]:
            untiled.append(base)
        elif int(ends[-1]) < expected[base]:
            partial.append(base)
    return {"duplicates": sorted(duplicates), "missing": sorted(expected.keys() - by_item.keys()),
            "unexpected": sorted(by_item.keys() - expected.keys()), "untiled": sorted(untiled),
            "partial": sorted(partial)}


def expected_items(shards, capacity: int) -> dict[str, int]:
    """Every item one epoch delivers with long_documents="split", and its tokens, from
    (source name, shard name, document lengths) per shard: "source/shard/record", ":k" per
    piece of a long one. (A piece the planner cuts arrives as ":k" and ":k+offset" parts.)"""
    items = {}
    for source, shard, lengths in shards:
        for record, n in enumerate(lengths):
            base = f"{source}/{shard}/{record}"
            if n <= capacity:
                items[base] = int(n)
            else:
                for k in range(math.ceil(n / capacity)):
                    items[f"{base}:{k}"] = int(min(capacity, n - k * capacity))
    return items


@dataclass(frozen=True)
class SourceSpec:
    name: str
    kind: str            # "prose" | "code" | "tokens"
    location: str        # "s3" | "local"
    suffix: str          # shard file suffix
    weight: float        # mixing weight given to the loader
    shards: int
    tokens: int          # approximate token budget at scale 1
    dist: tuple          # ("lognormal", median, sigma) | ("pareto", alpha, scale)
    min_len: int
    max_len: int


SPECS = (
    SourceSpec("web", "prose", "s3", ".jsonl.zst", 0.45, 24, 1_100_000, ("lognormal", 600, 1.0), 32, 30_000),
    SourceSpec("code", "code", "s3", ".jsonl.gz", 0.25, 8, 600_000, ("lognormal", 1400, 1.2), 48, 60_000),
    SourceSpec("books", "prose", "local", ".jsonl", 0.20, 4, 550_000, ("pareto", 1.2, 2500), 800, 60_000),
    SourceSpec("math", "tokens", "local", ".tokens.npy", 0.10, 4, 250_000, ("lognormal", 350, 0.8), 16, 8_192),
)


@dataclass
class SourceData:
    name: str
    kind: str
    location: str
    format: str                       # "jsonl" | "tokens"
    weight: float
    local_dir: str
    shards: list[str] = field(default_factory=list)            # shard names, sorted
    lengths: list[list[int]] = field(default_factory=list)     # per shard, per record: tokens
    uri: str = ""                     # where the loader reads it (set by the demo for S3)

    @property
    def docs(self) -> int:
        return sum(len(x) for x in self.lengths)

    @property
    def tokens(self) -> int:
        return sum(sum(x) for x in self.lengths)

    @property
    def longest(self) -> int:
        return max((max(x) for x in self.lengths if x), default=0)

    def longer_than(self, capacity: int) -> int:
        return sum(1 for x in self.lengths for n in x if n > capacity)

    def samples(self, capacity: int) -> int:
        """Samples this source yields with documents longer than `capacity` split."""
        return sum(max(1, math.ceil(n / capacity)) for x in self.lengths for n in x)


@dataclass
class Corpus:
    root: str
    seed: int
    sources: list[SourceData]

    def source(self, name: str) -> SourceData:
        return next(s for s in self.sources if s.name == name)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sources)

    @property
    def docs(self) -> int:
        return sum(s.docs for s in self.sources)

    def expected_items(self, capacity: int) -> dict[str, int]:
        """Every item one epoch delivers with long_documents="split", with its tokens."""
        return expected_items(((s.name, shard, lengths) for s in self.sources
                               for shard, lengths in zip(s.shards, s.lengths)), capacity)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Corpus":
        raw = json.loads(Path(path).read_text())
        return cls(raw["root"], raw["seed"], [SourceData(**s) for s in raw["sources"]])


# --- text ------------------------------------------------------------------------------------

def _zipf_probabilities(n: int) -> np.ndarray:
    p = 1.0 / (np.arange(n) + 2.7)
    return p / p.sum()


_WORD_P = _zipf_probabilities(len(_WORDS))
_WORD_BYTES = np.array([len(w.encode()) + 1 for w in _WORDS])
_MEAN_WORD_BYTES = float((_WORD_P * _WORD_BYTES).sum())


def _cut(text: str, nbytes: int, at: str) -> str:
    """`text` cut to at most `nbytes` UTF-8 bytes, at the last `at` if there is one."""
    data = text.encode()
    if len(data) <= nbytes:
        return text
    head = data[:nbytes].decode("utf-8", errors="ignore")
    pos = head.rfind(at)
    return head[:pos] if pos > nbytes // 2 else head


def prose(rng: np.random.Generator, nbytes: int, paragraphs: bool = False) -> str:
    """Sentences of Zipf-distributed words, about `nbytes` UTF-8 bytes long."""
    n = int(nbytes / _MEAN_WORD_BYTES * 1.15) + 8
    words = [_WORDS[i] for i in rng.choice(len(_WORDS), size=n, p=_WORD_P)]
    ends = np.cumsum(rng.integers(5, 22, size=n // 5 + 2))
    out, start = [], 0
    for s, end in enumerate(ends):
        if start >= n:
            break
        sentence = words[start:end]
        start = end
        sentence[0] = sentence[0][:1].upper() + sentence[0][1:]
        out.append(" ".join(sentence) + ("." if s % 7 else "?"))
        if paragraphs and s % 6 == 5:
            out.append("\n\n")
    text = " ".join(out).replace(" \n\n ", "\n\n")
    return _cut(text, nbytes, " ")


def code(rng: np.random.Generator, nbytes: int) -> str:
    """Python-looking source, about `nbytes` bytes long."""
    def pick(xs):
        return xs[int(rng.integers(len(xs)))]

    lines = [f"import {pick(_MODULES)}", f"from {pick(_MODULES)} import {pick(_FUNCTIONS)}", ""]
    size = sum(len(x) + 1 for x in lines)
    while size < nbytes:
        if rng.random() < 0.15:
            block = [f"class {pick(_CLASSES)}{pick(_CLASSES)}:",
                     f'    """{prose(rng, int(rng.integers(20, 120)))}"""', ""]
            indent = "    "
        else:
            block, indent = [], ""
        a, b, f = pick(_IDENTIFIERS), pick(_IDENTIFIERS), pick(_FUNCTIONS)
        block.append(f"{indent}def {f}_{pick(_IDENTIFIERS)}({a}, {b}={int(rng.integers(100))}):")
        for _ in range(int(rng.integers(2, 12))):
            x, y = pick(_IDENTIFIERS), pick(_IDENTIFIERS)
            choice = rng.random()
            if choice < 0.3:
                block.append(f"{indent}    {x} = {pick(_FUNCTIONS)}({y}) + {int(rng.integers(1, 64))}")
            elif choice < 0.5:
                block.append(f"{indent}    for {x} in range(len({y})):")
                block.append(f"{indent}        {y}[{x}] = {pick(_FUNCTIONS)}({y}[{x}], {a})")
            elif choice < 0.7:
                block.append(f"{indent}    if {x} > {b}:")
                block.append(f"{indent}        return {pick(_FUNCTIONS)}({x}, {y})")
            elif choice < 0.85:
                block.append(f"{indent}    # {prose(rng, int(rng.integers(20, 70))).lower()}")
            else:
                block.append(f"{indent}    {x}.{pick(_FUNCTIONS)}({y}, key=lambda k: k.{pick(_IDENTIFIERS)})")
        block += [f"{indent}    return {a}", ""]
        lines += block
        size += sum(len(x.encode()) + 1 for x in block)
    return _cut("\n".join(lines), nbytes, "\n")


# --- lengths ---------------------------------------------------------------------------------

def sample_lengths(rng: np.random.Generator, spec: SourceSpec, budget: int) -> np.ndarray:
    """Document lengths from the spec's distribution, until they add up to `budget` tokens."""
    out: list[int] = []
    total = 0
    kind, p1, p2 = spec.dist
    while total < budget:
        if kind == "lognormal":
            draw = rng.lognormal(math.log(p1), p2, size=256)
        else:
            draw = (rng.pareto(p1, size=256) + 1.0) * p2
        for n in np.clip(draw, spec.min_len, spec.max_len).astype(int).tolist():
            out.append(n)
            total += n
            if total >= budget:
                break
    return np.array(out, dtype=np.int64)


# --- writing ---------------------------------------------------------------------------------

def generate(root: str | os.PathLike, *, scale: float = 1.0, small: bool = False, seed: int = 0,
             capacity: int = 4096) -> Corpus:
    """Write the corpus under `root/<source>/` and return its manifest.

    `scale` multiplies every source's token budget; `small` is a tiny corpus (a few hundred KB,
    fewer shards) for tests. Some `books` documents are always longer than `capacity`.
    """
    root = Path(root).resolve()
    sources = []
    for s_index, spec in enumerate(SPECS):
        rng = np.random.default_rng([seed, s_index])
        budget = int(spec.tokens * scale * (0.08 if small else 1.0))
        shards = max(2, spec.shards // 4) if small else spec.shards
        lengths = sample_lengths(rng, spec, max(budget, shards * spec.min_len))
        if spec.name == "books" and not (lengths > capacity).any():
            lengths[int(np.argmax(lengths))] = 2 * capacity + 123   # something must be split
        fmt = "tokens" if spec.kind == "tokens" else "jsonl"
        data = SourceData(spec.name, spec.kind, spec.location, fmt, spec.weight,
                          str(root / spec.name))
        bounds = np.linspace(0, len(lengths), shards + 1).astype(int)
        for k in range(shards):
            shard_lengths = lengths[bounds[k]:bounds[k + 1]]
            name = f"part-{k:05d}{spec.suffix}"
            path = root / spec.name / name
            if spec.kind == "tokens":
                docs = [rng.zipf(1.3, size=n).clip(1, 31_999).astype(np.uint16)
                        for n in shard_lengths.tolist()]
                write_token_shard(str(path)[: -len(".tokens.npy")], docs, np.uint16)
                realized = [len(d) for d in docs]
            else:
                texts = [code(rng, n) if spec.kind == "code"
                         else prose(rng, n, paragraphs=spec.name == "books")
                         for n in shard_lengths.tolist()]
                texts = [t if t else "x" for t in texts]
                write_jsonl(path, texts, compression="plain" if spec.suffix == ".jsonl"
                            else spec.suffix.rsplit(".", 1)[-1])
                realized = [len(t.encode()) for t in texts]
            data.shards.append(name)
            data.lengths.append(realized)
        sources.append(data)
    corpus = Corpus(str(root), seed, sources)
    corpus.save(root / "manifest.json")
    return corpus
