"""Per-source fetchers: read this rank's shards in a seeded order, fill the buffer.

Each rank reads a disjoint subset of every source's shards: its read units for the epoch (see
state.py; a fresh epoch deals the seeded permutation of shards, strided by rank). Several shards
are read at once and several byte ranges per shard (the autoscaler's knobs, within the memory
gate), but items reach the buffer shard by shard and record by record, so the buffer's order
never depends on which fetch finished first.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterable, Optional

import numpy as np

from ..config import LoaderConfig, Source
from ..errors import DataError
from ..formats.base import (PlannedStream, Problems, RawRecord, Records, decode_columns,
                            finish_columns)
from ..formats.catalog import Shard
from ..formats.lengths import encode_records
from ..metrics import SourceMetrics
from ..storage import ObjectStore
from ..storage.base import CountedStore
from ..storage.buffers import mapped_buffer
from ..state import EpochLayout, ReadUnit
from ..tokenizer import TextTokenizer
from .autoscale import Knobs, MemoryGate
from .buffer import SourceBuffer
from .images import ImageItems, image_bytes
from .prefetch import ordered_prefetch
from .skips import SkipLedger
from .supervisor import Supervisor
from .transform import records_to_block, tokenize_texts


class SourceFetcher:
    def __init__(self, *, source_index: int, source: Source, shards: list[Shard],
                 store: ObjectStore, buffer: SourceBuffer, metrics: SourceMetrics,
                 config: LoaderConfig, rank: int, world: int, tokenizer: Optional[TextTokenizer],
                 executor, supervisor: Supervisor,
                 layout_for: Callable[[int], EpochLayout], knobs: Knobs, gate: MemoryGate,
                 resume_ages: Optional[dict] = None, tokenizer_processes=None):
        self.source_index, self.source, self.shards = source_index, source, shards
        self.store, self.buffer, self.metrics, self.config = store, buffer, metrics, config
        self.rank, self.world, self.tokenizer = rank, world, tokenizer
        self.executor, self.supervisor = executor, supervisor
        self.layout_for, self.ages = layout_for, resume_ages
        self.knobs, self.gate = knobs, gate
        self.tokenizer_processes = tokenizer_processes
        self.store = CountedStore(store)   # this source's requests, even on a shared store
        self.skips = SkipLedger(source.name, source.uri, config.max_skip_fraction, metrics)
        # An image source's records become items here, text and headers (`images.py`).
        self.image_items = None if source.images is None else ImageItems(
            source.images, tokenizer, config.micro_batch_tokens, config.long_documents,
            config.max_images_per_row, config.max_patches_per_row)

    async def run(self, start_epoch: int = 0) -> None:
        epoch = start_epoch
        while self.config.epochs is None or epoch < self.config.epochs:
            layout = self.layout_for(epoch)
            # An endless layout (on_exhausted="restart") streams pass after pass: never returns.
            await self._read_units(layout.stream(self.rank), endless=layout.endless)
            self.skips.check(final=True)
            await self.buffer.end_epoch(epoch)
            self.ages = None   # restored ages apply to the resumed epoch only
            epoch += 1

    async def _read_units(self, units: Iterable[ReadUnit], endless: bool) -> None:
        # Shards are read ahead concurrently into their own queues, then drained in order. The
        # memory gate bounds what they hold; the drained shard may always proceed.
        async def start(unit: ReadUnit) -> tuple[ReadUnit, asyncio.Queue]:
            queue: asyncio.Queue = asyncio.Queue()
            # With repeat=k, a source has k passes of "virtual" shards: v reads shard v % n.
            shard = self.shards[unit.shard % len(self.shards)]
            self.supervisor.spawn(self._read_shard(shard, unit.shard, unit.keep_filter(), queue),
                                  name=f"read {self.source.name}/{shard.name}")
            return unit, queue

        empty_in_a_row: set[int] = set()   # listed shards read whole, in a row, without items
        async for unit, queue in ordered_prefetch(units, start, lambda: self.knobs.shards):
            self.gate.set_head(unit.shard)
            produced = 0
            while (entry := await queue.get()) is not None:
                block, held = entry
                produced += len(block)
                await self.buffer.put((block,))
                self.gate.release(held, unit.shard)
            if not endless:
                continue
            if produced or unit.skip_through is not None:
                empty_in_a_row.clear()
            else:
                empty_in_a_row.add(unit.shard % len(self.shards))
                if len(empty_in_a_row) == len(self.shards):
                    raise DataError(f"every one of its {len(self.shards)} shard(s) under "
                                    f"{self.source.uri} was read without a single sample, so "
                                    f"on_exhausted='restart' would read them forever",
                                    source=self.source.name)

    async def _read_shard(self, shard: Shard, virtual: int, keep, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        self.metrics.shards_started += 1
        # The shard's context and the policy, for every problem of the shard (the format's,
        # the tokenizer's, the transform's): a DataError naming it, or with on_error="skip" a
        # skip kept as data and handed to the ledger (`SkipLedger`, the limit) after each range.
        problems = Problems(self.source.name, shard.name, self.config.on_error)
        stream = await shard.format.open(self.store, shard.info, problems=problems,
                                         chunk_bytes=self.config.chunk_bytes)
        if keep is not None and isinstance(stream, PlannedStream):
            stream.keep_only(keep.wants_any)   # a resumed shard: what it delivered is not read

        in_order = asyncio.Lock()   # FIFO: a shard's fetches reserve memory in range order
        # A stream that keeps nothing of a chunk once decoded (JSONL) gets its ranges in mapped
        # buffers, out of the allocator's arenas (`storage.buffers`: the RSS climb, rss9).
        into = {"buffer": mapped_buffer} if getattr(stream, "takes_buffers", False) else {}

        async def fetch(byte_range: tuple[int, int]) -> tuple[int, int, bytes]:
            size = byte_range[1] - byte_range[0]
            reserved = self.gate.reservation(size)
            async with in_order:   # else a later range could hold memory the next one waits for
                await self.gate.acquire(reserved, virtual)
            return reserved, size, await self.store.read_range(shard.info.uri, *byte_range,
                                                               **into)

        def to_items(records):
            if self.image_items is not None:
                return self.image_items(records, virtual, keep, self.ages, problems=problems)
            return records_to_block(records, virtual, self.config.micro_batch_tokens,
                                    self.config.long_documents, keep, self.ages,
                                    problems=problems)

        def wanted(records):   # a resumed shard: records already delivered go no further
            if keep is None:
                return records
            if isinstance(records, Records):
                return records.select(np.fromiter(map(keep.wants, records.index.tolist()),
                                                  bool, len(records)))
            return [r for r in records if keep.wants(r.index)]

        # An image source's records are image-text samples, one object each; others' ranges
        # decode to columns (`Records`).
        decode, finish = (stream.decode, stream.finish) if self.image_items is not None else \
            (lambda chunk: decode_columns(stream, chunk), lambda: finish_columns(stream))

        def decode_and_tokenize(decode, *args):
            return to_items(wanted(decode(*args)))

        async def transform(reserved: int, raw_bytes: int, decode, *args):
            started = time.perf_counter()
            if self.tokenizer is None or self.image_items is not None:   # one hop
                items, counts = await loop.run_in_executor(self.executor, decode_and_tokenize,
                                                           decode, *args)
            else:   # one tokenizer call for the range, on a thread or in a process
                records = wanted(await loop.run_in_executor(self.executor, decode, *args))
                records = await self._tokenize(records, problems)
                items, counts = await loop.run_in_executor(self.executor, to_items, records)
            counts.add_to(self.metrics)
            self.metrics.transform_s += time.perf_counter() - started
            self.skips.add(shard.name, problems.take(), counts.records)   # raises past the limit
            held = items.nbytes + image_bytes(items) if len(items) else 0
            self.gate.settle(reserved, raw_bytes, held, virtual)
            if len(items):
                await queue.put((items, held))

        async for reserved, size, chunk in ordered_prefetch(stream.ranges(), fetch,
                                                            lambda: self.knobs.readahead):
            await transform(reserved, size, decode, chunk)
        await transform(0, 0, finish)
        self.metrics.shards_read += 1
        await queue.put(None)

    async def _tokenize(self, records, problems: Problems) -> list[RawRecord]:
        """Text payloads -> token ids, one `encode_texts` call for all of a range's texts (on
        a transform thread, or in the tokenizer processes); failures as `encode_records` has
        them (a DataError naming the record, or with on_error="skip" skipped and counted)."""
        if self.tokenizer_processes is not None:
            pool, call = self.tokenizer_processes, tokenize_texts
        else:
            pool, call = self.executor, self.tokenizer.encode_texts
        loop = asyncio.get_running_loop()
        if isinstance(records, Records):
            records = records.to_list()
        pairs = await encode_records(
            records, lambda texts: loop.run_in_executor(pool, call, texts), problems)
        out = []
        for record, ids in pairs:
            if isinstance(record.payload, str):
                ids = np.asarray(ids)
                if ids.dtype == np.int32:   # records_to_block checks ids, but trusts int32
                    ids = ids.astype(np.int64)   # ones (a token shard's, checked by its format)
                record = RawRecord(record.index, ids)
            out.append(record)
        return out
