"""Delivery: from a step's assignment to this rank's Batch.

Pop the planned items from this rank's buffers, exchange them so each goes to the rank the plan
names (all-to-all), pack them into M rows of at most C tokens (exactly C, padded, with
`pad_to="capacity"`), with their labels and loss masks, and count what was delivered. A job
with an image source (`use_images`) moves each item's encoded images with it and attaches the
decoded patches to its row (`pipeline/image_batches.py`).
Loop-owned, like the buffers it takes from.
"""
from __future__ import annotations

from typing import Awaitable, Callable, Optional, Sequence, TypeVar

import numpy as np
import torch

from . import pieces
from .batch import Batch, MicroBatch
from .collective.comm import Comm
from .collective.exchange import exchange_tokens
from .collective.messages import PlanMessage, StepTotals, Summaries, step_totals
from .formats.base import Problems
from .metrics import SourceMetrics, StepMetrics
from .mixreport import StepMix
from .pipeline.buffer import SourceBuffer
from .pipeline.image_batches import ImageBatches
from .pipeline.recycle import ArrayRecycler
from .pipeline.skips import SkipLedger
from .plan.cost import CostModel
from .plan.packing import pack_rows, row_memory_words, split_row_memory
from .plan.types import Geometry
from .vision.exchange import exchange_images

T = TypeVar("T")


