"""Reading a configuration's item lengths, as the loader would make its items (the dry run's
input)."""
from __future__ import annotations

import asyncio
from typing import Optional

from dataclasses import dataclass

import numpy as np

from ...configfile import LoaderSpec
from ...errors import ConfigError, DataError, StorageError
from ...formats.tokens import (_BadShard, _check_offsets, _offsets_what, _read_offsets,
                             offsets_uri)
from ...pipeline.fetch import Shard, list_shards
from ...storage import open_store
from ...tokenizer import TokenizerError


SCAN_CONCURRENCY = 8
SCAN_CHUNK_BYTES = 4 << 20


@dataclass
class SourceScan:
    """One source's item lengths, as the loader would make its items."""
    name: str
    format: str                  # "tokens", "jsonl", or both joined by "+"
    method: str                  # "index" (offsets files), "scan" (decoded records), or both
    lengths: np.ndarray          # int64 item lengths: shard by shard, records in order
    shard_items: np.ndarray      # int64 [shards read]: items per shard (sums to lengths.size)
    shards: int = 0              # shards listed
    shards_read: int = 0
    documents: int = 0           # records read (including empty ones)
    empty: int = 0               # empty documents (left out, like the loader)
    split: int = 0               # documents longer than C split into chunks
    truncated: int = 0
    dropped: int = 0
    skipped: int = 0             # bad records or shards skipped (on_error="skip")
    complete: bool = True        # False: max_docs cut the scan short; the items are a sample
    divisible: Optional[np.ndarray] = None   # bool per item: a piece of a split document

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def to_dict(self) -> dict:
        return {"name": self.name, "format": self.format, "method": self.method,
                "shards": self.shards, "shards_read": self.shards_read,
                "documents": self.documents, "items": int(self.lengths.size),
                "tokens": self.tokens, "empty": self.empty, "split": self.split,
                "truncated": self.truncated, "dropped": self.dropped, "skipped": self.skipped,
                "sampled": not self.complete}


