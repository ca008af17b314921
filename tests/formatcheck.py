"""Helpers shared by the shard-format tests (test_formats, test_format_*): a local object store
that records what it is asked, reading one shard as the fetcher does, and Loader runs whose
documents are compared with what a reference reader reads."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

import streamload as sl
from streamload import pieces
from streamload.errors import StorageError
from streamload.formats import Problems, RawRecord
from streamload.formats.base import decode_columns, finish_columns
from streamload.storage.base import ObjectInfo, StoreCounters

# ---------------------------------------------------------------- stores, shards


class FileStore:
    """A minimal local ObjectStore that records its listings and reads. Strict on purpose: a
    range past the end of an object fails, so the formats are checked never to read beyond what
    exists. A file that does not exist raises StorageError(missing=True), as every ObjectStore
    says it. `past_end` (a subclass sets it): name endings of objects that may be read past
    their end, the read returning what there is."""

    past_end: tuple[str, ...] = ()

    def __init__(self):
        self.counters = StoreCounters()
        self.reads: list[tuple[str, int, int]] = []
        self.lists: list[str] = []

    async def list(self, uri: str) -> list[ObjectInfo]:
        self.lists.append(uri)
        if uri.endswith("/*"):   # one directory's files (how MDS lists an index's directory)
            paths = Path(uri[:-2]).iterdir()
        else:
            paths = Path(uri).rglob("*")
        return sorted(ObjectInfo(str(p), p.stat().st_size) for p in paths if p.is_file())

    async def read_range(self, uri: str, start: int, end: int, **_) -> bytes:
        if not Path(uri).exists():
            raise StorageError(f"no such file or directory: {uri}", uri=uri, missing=True)
        size = Path(uri).stat().st_size
        assert 0 <= start <= end and (end <= size or uri.endswith(self.past_end)), \
            f"read {start}-{end} outside {uri} ({size} bytes)"
        self.reads.append((uri, start, end))
        with open(uri, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    async def aclose(self) -> None:
        pass

    def reads_of(self, path: Path) -> list[tuple[int, int]]:
        return [(a, b) for uri, a, b in self.reads if uri == str(path)]

    @property
    def bytes_read(self) -> int:
        return sum(end - start for _, start, end in self.reads)


class Skips(Problems):
    """A shard's `Problems` with on_error="skip": `calls` are the skips reported so far,
    (record or None for the rest of the shard, reason). `for_shard` names the shard when the
    test does not."""

    def __init__(self, source: str = "src", shard_name: str | None = None):
        super().__init__(source, shard_name, "skip")

    @property
    def calls(self) -> list[tuple[int | None, str]]:
        return self.skipped


def problems(shard_name: str, source: str = "src") -> Problems:
    """A shard's `Problems` with on_error="raise"."""
    return Problems(source, shard_name)


def for_shard(skips: Skips | None, shard_name: str) -> Problems:
    """What a test reading shard `shard_name` gives its format: `skips` (on_error="skip"),
    named after the shard if it is not yet, or without them a raising `problems`."""
    if skips is None:
        return problems(shard_name)
    skips.shard_name = skips.shard_name or shard_name
    return skips


def info(path: Path) -> ObjectInfo:
    return ObjectInfo(str(path), path.stat().st_size)


async def read_shard(fmt, path: Path, *, chunk_bytes: int = 1 << 20, skips: Skips | None = None,
                     store: FileStore | None = None, order: str | None = "ascending"
                     ) -> list[RawRecord]:
    """Read one shard as the fetcher does: open, every planned range in order, finish; its
    problems raise, or with `skips` given (on_error="skip") are kept there.
    `order` checks the planned ranges: "ascending" (none empty, none before the previous one's
    end), "contiguous" (each starting where the previous ended, together the whole object), or
    None (not checked)."""
    store = store or FileStore()
    shard = info(path)
    stream = await fmt.open(store, shard, problems=for_shard(skips, path.name),
                            chunk_bytes=chunk_bytes)
    records, previous = [], 0
    for start, end in stream.ranges():
        if order == "contiguous":
            assert start == previous and end > start   # sequential, covering the object
        elif order == "ascending":
            assert start >= previous and end > start
        previous = end
        records += stream.decode(await store.read_range(shard.uri, start, end))
    if order == "contiguous":
        assert previous == shard.size
    return records + stream.finish()


