"""Benchmark corpora: multi-source JSONL text, generated once into a cache directory and reused,
plus conversions of the same documents to the peers' formats (MosaicML MDS, LitData chunks).

Layout under `root` (one root per corpus variant, named by its parameters):

    root/manifest.json                  written last: its presence means the corpus is complete
    root/jsonl/<source>/part-00000.jsonl
    root/mds/<source>/...               after to_mds(info)      (MDSWriter; text: str, src: str)
    root/litdata/<source>/...           after to_litdata(info)  (litdata.optimize, {"text", "src"})

(`src`, the source's name, only lets the benchmark check the mixture each peer delivered.)

Text: paragraphs of Zipf-distributed words (a few non-ASCII) or Python-looking code, from the
demo's generators (streamload.commands.demo.corpus). Each document is a slice of a few MB of such text at
a random offset, so generating 300 MB takes seconds; lengths are long-tailed (lognormal per
source, one source with very long "books"). Byte-level tokens: one token per UTF-8 byte.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

VERSION = 1

# name, kind, token weight, (median bytes, lognormal sigma), clip
MAIN_SOURCES = (
    ("web", "prose", 0.35, (2500, 1.0)),
    ("code", "code", 0.20, (4000, 1.1)),
    ("wiki", "prose", 0.20, (3500, 0.8)),
    ("papers", "prose", 0.15, (20000, 0.6)),
    ("books", "prose", 0.10, (60000, 0.9)),
)
MIN_DOC, MAX_DOC = 64, 400_000


@dataclass
class ShardInfo:
    name: str
    bytes: int          # file size
    docs: int
    text_bytes: int     # UTF-8 bytes of the text fields


@dataclass
class SourceInfo:
    name: str
    kind: str
    weight: float       # token (= text byte) weight
    shards: list = field(default_factory=list)

    @property
    def docs(self) -> int:
        return sum(s["docs"] for s in self.shards)

    @property
    def text_bytes(self) -> int:
        return sum(s["text_bytes"] for s in self.shards)

    @property
    def file_bytes(self) -> int:
        return sum(s["bytes"] for s in self.shards)

    @property
    def mean_doc_bytes(self) -> float:
        return self.text_bytes / max(1, self.docs)


@dataclass
class CorpusInfo:
    root: str
    sources: list

    @classmethod
    def load(cls, root) -> "CorpusInfo":
        raw = json.loads((Path(root) / "manifest.json").read_text())
        return cls(raw["root"], [SourceInfo(**s) for s in raw["sources"]])

    @property
    def text_bytes(self) -> int:
        return sum(s.text_bytes for s in self.sources)

    @property
    def file_bytes(self) -> int:
        return sum(s.file_bytes for s in self.sources)

    @property
    def docs(self) -> int:
        return sum(s.docs for s in self.sources)

    def sample_proportions(self) -> list[float]:
        """Per-source *sample* proportions that give the same text-byte mix as the token weights
        (peers mix by samples, streamload by tokens): p_i ~ w_i / mean_doc_bytes_i."""
        raw = [s.weight / s.mean_doc_bytes for s in self.sources]
        total = sum(raw)
        return [x / total for x in raw]


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# --- text --------------------------------------------------------------------------------------

_POOLS: dict = {}


def _pool(kind: str, seed: int) -> str:
    key = (kind, seed)
    if key not in _POOLS:
        from streamload.commands.demo.corpus import code, prose
        rng = np.random.default_rng([seed, 7 if kind == "code" else 3])
        text = code(rng, 1_500_000) if kind == "code" else prose(rng, 3_000_000, paragraphs=True)
        _POOLS[key] = text + "\n" + text      # slices up to len(text) never wrap
    return _POOLS[key]


def documents(rng: np.random.Generator, kind: str, total_bytes: int, median: float, sigma: float,
              prefix: str = "", seed: int = 0):
    """Yield documents (str) until about `total_bytes` of text."""
    pool = _pool(kind, seed)
    half = len(pool) // 2
    done = 0
    while done < total_bytes:
        lengths = np.clip(rng.lognormal(math.log(median), sigma, size=512), MIN_DOC, MAX_DOC)
        starts = rng.integers(0, half, size=512)
        for n, s in zip(lengths.astype(int).tolist(), starts.tolist()):
            doc = prefix + pool[s:s + n]
            yield doc
            done += len(doc)            # chars ~ bytes; good enough for a budget
            if done >= total_bytes:
                return


def write_source(root: Path, name: str, kind: str, weight: float, total_bytes: int,
                 shard_bytes: int, median: float, sigma: float, seed: int,
                 prefix: str = "", min_shards: int = 4) -> SourceInfo:
    """Write one source's JSONL shards under root/jsonl/<name>/."""
    out = root / "jsonl" / name
    out.mkdir(parents=True, exist_ok=True)
    info = SourceInfo(name, kind, weight)
    shards = max(min_shards, round(total_bytes / shard_bytes))
    per_shard = total_bytes / shards
    rng = np.random.default_rng([seed, zlib_crc(name)])
    docs = documents(rng, kind, total_bytes, median, sigma, prefix, seed)
    for k in range(shards):
        path = out / f"part-{k:05d}.jsonl"
        n = text = 0
        with open(path, "wb") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}, ensure_ascii=False).encode() + b"\n")
                n += 1
                text += len(doc.encode())
                if text >= per_shard:
                    break
            if n == 0:      # ran out early: keep every shard non-empty
                doc = prefix + "tail"
                f.write(json.dumps({"text": doc}).encode() + b"\n")
                n, text = 1, len(doc.encode())
        info.shards.append(asdict(ShardInfo(path.name, path.stat().st_size, n, text)))
    return info


