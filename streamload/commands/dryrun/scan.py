"""Reading a configuration's item lengths, as the loader would make its items (the dry run's
input): each shard's format measures its documents (`ShardFormat.document_lengths`), and the
loader's own rule for long documents (`pieces.cut_documents`) turns them into items. An image
source's samples are measured with their images' patches, from the headers (no pixel decoded),
and kept as the loader's transform keeps them: never split, refused over a row or a cap per
row."""
from __future__ import annotations

import asyncio
from typing import Optional

from dataclasses import dataclass

import numpy as np

from ...configfile import LoaderSpec
from ...errors import ConfigError, StorageError
from ...pieces import cut_documents
from ...formats.base import LENGTHS_CHUNK_BYTES, DocumentLengths, Problems
from ...formats.catalog import Shard, list_shards
from ...formats.lengths import stream_measures
from ...vision.fit import over_row_caps
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
    # An image source: each item's images' encoder patches (from the headers: no pixel
    # decoded), for the encoder's cost and the caps per row; None: a text source.
    image_patches: Optional[list] = None

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def to_dict(self) -> dict:
        return {"name": self.name, "format": self.format, "method": self.method,
                "shards": self.shards, "shards_read": self.shards_read,
                "documents": self.documents, "items": int(self.lengths.size),
                "tokens": self.tokens, "empty": self.empty, "split": self.split,
                "truncated": self.truncated, "dropped": self.dropped, "skipped": self.skipped,
                "sampled": not self.complete,
                **({} if self.image_patches is None else {
                    "images": int(sum(len(p) for p in self.image_patches)),
                    "patches": int(sum(sum(p) for p in self.image_patches))})}


def _image_documents(measured: list, problems: Problems, capacity: int, long_documents: str,
                     caps: tuple) -> tuple[np.ndarray, list, int]:
    """An image shard's (index, key, length, patches) as the loader's transform keeps them
    (`pipeline/images.py`): a sample is never split, one longer than a row is a record error
    (with long_documents="drop", dropped and counted), so is one over a cap per row. Returns
    (lengths, patches per item, dropped)."""
    lengths, patches, dropped = [], [], 0
    for index, key, length, per_image in measured:
        problem = over_row_caps(per_image, *caps)
        if problem is None and length > capacity:
            if long_documents == "drop":
                dropped += 1
                continue
            problem = (f"{length} tokens ({len(per_image)} image(s)) do not fit a row of "
                       f"micro_batch_tokens={capacity}; an image sample is never split")
        if problem is not None:
            problems.record(index, f"sample {key!r}: {problem}")   # raises under "raise"
            continue
        if length:
            lengths.append(length)
            patches.append(per_image)
    return np.array(lengths, np.int64), patches, dropped


async def _scan_source(spec: LoaderSpec, index: int, tokenizer, max_docs: Optional[int],
                       capacity: int, long_documents: str, on_error: str, retry,
                       caps: tuple = (None, None)) -> SourceScan:
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
        shard_patches: list[list] = []   # an image source: per shard, each item's patches
        image_dropped = 0
        methods, formats = set(), set()
        budget = max_docs
        slots = asyncio.Semaphore(SCAN_CONCURRENCY)

        async def read(shard: Shard, limit: Optional[int]):
            nonlocal skipped, image_dropped
            async with slots:
                # One document more than needed tells whether the cap cut the shard short.
                problems = Problems(source.name, shard.name, on_error)
                limit = None if limit is None else limit + 1
                if source.images is None:
                    lengths = await shard.format.document_lengths(
                        store, shard.info, problems=problems, tokenizer=tokenizer, limit=limit)
                    skipped += len(problems.take())
                    return lengths, None
                # Image-text samples: lengths and patches per image from the headers.
                measured = await stream_measures(
                    shard.format, store, shard.info, problems=problems, tokenizer=tokenizer,
                    limit=limit, chunk_bytes=LENGTHS_CHUNK_BYTES, images=source.images,
                    with_patches=True)
                docs, patches, dropped = _image_documents(measured, problems, capacity,
                                                          long_documents, caps)
                image_dropped += dropped
                skipped += len(problems.take())
                return DocumentLengths(docs, "scan"), patches

        # Shards in listing order, a wave at a time, until max_docs documents are read.
        at, cut = 0, False
        while at < len(shards) and not cut:
            wave = shards[at:at + SCAN_CONCURRENCY]
            at += len(wave)
            results = await asyncio.gather(*(read(s, budget) for s in wave))
            for shard, ((docs, method), patches) in zip(wave, results):
                if budget is not None:
                    if docs.size > budget:
                        docs, cut = docs[:budget], True
                        patches = None if patches is None else patches[:budget]
                    budget -= docs.size
                per_shard.append(docs)
                if patches is not None:
                    shard_patches.append(patches)
                methods.add(method)
                formats.add(shard.format.name)
                if cut:
                    break
            if budget == 0 and at < len(shards):
                cut = True
        complete = not cut
    finally:
        await store.aclose()

    counts = {"empty": 0, "split": 0, "truncated": 0, "dropped": image_dropped}
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
        divisible=np.concatenate(divisible) if divisible else np.zeros(0, bool),
        image_patches=None if source.images is None else
        [p for patches in shard_patches for p in patches], **counts)


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
                         config.long_documents, config.on_error, config.retry,
                         (config.max_images_per_row, config.max_patches_per_row))
            for s in range(len(spec.sources))))

    return list(asyncio.run(all_sources()))


def scan_lengths(spec: LoaderSpec, max_docs: Optional[int] = None) -> list[np.ndarray]:
    """Per source, item lengths (int64): shard by shard in listing order, records in order."""
    return [s.lengths for s in scan(spec, max_docs)]
