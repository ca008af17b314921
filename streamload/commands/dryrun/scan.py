"""Reading a configuration's item lengths, as the loader would make its items (the dry run's
input): each shard's format measures its documents (`ShardFormat.document_lengths`), and the
loader's own rule for long documents (`pieces.cut_documents`) turns them into items."""
from __future__ import annotations

import asyncio
from typing import Optional

from dataclasses import dataclass

import numpy as np

from ...configfile import LoaderSpec
from ...errors import ConfigError, StorageError
from ...pieces import cut_documents
from ...formats.base import DocumentLengths, Problems
from ...formats.catalog import Shard, list_shards
from ...storage import open_store, source_store_options


SCAN_CONCURRENCY = 8


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


async def _scan_source(spec: LoaderSpec, index: int, tokenizer, max_docs: Optional[int],
                       capacity: int, long_documents: str, on_error: str, retry) -> SourceScan:
    source = spec.sources[index]
    options = source_store_options(source.uri, spec.storage_options, source.storage_options)
    store = open_store(source.uri, options or None, retry=retry)
    skipped = 0   # records and shards skipped (on_error="skip")
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

        async def read(shard: Shard, limit: Optional[int]) -> DocumentLengths:
            nonlocal skipped
            async with slots:
                # One document more than needed tells whether the cap cut the shard short.
                problems = Problems(source.name, shard.name, on_error)
                lengths = await shard.format.document_lengths(
                    store, shard.info, problems=problems, tokenizer=tokenizer,
                    limit=None if limit is None else limit + 1)
                skipped += len(problems.take())
                return lengths

        # Shards in listing order, a wave at a time, until max_docs documents are read.
        at, cut = 0, False
        while at < len(shards) and not cut:
            wave = shards[at:at + SCAN_CONCURRENCY]
            at += len(wave)
            results = await asyncio.gather(*(read(s, budget) for s in wave))
            for shard, (docs, method) in zip(wave, results):
                if budget is not None:
                    if docs.size > budget:
                        docs, cut = docs[:budget], True
                    budget -= docs.size
                per_shard.append(docs)
                methods.add(method)
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
        cuts = cut_documents(docs, capacity, long_documents)   # the loader's rule
        items.append(cuts.lengths)
        divisible.append(cuts.divisible)
        shard_items.append(cuts.lengths.size)
        for k, v in cuts.counts().items():
            counts[k] += v
    return SourceScan(
        name=source.name, format="+".join(sorted(formats)) or "-",
        method="+".join(m for m in ("index", "scan") if m in methods) or "-",
        lengths=np.concatenate(items) if items else np.zeros(0, np.int64),
        shard_items=np.array(shard_items, dtype=np.int64), shards=len(shards),
        shards_read=len(per_shard), documents=int(sum(d.size for d in per_shard)),
        skipped=skipped, complete=complete,
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