def zlib_crc(name: str) -> int:
    import zlib
    return zlib.crc32(name.encode())


def _finish(root: Path, sources: list[SourceInfo]) -> CorpusInfo:
    info = CorpusInfo(str(root), sources)
    (root / "manifest.json").write_text(json.dumps(
        {"version": VERSION, "root": str(root), "sources": [asdict(s) for s in sources]}))
    return info


def _fresh(root: Path) -> bool:
    """True if root holds a complete corpus; otherwise clear it for a rebuild."""
    if (root / "manifest.json").exists():
        try:
            if json.loads((root / "manifest.json").read_text()).get("version") == VERSION:
                return True
        except ValueError:
            pass
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    return False


def main_corpus(workdir, total_mb: float, shard_mb: float, seed: int = 0) -> CorpusInfo:
    """The 5-source corpus: each source's size is its weight times the total, so reading a
    fraction of the corpus with the mixture reads every source equally far."""
    root = Path(workdir) / f"main-{total_mb:g}mb-{shard_mb:g}-s{seed}-v{VERSION}"
    if _fresh(root):
        return CorpusInfo.load(root)
    started = time.perf_counter()
    log(f"generating {total_mb:g} MB corpus in {root} (once; reused later)")
    sources = [write_source(root, name, kind, w, int(total_mb * w * 1e6), int(shard_mb * 1e6),
                            median, sigma, seed)
               for name, kind, w, (median, sigma) in MAIN_SOURCES]
    info = _finish(root, sources)
    log(f"corpus: {info.docs} docs, {info.text_bytes / 1e6:.1f} MB text, "
        f"{sum(len(s.shards) for s in sources)} shards, {time.perf_counter() - started:.1f}s")
    return info


def many_corpus(workdir, sources: int, per_source_kb: float, seed: int = 0) -> CorpusInfo:
    """`sources` equal small sources (2 shards each) for the RSS-vs-sources measurement."""
    root = Path(workdir) / f"many-{sources}x{per_source_kb:g}kb-s{seed}-v{VERSION}"
    if _fresh(root):
        return CorpusInfo.load(root)
    log(f"generating {sources} sources x {per_source_kb:g} KB in {root}")
    per = int(per_source_kb * 1e3)
    out = [write_source(root, f"src{i:03d}", "prose", 1.0, per, per // 2, 2500, 1.0, seed,
                        min_shards=2) for i in range(sources)]
    return _finish(root, out)