async def read_columns(fmt, path: Path, *, chunk_bytes: int = 1 << 20,
                       skips: Skips | None = None) -> list[RawRecord]:
    """`read_shard` through the streams' `decode_columns` and `finish_columns` (what the
    fetcher reads), the records as RawRecords (`Records.to_list`)."""
    store, shard = FileStore(), info(path)
    stream = await fmt.open(store, shard, problems=for_shard(skips, path.name),
                            chunk_bytes=chunk_bytes)
    records = []
    for start, end in stream.ranges():
        records += decode_columns(stream, await store.read_range(shard.uri, start, end)).to_list()
    return records + finish_columns(stream).to_list()


# ---------------------------------------------------------------- texts


TEXTS = [
    "hello world",
    "",                                   # an empty text is a record
    "ünïcödé — 日本語 テキスト 🙂🙂",
    "line with \"quotes\" and \\ backslash and \n a newline",
    "x" * 300,
    "last",
]


def texts(n: int, seed: int, tag: str = "") -> list[str]:
    rng = np.random.default_rng(seed)
    pool = TEXTS + ["word " * 20, "ελληνικά κείμενα", "🙂" * 9]
    return [f"{tag}{i}:" + pool[int(rng.integers(len(pool)))] * int(rng.integers(1, 4))
            for i in range(n)]


# ---------------------------------------------------------------- through the Loader: whole documents


def delivered(batches) -> list[tuple[str, np.ndarray]]:
    """(sample id, tokens) of every document of every micro-batch, in order."""
    out = []
    for batch in batches:
        for mb in batch.micro_batches:
            cu = mb.cu_seqlens.tolist()
            tokens = mb.tokens.numpy()
            for k, sample_id in enumerate(mb.sample_ids):
                out.append((sample_id, tokens[cu[k]:cu[k + 1]].astype(np.int64)))
    return out


def loader(sources, **options):
    options.setdefault("micro_batch_tokens", 4096)   # more than every document
    options.setdefault("micro_batches", 2)
    options.setdefault("epochs", 1)
    return sl.Loader(sources, **options)


def run(sources, **options):
    with loader(sources, **options) as ld:
        docs = delivered(ld)
        return docs, ld.stats()


def assert_matches(docs, expected: dict[str, np.ndarray]) -> None:
    """Every document delivered once, and exactly what the reference reader read."""
    ids = [sample_id for sample_id, _ in docs]
    assert Counter(ids) == Counter(list(expected)), \
        (sorted(set(ids) ^ set(expected))[:5], [i for i, n in Counter(ids).items() if n > 1][:5])
    for sample_id, tokens in docs:
        np.testing.assert_array_equal(tokens, expected[sample_id], err_msg=sample_id)


# ---------------------------------------------------------------- through the Loader: pieces joined


def collect(loader) -> tuple[list, dict[str, np.ndarray]]:
    """(per step: its sample ids, token sums) and every document's tokens, pieces joined."""
    steps, parts = [], {}
    for batch in loader:
        step = []
        for mb in batch.micro_batches:
            bounds = mb.cu_seqlens.numpy()
            tokens = mb.tokens.numpy()
            for k, sid in enumerate(mb.sample_ids):
                doc, piece, offset = pieces.parse(sid)
                parts.setdefault(doc, []).append(((piece, offset),
                                                  tokens[bounds[k]:bounds[k + 1]].copy()))
            step.append((tuple(mb.sample_ids), int(mb.tokens.sum())))
        steps.append(step)
    docs = {doc: np.concatenate([t for _, t in sorted(p, key=lambda x: x[0])])
            for doc, p in parts.items()}
    return steps, docs


def assert_delivered(docs: dict, expected: dict) -> None:
    assert sorted(docs) == sorted(expected)
    for sid, tokens in expected.items():
        np.testing.assert_array_equal(docs[sid], tokens, err_msg=sid)