class Delivery:
    def __init__(self, comm: Comm, geometry: Geometry, cost: CostModel, source_names: Sequence[str],
                 source_metrics: Sequence[SourceMetrics], step_metrics: StepMetrics,
                 batches_held: int, *, pad_to: Optional[str] = None, pad_token_id: int = 0,
                 encoder_sources: Optional[np.ndarray] = None, on_error: str = "raise",
                 skip_ledgers: Optional[Sequence[Optional[SkipLedger]]] = None):
        """`batches_held`: packed steps alive at once (queued, held by the trainer, packing).
        `pad_to="capacity"`: every row padded to C tokens with `pad_token_id`.
        `encoder_sources`: bool [S], the sources whose extra cost is the vision encoder's (the
        Batch's encoder / backbone split); None: none. `on_error` and `skip_ledgers` (one per
        source, None for a text source): what an image that does not decode at delivery
        becomes (a DataError, or a skip counted under the source's limit)."""
        self.comm, self.geometry, self.cost = comm, geometry, cost
        self.source_names = list(source_names)
        self.source_metrics, self.step_metrics = source_metrics, step_metrics
        self.shard_names: list[list[str]] = [[] for _ in self.source_names]   # set by `listed`
        self._id_prefixes: dict[tuple[int, int], str] = {}   # (source, shard) -> "name/shard/"
        self._pad = pad_to == "capacity"
        self._pad_token_id = pad_token_id
        # Packed rows, tokens, positions, labels and loss mask, in one array per step.
        self._step_size = geometry.micro_batches * geometry.capacity
        self._row_memory = ArrayRecycler(row_memory_words(self._step_size), np.int64,
                                         batches_held)
        self._counting = np.arange(geometry.capacity, dtype=np.int64)   # position ids' source
        self.images: Optional[ImageBatches] = None   # `use_images`
        self.encoder_sources = encoder_sources
        self.on_error = on_error
        self.skip_ledgers = list(skip_ledgers) if skip_ledgers is not None else \
            [None] * len(self.source_names)

    def use_images(self, images: ImageBatches) -> None:
        """Steps carry images: every rank of the job calls this before the first step."""
        self.images = images

    def close(self) -> None:
        if self.images is not None:
            self.images.close()

    def listed(self, shard_names: Sequence[Sequence[str]]) -> None:
        self.shard_names = [list(names) for names in shard_names]

    async def deliver(self, step: int, epoch: int, summaries: Summaries, plan: PlanMessage,
                      buffers: Sequence[SourceBuffer], window_sizes: Sequence[int],
                      collective: Callable[[Callable[[], T]], Awaitable[T]],
                      mix: Optional[StepMix] = None,
                      totals: Optional[StepTotals] = None) -> Batch:
        """This rank's Batch of the step; `mix`: the step's mix facts, passed on in the Batch.
        `totals`: the job-wide figures, when `plan` is only this rank's part of it
        (control_plane="gather"); else they are counted from the plan."""
        c = summaries.candidates
        me, M = self.comm.rank, self.geometry.micro_batches
        holder = c.rank[plan.take]
        lengths = plan.length
        mine: dict[int, np.ndarray] = {}
        refs: dict[int, tuple] = {}   # plan entry -> its images (a job with images)
        # The entries this rank holds, by source and then window position (what each buffer's
        # `take` wants), in one sort; every buffer takes (what stays in its window ages).
        held = np.flatnonzero(holder == me)
        candidate = plan.take[held]
        order = np.lexsort((c.position[candidate], c.source[candidate]))
        held, candidate = held[order], candidate[order]
        positions = c.position[candidate].astype(np.int64)
        bounds = np.searchsorted(c.source[candidate], np.arange(len(buffers) + 1)).tolist()
        short = np.flatnonzero(lengths[held] < c.length[candidate])   # cut to fill a row
        cuts = dict(zip(short.tolist(), lengths[held[short]].tolist()))   # k -> tokens taken
        position_list, held_list = positions.tolist(), held.tolist()
        for s, buffer in enumerate(buffers):
            a, b = bounds[s], bounds[s + 1]
            cut = {position_list[k]: n for k, n in cuts.items() if a <= k < b} if cuts else {}
            taken = buffer.take(positions[a:b], window_sizes[s], cut)
            mine.update(zip(held_list[a:b], taken.tokens))
            if self.images is not None:
                refs.update(zip(held_list[a:b], taken.images or [()] * len(taken.tokens)))
        entries, tokens = await collective(
            lambda: exchange_tokens(self.comm, holder, plan.rank, lengths, mine))
        if self.images is not None:
            refs_here = await collective(
                lambda: exchange_images(self.comm, holder, plan.rank, refs))
        sources = c.source[plan.take[entries]]
        received = lengths[entries]
        memory = self._row_memory.take()
        source_list, id_list = sources.tolist(), summaries.ids[plan.take[entries]].tolist()
        rows, micro_batches = self._pack(tokens, plan.row[entries], source_list, id_list,
                                         memory)
        if self.images is not None:
            micro_batches, failed = await self.images.attach(micro_batches, rows, entries,
                                                             refs_here)
            if failed:   # raises under on_error="raise"; under "skip" the samples leave
                keep = self._skip_undecodable(failed, source_list, id_list)
                entries, received, sources = entries[keep], received[keep], sources[keep]
                source_list, id_list = sources.tolist(), [id_list[k] for k in keep.tolist()]
                rows, micro_batches = self._pack([tokens[k] for k in keep.tolist()],
                                                 plan.row[entries], source_list, id_list, memory)
                micro_batches, _ = await self.images.attach(micro_batches, rows, entries,
                                                            refs_here)
            self._count_kept(sources)
        if totals is None:
            totals = step_totals(c, plan, self.cost, self.geometry, self.encoder_sources)
        self._count(totals, sources, received)
        return Batch(step, epoch, micro_batches, totals.rank_tokens, totals.row_cost.sum(axis=1),
                     row_cost=totals.row_cost, pipeline_stages=self.geometry.pipeline_stages,
                     max_deferral=totals.deferral_max, source_tokens=totals.source_tokens,
                     exchanged_tokens=totals.exchanged, mix=mix,
                     encoder_cost=None if totals.encoder_cost is None
                     else totals.encoder_cost.sum(axis=1), costs=totals.costs)

    def _pack(self, tokens: list, row_of: np.ndarray, source_list: list, id_list: list,
              memory: np.ndarray) -> tuple[list, list[MicroBatch]]:
        """The received items packed into their rows (in `memory`), and a MicroBatch each."""
        rows = pack_rows(tokens, row_of, self.geometry.micro_batches, self.geometry.capacity,
                         out=split_row_memory(memory, self._step_size),
                         pad_to_capacity=self._pad, pad_token_id=self._pad_token_id,
                         counting=self._counting)
        micro_batches = []
        sample_id, prefixes = self._sample_id, self._id_prefixes
        for row in rows:
            ids = []
            for k in row.item_indices.tolist():
                shard, record, chunk = id_list[k]
                prefix = prefixes.get((source_list[k], shard))
                # a whole document whose shard was named before: its id inline
                ids.append(f"{prefix}{record}" if chunk < 0 and prefix is not None
                           else sample_id(source_list[k], shard, record, chunk))
            micro_batches.append(MicroBatch(
                tokens=torch.from_numpy(row.tokens), cu_seqlens=torch.from_numpy(row.cu_seqlens),
                position_ids=torch.from_numpy(row.position_ids),
                labels=torch.from_numpy(row.labels), loss_mask=torch.from_numpy(row.loss_mask),
                sample_ids=ids, max_seqlen=row.max_seqlen, padding=row.padding))
        return rows, micro_batches

    def _skip_undecodable(self, failed: dict[int, str], source_list: list,
                          id_list: list) -> np.ndarray:
        """on_error applied to the received items whose images did not decode (`failed`: {k:
        why}): a DataError naming the first (source, shard, record, member), or under "skip"
        each counted in its source's ledger (the skip limit text has). Returns the indices of
        the received items kept. The samples were planned and taken from their buffers: they
        count as consumed (exactly-once holds; a resume does not bring them back)."""
        for k in sorted(failed):
            source, (shard, record, _) = source_list[k], id_list[k]
            names = self.shard_names[source]
            shard_name = names[shard % len(names)]
            problems = Problems(self.source_names[source], shard_name, self.on_error)
            problems.record(record, failed[k])   # raises under on_error="raise"
            self.skip_ledgers[source].add(shard_name, problems.take(), kept=0)
        return np.array([k for k in range(len(source_list)) if k not in failed], np.int64)

    def end_epoch(self) -> None:
        """The skip limit's end-of-epoch check on what failed at delivery (`SkipLedger`)."""
        for ledger in self.skip_ledgers:
            if ledger is not None:
                ledger.check(final=True)

    def _count_kept(self, sources: np.ndarray) -> None:
        """The image samples delivered, for the skip limit of what failed at delivery."""
        for source, n in enumerate(np.bincount(sources, minlength=len(self.source_names))):
            if n and self.skip_ledgers[source] is not None:
                self.skip_ledgers[source].kept += int(n)

    def _count(self, totals: StepTotals, sources: np.ndarray, received: np.ndarray) -> None:
        """Delivery counters: this rank's per source, the job's per step."""
        S = len(self.source_names)
        samples = np.bincount(sources, minlength=S)
        delivered = np.bincount(sources, weights=received, minlength=S)
        for metrics, n, t in zip(self.source_metrics, samples.tolist(), delivered.tolist()):
            metrics.delivered_samples += n
            metrics.delivered_tokens += int(t)
        metrics = self.step_metrics
        metrics.record(totals.rank_tokens, totals.row_cost, self.geometry.pipeline_stages,
                       encoder_cost=totals.encoder_cost, costs=totals.costs)
        metrics.pieces_cut += totals.pieces_cut
        metrics.cut_work += totals.cut_work
        metrics.deferral_max = max(metrics.deferral_max, totals.deferral_max)
        metrics.deferral_sum += totals.deferral_sum
        metrics.delivered += totals.delivered
        metrics.exchanged_tokens += totals.exchanged

    def _sample_id(self, source: int, shard: int, record: int, chunk: int) -> str:
        """"source/shard/record", ":k" for piece k of a split document, ":k+o" for what was
        left of it after its first o tokens went to an earlier step (`pieces`)."""
        prefix = self._id_prefixes.get((source, shard))
        if prefix is None:
            names = self.shard_names[source]
            # A repeated or restarted pass reads the same shard again.
            prefix = self._id_prefixes[(source, shard)] = \
                f"{self.source_names[source]}/{names[shard % len(names)]}/"
        return f"{prefix}{record}{pieces.suffix(chunk)}"