def hetero_corpus(workdir, per_source_mb: float, shard_mb: float, slow_prefix: str,
                  seed: int = 0) -> CorpusInfo:
    """Three sources for benchmarks/heterogeneous.py: `heavy` (documents start with
    `slow_prefix`, which the benchmark's tokenizer turns into 20 ms of work), `laggy` (served
    through a slow-first-byte proxy) and `normal`."""
    root = Path(workdir) / f"hetero-{per_source_mb:g}mb-{shard_mb:g}-s{seed}-v{VERSION}"
    if _fresh(root):
        return CorpusInfo.load(root)
    log(f"generating heterogeneous corpus in {root}")
    total, shard = int(per_source_mb * 1e6), int(shard_mb * 1e6)
    out = [write_source(root, "heavy", "prose", 1.0, total, shard, 3000, 0.8, seed, slow_prefix),
           write_source(root, "laggy", "prose", 1.0, total, shard, 3000, 0.8, seed),
           write_source(root, "normal", "code", 1.0, total, shard, 3000, 0.8, seed)]
    return _finish(root, out)


# --- peers' formats ------------------------------------------------------------------------------

CONVERTED = "v2"     # contents of the DONE marker of a finished conversion


def iter_texts(root, source: str):
    for path in sorted((Path(root) / "jsonl" / source).glob("*.jsonl")):
        with open(path, "rb") as f:
            for line in f:
                yield json.loads(line)["text"]


def _converted(out: Path) -> bool:
    done = out / "DONE"
    if done.exists() and done.read_text() == CONVERTED:
        return True
    if out.exists():
        shutil.rmtree(out)
    return False


def import_streaming():
    """Import MosaicML Streaming without torchvision.

    `import streaming` runs `import streaming.vision`, whose base module imports torchvision at
    import time; torchvision from PyPI does not load beside the CPU torch wheel here (its C++ ops
    fail to register). streaming.vision only holds image dataset classes (StreamingCIFAR10,
    StreamingImageNet, ...) that this benchmark never uses; nothing else in streaming imports it
    or torchvision. So we register an empty placeholder for that one subpackage before the
    import: text datasets, MDSWriter, Stream and StreamingDataset are the real, unmodified code,
    and touching any streaming.vision name fails loudly."""
    import types
    if "streaming.vision" not in sys.modules:
        stub = types.ModuleType("streaming.vision")

        def __getattr__(name):
            raise AttributeError(f"streaming.vision.{name}: streaming.vision is not loaded in this "
                                 f"benchmark (it needs torchvision); see benchmarks/_corpus.py")
        stub.__getattr__ = __getattr__
        sys.modules["streaming.vision"] = stub
    import streaming
    return streaming


def to_mds(info: CorpusInfo, shard_mb: float) -> Path:
    """Convert every source to MDS (uncompressed, shards of about `shard_mb`): root/mds/<source>/."""
    root = Path(info.root)
    out = root / "mds"
    if _converted(out):
        return out
    streaming = import_streaming()
    started = time.perf_counter()
    for s in info.sources:
        with streaming.MDSWriter(out=str(out / s.name), columns={"text": "str", "src": "str"},
                                 size_limit=int(shard_mb * 1e6), compression=None) as writer:
            for text in iter_texts(root, s.name):
                writer.write({"text": text, "src": s.name})
    (out / "DONE").write_text(CONVERTED)
    log(f"converted to MDS in {time.perf_counter() - started:.1f}s -> {out}")
    return out


def _litdata_item(path: str):
    src = Path(path).parent.name
    with open(path, "rb") as f:
        for line in f:
            yield {"text": json.loads(line)["text"], "src": src}


def to_litdata(info: CorpusInfo, shard_mb: float) -> Path:
    """Convert every source with litdata.optimize (chunks of about `shard_mb`):
    root/litdata/<source>/."""
    root = Path(info.root)
    out = root / "litdata"
    if _converted(out):
        return out
    import litdata
    started = time.perf_counter()
    env_before = os.environ.get("DATA_OPTIMIZER_CACHE_FOLDER")
    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = str(root / "litdata-tmp")
    try:
        for s in info.sources:
            files = sorted(str(p) for p in (root / "jsonl" / s.name).glob("*.jsonl"))
            litdata.optimize(fn=_litdata_item, inputs=files, output_dir=str(out / s.name),
                             chunk_bytes=f"{shard_mb:g}MB", num_workers=1, mode="overwrite",
                             start_method="fork", verbose=False)
    finally:
        if env_before is None:
            os.environ.pop("DATA_OPTIMIZER_CACHE_FOLDER", None)
        else:
            os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = env_before
        shutil.rmtree(root / "litdata-tmp", ignore_errors=True)
    (out / "DONE").write_text(CONVERTED)
    log(f"converted to LitData in {time.perf_counter() - started:.1f}s -> {out}")
    return out