def items_from_documents(docs: np.ndarray, capacity: int, long_documents: str
                         ) -> tuple[np.ndarray, dict]:
    """Document lengths -> item lengths, as `pipeline.transform.records_to_items` makes items:
    empty documents are left out; longer than C: split into chunks of C (the last shorter),
    truncated to C, or dropped."""
    docs = np.asarray(docs, dtype=np.int64)
    long = docs > capacity
    counts = {"empty": int((docs == 0).sum()), "split": 0, "truncated": 0, "dropped": 0}
    docs = docs[docs > 0]
    if not long.any():
        return docs, counts
    long = docs > capacity
    if long_documents == "truncate":
        counts["truncated"] = int(long.sum())
        return np.minimum(docs, capacity), counts
    if long_documents == "drop":
        counts["dropped"] = int(long.sum())
        return docs[~long], counts
    counts["split"] = int(long.sum())
    pieces = -(-docs // capacity)
    out = np.full(int(pieces.sum()), capacity, dtype=np.int64)
    last = np.cumsum(pieces) - 1
    out[last] = docs - (pieces - 1) * capacity
    return out, counts


def divisible_items(docs: np.ndarray, capacity: int, long_documents: str) -> np.ndarray:
    """Which of `items_from_documents`'s items are pieces of a split document (the planner may
    cut those to fill a row, `plan/fill.py`)."""
    docs = np.asarray(docs, dtype=np.int64)
    docs = docs[docs > 0]
    if long_documents == "drop":
        docs = docs[docs <= capacity]
    if long_documents != "split":
        return np.zeros(docs.size, dtype=bool)
    return np.repeat(docs > capacity, np.maximum(-(-docs // capacity), 1))


def _store_options(spec: LoaderSpec, source) -> dict:
    """The storage options the loader's Runtime gives this source's store."""
    scheme = source.uri.split("://", 1)[0] if "://" in source.uri else "file"
    shared = (spec.storage_options or {}) if scheme != "file" else {}
    return {**shared, **(source.storage_options or {})}


class _Skips:
    def __init__(self):
        self.count = 0

    def __call__(self, record, reason) -> None:
        self.count += 1


async def _index_lengths(store, source, shard: Shard, skips: Optional[_Skips]) -> np.ndarray:
    """Document lengths of a token shard from its offsets index alone."""
    uri = offsets_uri(shard.info.uri)
    try:
        offsets = await _read_offsets(store, uri)
        _check_offsets(offsets, None, _offsets_what(uri))   # no token file: no end check
        lengths = np.diff(offsets)
    except _BadShard as exc:
        if skips is None:
            raise DataError(str(exc), source=source.name, shard=shard.name) from None
        skips(None, str(exc))
        return np.zeros(0, np.int64)
    return lengths.astype(np.int64)


async def _scan_lengths(store, source, shard: Shard, tokenizer, skips: Optional[_Skips],
                        limit: Optional[int]) -> np.ndarray:
    """Document lengths of a record shard: decode, measure; stops once `limit` records are
    read (it may return a few more: the rest of the last decoded range)."""
    out: list[int] = []

    def add(records) -> None:
        texts = [r for r in records if isinstance(r.payload, str)]
        ids = None
        if tokenizer is not None and texts:
            try:
                ids = iter(tokenizer.encode_texts([r.payload for r in texts]))
            except TokenizerError as exc:
                raise DataError(str(exc), source=source.name, shard=shard.name,
                                record=texts[exc.index].index) from None
        for r in records:
            payload = r.payload
            if isinstance(payload, str):
                out.append(len(payload.encode("utf-8")) if ids is None else int(np.size(next(ids))))
            else:
                out.append(int(np.size(payload)))

    stream = await shard.format.open(store, shard.info, source=source.name, shard_name=shard.name,
                                     on_skip=skips, chunk_bytes=SCAN_CHUNK_BYTES)
    for start, end in stream.ranges():
        add(stream.decode(await store.read_range(shard.info.uri, start, end)))
        if limit is not None and len(out) >= limit:
            return np.array(out, dtype=np.int64)
    add(stream.finish())
    return np.array(out, dtype=np.int64)


async def _scan_source(spec: LoaderSpec, index: int, tokenizer, max_docs: Optional[int],
                       capacity: int, long_documents: str, on_error: str, retry) -> SourceScan:
    source = spec.sources[index]
    store = open_store(source.uri, _store_options(spec, source) or None, retry=retry)
    skips = _Skips() if on_error == "skip" else None
    try:
        try:
            shards = await list_shards(source, store)
        except StorageError as exc:
            if repr(source.name) in str(exc):
                raise
            raise StorageError(f"source {source.name!r}: {exc}", uri=source.uri) from None
        per_shard: list[np.ndarray] = []
        methods, formats = set(), set()
        budget = max_docs
        slots = asyncio.Semaphore(SCAN_CONCURRENCY)

        async def read(shard: Shard, limit: Optional[int]) -> np.ndarray:
            async with slots:
                if shard.format.name == "tokens":
                    return await _index_lengths(store, source, shard, skips)
                # One record more than needed tells whether the cap cut the shard short.
                return await _scan_lengths(store, source, shard, tokenizer, skips,
                                           None if limit is None else limit + 1)

        # Shards in listing order, a wave at a time, until max_docs documents are read.
        at, cut = 0, False
        while at < len(shards) and not cut:
            wave = shards[at:at + SCAN_CONCURRENCY]
            at += len(wave)
            results = await asyncio.gather(*(read(s, budget) for s in wave))
            for shard, docs in zip(wave, results):
                if budget is not None:
                    if docs.size > budget:
                        docs, cut = docs[:budget], True
                    budget -= docs.size
                per_shard.append(docs)
                methods.add("index" if shard.format.name == "tokens" else "scan")
                formats.add(shard.format.name)
                if cut:
                    break
            if budget == 0 and at < len(shards):
                cut = True
        complete = not cut
    finally:
        await store.aclose()

    counts = {"empty": 0, "split": 0, "truncated": 0, "dropped": 0}
    items, shard_items, divisible = [], [], []
    for docs in per_shard:
        lengths, c = items_from_documents(docs, capacity, long_documents)
        items.append(lengths)
        divisible.append(divisible_items(docs, capacity, long_documents))
        shard_items.append(lengths.size)
        for k, v in c.items():
            counts[k] += v
    return SourceScan(
        name=source.name, format="+".join(sorted(formats)) or "-",
        method="+".join(m for m in ("index", "scan") if m in methods) or "-",
        lengths=np.concatenate(items) if items else np.zeros(0, np.int64),
        shard_items=np.array(shard_items, dtype=np.int64), shards=len(shards),
        shards_read=len(per_shard), documents=int(sum(d.size for d in per_shard)),
        skipped=skips.count if skips else 0, complete=complete,
        divisible=np.concatenate(divisible) if divisible else np.zeros(0, bool), **counts)


def scan(spec: LoaderSpec, max_docs: Optional[int] = None) -> list[SourceScan]:
    """Every source's item lengths (see the module docstring). Reads offsets indexes for token
    shards and decodes JSONL records; `max_docs` caps the documents read per source."""
    if max_docs is not None and max_docs < 1:
        raise ConfigError(f"max_docs: must be an integer >= 1, got {max_docs!r}")
    config = spec.config()
    tokenizer = spec.load_tokenizer()

    async def all_sources():
        return await asyncio.gather(*(
            _scan_source(spec, s, tokenizer, max_docs, config.micro_batch_tokens,
                         config.long_documents, config.on_error, config.retry)
            for s in range(len(spec.sources))))

    return list(asyncio.run(all_sources()))


def scan_lengths(spec: LoaderSpec, max_docs: Optional[int] = None) -> list[np.ndarray]:
    """Per source, item lengths (int64): shard by shard in listing order, records in order."""
    return [s.lengths for s in scan(spec, max_docs)]
