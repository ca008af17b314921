"""Per-source fetchers: list shards, read this rank's shards in a seeded order, fill the buffer.

Each rank reads a disjoint subset of every source's shards: the epoch's seeded permutation,
strided by rank. Shards are read `shard_prefetch` at a time and byte ranges `range_readahead`
at a time, but items reach the buffer shard by shard and record by record, so the buffer's
order never depends on which fetch finished first.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..config import LoaderConfig, Source
from ..errors import StorageError
from ..formats import format_for
from ..formats.base import ShardFormat
from ..metrics import SourceMetrics
from ..storage import ObjectInfo, ObjectStore, relative_name
from ..state import EpochLayout, ReadUnit
from .buffer import SourceBuffer
from .prefetch import ordered_prefetch
from .supervisor import Supervisor
from .transform import Tokenizer, records_to_items


@dataclass(frozen=True)
class Shard:
    index: int            # position in the sorted listing: the stable shard id
    name: str             # name relative to the source URI, used in sample ids
    info: ObjectInfo
    format: ShardFormat


async def list_shards(source: Source, store: ObjectStore) -> list[Shard]:
    """Every shard of a source, sorted; companion and unknown files are left out."""
    objects = await store.list(source.uri)
    shards = []
    for info in sorted(objects):
        fmt = format_for(info.uri, format_name=source.format, text_field=source.text_field)
        if fmt is not None:
            shards.append(Shard(len(shards), relative_name(source.uri, info.uri), info, fmt))
    if not shards:
        seen = ", ".join(o.uri.rsplit("/", 1)[-1] for o in objects[:5])
        raise StorageError(
            f"source {source.name!r}: no shards match {source.uri}"
            + (f" ({len(objects)} object(s) found but none in a known format, e.g. {seen})"
               if objects else ""), uri=source.uri)
    return shards


class SourceFetcher:
    def __init__(self, *, source_index: int, source: Source, shards: list[Shard],
                 store: ObjectStore, buffer: SourceBuffer, metrics: SourceMetrics,
                 config: LoaderConfig, rank: int, world: int, tokenizer: Optional[Tokenizer],
                 executor, supervisor: Supervisor,
                 layout_for: Callable[[int], EpochLayout], resume_ages: Optional[dict] = None):
        self.source_index, self.source, self.shards = source_index, source, shards
        self.store, self.buffer, self.metrics, self.config = store, buffer, metrics, config
        self.rank, self.world, self.tokenizer = rank, world, tokenizer
        self.executor, self.supervisor = executor, supervisor
        self.layout_for, self.ages = layout_for, resume_ages

    async def run(self, start_epoch: int = 0) -> None:
        epoch = start_epoch
        while self.config.epochs is None or epoch < self.config.epochs:
            await self._read_epoch(self.layout_for(epoch).rank_units(self.rank))
            await self.buffer.end_epoch(epoch)
            self.ages = None   # restored ages apply to the resumed epoch only
            epoch += 1

    async def _read_epoch(self, units: list[ReadUnit]) -> None:
        # Shards are read ahead concurrently into their own small queues, then drained in order.
        async def start(unit: ReadUnit) -> asyncio.Queue:
            queue: asyncio.Queue = asyncio.Queue(maxsize=self.config.range_readahead)
            shard = self.shards[unit.shard]
            self.supervisor.spawn(self._read_shard(shard, unit.keep_filter(), queue),
                                  name=f"read {self.source.name}/{shard.name}")
            return queue

        async for queue in ordered_prefetch(units, start, self.config.shard_prefetch):
            while (items := await queue.get()) is not None:
                await self.buffer.put(items)

    async def _read_shard(self, shard: Shard, keep, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        skips: list[tuple[Optional[int], str]] = []
        on_skip = (lambda record, reason: skips.append((record, reason))) \
            if self.config.on_error == "skip" else None
        stream = await shard.format.open(self.store, shard.info, source=self.source.name,
                                         shard_name=shard.name, on_skip=on_skip,
                                         chunk_bytes=self.config.chunk_bytes)

        async def fetch(byte_range: tuple[int, int]) -> bytes:
            return await self.store.read_range(shard.info.uri, *byte_range)

        async def transform(decode, *args):
            started = time.perf_counter()
            records = await loop.run_in_executor(self.executor, decode, *args)
            items, counts = await loop.run_in_executor(
                self.executor, records_to_items, records, shard.index, self.tokenizer,
                self.config.micro_batch_tokens, self.config.long_documents, keep, self.ages)
            counts.add_to(self.metrics)
            self.metrics.transform_s += time.perf_counter() - started
            self._record_skips(shard, skips)
            if items:
                await queue.put(items)

        async for chunk in ordered_prefetch(stream.ranges(), fetch, self.config.range_readahead):
            await transform(stream.decode, chunk)
        await transform(stream.finish)
        self.metrics.shards_read += 1
        await queue.put(None)

    def _record_skips(self, shard: Shard, skips: list) -> None:
        while skips:
            record, reason = skips.pop(0)
            if record is None:
                self.metrics.skipped_shards += 1
            else:
                self.metrics.skipped_records += 1
            self.metrics.skip_reasons.append(
                f"{self.source.name}/{shard.name}" + (f"/{record}" if record is not None else "")
                + f": {reason}")
