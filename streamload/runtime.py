"""The loader's asyncio side: one supervisor, the fetchers, and the step loop.

Each step, on every rank: wait until every source's head window is complete, all-gather the
windows' lengths, let rank 0 plan and broadcast, pop the planned items, exchange them, pack
them into M rows and hand a Batch to the bridge.
"""
from __future__ import annotations

import asyncio
import functools
import time
import zlib
from typing import Awaitable, Callable, Optional, Protocol, TypeVar

import numpy as np
import torch

from . import pieces
from .batch import Batch, MicroBatch
from .config import LoaderConfig, Source
from .errors import ConfigError
from .collective.comm import Comm, collective_thread
from .collective.coordinator import (OUTCOMES, SourceWindow, StopStepping, check_statuses, decode_plan,
                               decode_summaries, encode_closing, encode_failure, encode_plan,
                               encode_summary, encode_waiting, plan_size)
from .collective.exchange import exchange_tokens
from .metrics import SourceMetrics, StepMetrics
from .pipeline.autoscale import Autoscaler, Knobs, MemoryGate, MemoryPlan
from .pipeline.buffer import SourceBuffer
from .pipeline.fetch import Shard, SourceFetcher, list_shards
from .pipeline.recycle import ArrayRecycler
from .pipeline.supervisor import Supervisor
from .pipeline.workers import DaemonExecutor, run_detached
from .plan.cost import CostModel
from .plan.quota_mixer import QuotaMixer
from .plan.mix_spec import Mixture
from .plan.packing import pack_rows
from .plan.planner import Planner
from .plan.types import Geometry
from .state import (STATE_VERSION, EpochLayout, LoaderState, SourceTracker, fresh_layout,
                    layout_from_progress)
from .storage import ObjectStore, open_store
from .tokenizer import TextTokenizer

T = TypeVar("T")

WORKERS_FINISH_S = 30.0   # closing waits this long, at most, for tokenizer calls in flight


class Handoff(Protocol):
    """Where batches go: `reserve()` waits for room (the trainer took an earlier batch),
    `put()` hands one over and never blocks."""

    async def reserve(self) -> None: ...
    def put(self, batch: Batch) -> None: ...


class Runtime:
    def __init__(self, sources: list[Source], config: LoaderConfig, tokenizer: Optional[TextTokenizer],
                 comm: Comm, storage_options: Optional[dict] = None,
                 mixture: Optional[Mixture] = None, sample_costs: Optional[dict] = None):
        self.sources, self.config, self.tokenizer, self.comm = sources, config, tokenizer, comm
        self.sample_costs = dict(sample_costs or {})   # source name -> SampleCostHook
        unknown = sorted(set(self.sample_costs) - {s.name for s in sources})
        if unknown:
            raise ConfigError(f"sample_costs: no source named {unknown}; sources are "
                              f"{[s.name for s in sources]}")
        self.storage_options = storage_options or {}
        self.geometry = Geometry(comm.world, config.micro_batches, config.micro_batch_tokens)
        self.cost = CostModel(config.cost_a, config.cost_b, config.document_masking)
        self.planner = Planner(self.geometry, self.cost, method=config.planner, seed=config.seed,
                               max_age=config.max_deferral, lookahead=config.lookahead,
                               step_overhead=config.step_overhead)
        self.mixer = QuotaMixer.from_sources(mixture, sources, capacity=config.micro_batch_tokens)
        # Checked here, so a budget too small for the geometry fails when the Loader is built.
        # The knobs' ceilings come from each source's largest share over the schedule; the
        # windows follow the shares and the ranks holding data, step by step.
        self.memory = MemoryPlan(config, self.mixer.max_shares(), [s.name for s in sources],
                                 comm.world)
        self.budgets = self.memory.initial(self.mixer.max_shares())
        self.knobs = [Knobs(min(config.shard_prefetch, max_shards), min(config.range_readahead, max_ranges),
                            max_shards, max_ranges)
                      for b in self.budgets
                      for ranges in [max(1, b.inflight_bytes // config.chunk_bytes)]
                      for max_shards, max_ranges in [(min(config.max_shard_prefetch, ranges),
                                                      min(config.max_range_readahead, ranges))]]
        self.autoscaler = Autoscaler(self.knobs) if config.autoscale else None
        self.gates: list[MemoryGate] = []
        self.fetchers: list[SourceFetcher] = []
        self.source_waits = np.zeros(len(sources))
        self.source_metrics = [SourceMetrics() for _ in sources]
        self.step_metrics = StepMetrics(step_tokens=self.geometry.step_tokens)
        self.shards: list[list[Shard]] = []
        self.buffers: list[SourceBuffer] = []
        self.stores: list[ObjectStore] = []
        self.step = 0
        self.epoch = 0
        self.resume: Optional[LoaderState] = None   # set by Loader.load_state_dict
        self.trackers: list[SourceTracker] = []
        self.holding: Optional[np.ndarray] = None   # [R, S]: ranks holding data of each source
        self._budgets_key, self._budgets_now = None, None   # `_budgets`' last answer
        self.listing_crcs: list[int] = []
        self.closing = asyncio.Event()   # set by request_close(), on the loop
        self.started: Optional[float] = None            # when run() began (for rates)
        self._scale_mark: Optional[tuple] = None        # (time, buffers' blocked_s) at last step
        self._id_prefixes: dict[tuple[int, int], str] = {}   # (source, shard) -> "name/shard/"
        # Packed rows (tokens, then positions, in one array per step): the batches queued, the
        # one the trainer holds, the one being packed.
        step_size, keep = config.micro_batches * config.micro_batch_tokens, config.prefetch_steps + 2
        self._row_memory = ArrayRecycler(2 * step_size, np.int64, keep)   # tokens | positions

    # -- set-up ---------------------------------------------------------------------------
    def _stores(self) -> list[ObjectStore]:
        """One store per distinct (scheme, options), shared by the sources that use it."""
        cache: dict[tuple, ObjectStore] = {}
        out = []
        for s in self.sources:
            scheme = s.uri.split("://", 1)[0] if "://" in s.uri else "file"
            shared = self.storage_options if scheme != "file" else {}   # e.g. an S3 endpoint
            options = {**shared, **(s.storage_options or {})}
            key = (scheme, tuple(sorted((k, repr(v)) for k, v in options.items())))
            if key not in cache:
                cache[key] = open_store(s.uri, options, retry=self.config.retry,
                                        max_concurrency=self.config.max_concurrency)
            out.append(cache[key])
        return out

    # -- closing ------------------------------------------------------------------------------
    def request_close(self) -> None:
        """Called on the loop (call_soon_threadsafe). The step loop stops at its next all-gather,
        telling the other ranks, so no rank is left inside a collective."""
        self.closing.set()

    async def _agree(self, local: Callable[[], Awaitable[np.ndarray]]) -> list[np.ndarray]:
        """All-gather `local()`'s array once every rank has one.

        A rank that is not ready within the heartbeat period (a third of the collective
        timeout) gathers WAITING, and everyone gathers again: a busy trainer or a slow source
        never trips the timeout, which is left to catch dead or frozen processes. If `local()`
        raised anywhere, every rank raises. A closing rank sends CLOSING and stops
        (StopStepping) once the gather returns."""
        task = asyncio.ensure_future(local())
        heartbeat_s = self.config.collective_timeout_s / 3
        try:
            while True:
                closing_wait = asyncio.ensure_future(self.closing.wait())
                await asyncio.wait({task, closing_wait}, timeout=heartbeat_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                closing_wait.cancel()
                error, closing = None, self.closing.is_set()
                if closing:
                    array = encode_closing()
                elif not task.done():
                    array = encode_waiting()
                elif task.exception() is not None:   # told to every rank, then re-raised here
                    error = task.exception()
                    array = encode_failure(error)
                else:
                    array = task.result()
                gathered = await self._collective(lambda: self.comm.all_gather(array))
                if check_statuses(gathered, self.comm.rank, error, closing):
                    return gathered
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _collective(self, call: Callable[[], T]) -> T:
        """Run a blocking collective on the collective thread; with one rank there is nothing
        to wait for, so it runs inline (a thread hop per call costs more than the call)."""
        if self.comm.world == 1:
            return call()
        return await self.collectives.run(call)

    async def _list_all(self) -> np.ndarray:
        self.shards = list(await asyncio.gather(
            *(list_shards(s, store) for s, store in zip(self.sources, self.stores))))
        for metrics, shards in zip(self.source_metrics, self.shards):
            metrics.shards_listed = len(shards)
        # A fingerprint per source, so ranks that listed different shards fail loudly.
        self.listing_crcs = [zlib.crc32("\n".join(sh.name for sh in shards).encode())
                             for shards in self.shards]
        return np.array([0] + self.listing_crcs, dtype=np.int64)

    # -- epochs and resumption -------------------------------------------------------------
    def _apply_resume(self) -> None:
        state = self.resume
        if state.seed != self.config.seed:
            raise ConfigError(f"loader state: saved with seed {state.seed}, "
                              f"but this loader has seed {self.config.seed}")
        self.epoch, self.step = state.epoch, state.step
        if state.mixture is not None:
            self.mixer.load_state(state.mixture)
        self.resume_ages = [{} for _ in self.sources]
        if not state.sources:   # saved before the first step: a fresh start
            self.resume = None
            return
        if [p.name for p in state.sources] != [s.name for s in self.sources]:
            raise ConfigError(f"loader state: saved for sources {[p.name for p in state.sources]}, "
                              f"but this loader has {[s.name for s in self.sources]}")
        for s, progress in enumerate(state.sources):
            if (progress.num_shards, progress.listing_crc) != (self._virtual_shards(s), self.listing_crcs[s]):
                raise ConfigError(
                    f"loader state: source {progress.name!r} ({self.sources[s].uri}) has "
                    f"{self._virtual_shards(s)} shards now (times repeat) but "
                    f"{progress.num_shards} when the state was saved (or their names changed); "
                    f"cannot resume exactly")
        self.resumed_layouts = [
            layout_from_progress(p, seed=self.config.seed, epoch=state.epoch, source_index=s,
                                 world=self.comm.world, endless=self._endless(s))
            for s, p in enumerate(state.sources)]
        for source, shard, record, chunk, age in state.ages:
            self.resume_ages[source][(shard, record, chunk)] = age
        R, S = self.comm.world, len(self.sources)
        if state.holding is not None and state.world_size == R:   # the windows it stopped with
            self.holding = np.unpackbits(np.frombuffer(state.holding, np.uint8),
                                         count=R * S).astype(bool).reshape(R, S)

    def _virtual_shards(self, source: int) -> int:
        """Shards per epoch: each listed shard once per pass (`Source.repeat`)."""
        return len(self.shards[source]) * self.sources[source].repeat

    def _endless(self, source: int) -> bool:
        """A source with on_exhausted="restart": one stream of passes, across epochs."""
        return self.sources[source].on_exhausted == "restart"

    def layout_for(self, source: int, epoch: int) -> EpochLayout:
        """A finite source's layout for `epoch`; an endless source's whole stream."""
        endless = self._endless(source)
        if self.resume is not None and (endless or epoch == self.resume.epoch):
            return self.resumed_layouts[source]
        return fresh_layout(self._virtual_shards(source), seed=self.config.seed,
                            epoch=0 if endless else epoch, source_index=source,
                            world=self.comm.world, endless=endless)

    def _start_epoch_tracking(self) -> None:
        """New trackers for the finite sources; endless sources keep theirs."""
        previous = self.trackers
        self.trackers = [previous[s] if previous and self._endless(s)
                         else SourceTracker(self.layout_for(s, self.epoch),
                                            states_in_flight=self.config.prefetch_steps + 2)
                         for s in range(len(self.sources))]

    def _track(self, summaries, plan) -> None:
        c, R = summaries.candidates, self.comm.world
        taken = np.zeros(len(c), dtype=bool)
        taken[plan.take] = True
        ids = summaries.ids
        cut = plan.length < c.length[plan.take]
        if cut.any():   # the rest of a cut piece is pending, under its new offset (`pieces`)
            ids = ids.copy()
            ids[plan.take[cut], 2] += plan.length[cut]
            taken[plan.take[cut]] = False
        # Candidates are ordered by (source, rank, position): slice each window out.
        bounds = np.searchsorted(c.source.astype(np.int64) * R + c.rank,
                                 np.arange(len(self.sources) * R + 1))
        for s, tracker in enumerate(self.trackers):
            for q in range(R):
                lo, hi = bounds[s * R + q], bounds[s * R + q + 1]
                if hi > lo:
                    tracker.observe(q, ids[lo:hi], c.age[lo:hi].astype(np.int64),
                                    taken[lo:hi])

    def snapshot(self):
        """What `state()` needs to describe the job right after the current step."""
        return (self.epoch, self.step + 1, self.mixer.to_state(),
                [t.snapshot() for t in self.trackers], self.holding)

    def state(self, snapshot) -> LoaderState:
        if snapshot is None:   # nothing consumed yet: where this loader would start
            if self.resume is not None:
                return self.resume
            return LoaderState(STATE_VERSION, self.config.seed, self.comm.world, 0, 0, None, ())
        epoch, step, mixture, trackers, holding = snapshot
        sources, ages = [], []
        for s, (source, (tracker, ranks)) in enumerate(zip(self.sources, trackers)):
            progress, pending = tracker.progress(ranks, source.name, self.listing_crcs[s],
                                                 self._virtual_shards(s))
            sources.append(progress)
            ages += [(s, *a) for a in pending]
        return LoaderState(STATE_VERSION, self.config.seed, self.comm.world, epoch, step, mixture,
                           tuple(sources), tuple(ages), np.packbits(holding).tobytes())

    # -- main -----------------------------------------------------------------------------
    async def run(self, handoff: Handoff) -> None:
        self.started = time.perf_counter()
        self.collectives = collective_thread()
        executor = DaemonExecutor(self.config.transform_workers, "streamload-transform")
        processes = self._tokenizer_processes()
        supervisor = Supervisor(on_failure=lambda exc: [b.fail(exc) for b in self.buffers])
        self.stores = self._stores()
        try:
            gathered = await self._agree(self._list_all)
            for s, source in enumerate(self.sources):
                if len({int(g[1 + s]) for g in gathered}) > 1:
                    raise RuntimeError(f"source {source.name!r}: ranks listed different shards "
                                       f"for {source.uri}; is the bucket changing under the job?")
            if self.resume is not None:
                self._apply_resume()
            self._start_epoch_tracking()
            if self.holding is None:   # else resumed: the windows the saved run had
                self.holding = self._epoch_holding()
            self.budgets = self._budgets()
            self.buffers = [SourceBuffer(b.capacity_tokens, b.window_tokens) for b in self.budgets]
            self.gates = [MemoryGate(b.inflight_bytes) for b in self.budgets]
            for s, source in enumerate(self.sources):
                fetcher = SourceFetcher(
                    source_index=s, source=source, shards=self.shards[s], store=self.stores[s],
                    buffer=self.buffers[s], metrics=self.source_metrics[s], config=self.config,
                    rank=self.comm.rank, world=self.comm.world, tokenizer=self.tokenizer,
                    executor=executor, supervisor=supervisor, tokenizer_processes=processes,
                    layout_for=lambda epoch, s=s: self.layout_for(s, epoch),
                    knobs=self.knobs[s], gate=self.gates[s],
                    resume_ages=self.resume_ages[s] if self.resume is not None else None)
                self.fetchers.append(fetcher)
                supervisor.spawn(fetcher.run(self.epoch), name=f"fetch {source.name}")
            await self._step_loop(handoff)
        except StopStepping:
            pass
        finally:
            await supervisor.cancel_all()
            executor.shutdown()
            if getattr(self.tokenizer, "native_calls", False):   # see pipeline/workers.py
                await executor.finish(WORKERS_FINISH_S)
            if processes is not None:   # wait=True: a pool left running hangs the exit of a
                await run_detached(     # multiprocessing child (it joins its own children)
                    functools.partial(processes.shutdown, wait=True, cancel_futures=True),
                    WORKERS_FINISH_S)
            for store in {id(s): s for s in self.stores}.values():
                await store.aclose()
            self.collectives.shutdown()

    async def _wait_ready(self, s: int) -> None:
        started = time.perf_counter()
        await self.buffers[s].wait_ready()
        self.source_waits[s] = time.perf_counter() - started

    def _tokenizer_processes(self):
        """A process pool for tokenizers that hold the GIL (`tokenize_in="processes"`)."""
        if self.config.tokenize_in != "processes" or self.tokenizer is None:
            return None
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from .pipeline.transform import set_process_tokenizer
        return ProcessPoolExecutor(self.config.tokenizer_processes,
                                   mp_context=multiprocessing.get_context("spawn"),
                                   initializer=set_process_tokenizer, initargs=(self.tokenizer,))

    async def _summary(self) -> np.ndarray:
        if not self._slot_held:   # room for this step's batch first: then the step can't stall
            await self.handoff.reserve()
            self._slot_held = True
        await asyncio.gather(*(self._wait_ready(s) for s in range(len(self.buffers))))
        self._windows = [b.window() for b in self.buffers]
        windows = []
        for s, (items, done) in enumerate(self._windows):
            # One pass over the items: length, age, shard, record, chunk.
            fields = np.array([(i.tokens.shape[0], i.age, i.shard, i.record, i.chunk)
                               for i in items], dtype=np.int64).reshape(-1, 5)
            lengths = fields[:, 0]
            windows.append(SourceWindow(
                lengths, fields[:, 1], fields[:, 2:], done,
                CostModel.extra_cost(self.sample_costs.get(self.sources[s].name), lengths)))
        return encode_summary(windows)

    async def _step_loop(self, handoff: Handoff) -> None:
        self.handoff, self._slot_held = handoff, False
        S = len(self.sources)
        step_tokens = self.geometry.step_tokens
        while True:
            gathered = await self._agree(self._summary)
            summaries = decode_summaries(gathered, S)
            candidates, exhausted = summaries.candidates, summaries.exhausted
            has_data = np.bincount(candidates.source, minlength=S) > 0
            quota = None
            if self.comm.rank == 0:
                started = time.perf_counter()
                outcome = self.mixer.outcome(has_data, exhausted)
                assignment = None
                if outcome == "continue":
                    quota = self.mixer.quota(candidates, step_tokens, self.step)
                    assignment = self.planner.assign_quota(quota, self.step)
                self.step_metrics.plan_ms.append((time.perf_counter() - started) * 1e3)
                message = encode_plan(assignment, OUTCOMES.index(outcome))
            else:
                message = None
            size = plan_size(len(candidates))
            plan = decode_plan(await self._collective(lambda: self.comm.broadcast(message, size)))
            if OUTCOMES[plan.outcome] == "stop":   # a source with on_exhausted="stop" ran out
                return
            if OUTCOMES[plan.outcome] == "end_epoch":
                for s, b in enumerate(self.buffers):
                    if not self._endless(s):   # an endless stream has no end-of-epoch marker
                        await b.next_epoch()
                self.epoch += 1
                self.step_metrics.epoch = self.epoch
                self.mixer.new_epoch()
                if self.config.epochs is not None and self.epoch >= self.config.epochs:
                    return
                self._start_epoch_tracking()
                self.holding = self._epoch_holding()
                self._resize(self._budgets())
                continue
            if quota is None:   # every rank keeps the mixer's state (the schedule's position)
                quota = self.mixer.quota(candidates, step_tokens, self.step)
            self.mixer.update(quota, plan.take, plan.length)
            whole = plan.length == candidates.length[plan.take]   # a cut item's rest stays
            self.holding = MemoryPlan.holding_after(candidates, plan.take[whole], exhausted)
            self._resize(self._budgets())
            lengths = plan.length
            self._track(summaries, plan)
            self._autoscale()
            batch = await self._deliver(summaries, plan, lengths)
            batch.state_snapshot = self.snapshot()
            handoff.put(batch)
            self._slot_held = False
            self.step += 1

    def _epoch_holding(self) -> np.ndarray:
        """[R, S] at an epoch's start: the ranks whose layout has units of a source hold it
        (every rank, for an endless source)."""
        return np.array([[self._endless(s) or bool(t.layout.rank_units(q))
                          for s, t in enumerate(self.trackers)] for q in range(self.comm.world)],
                        dtype=bool).reshape(self.comm.world, len(self.sources))

    def _budgets(self):
        """This rank's buffers for the next step, from `holding` and the mix's shares (worked
        out again only when either changed: most steps, neither does)."""
        shares = self.mixer.shares_at(self.holding.any(axis=0))
        key = (self.holding.tobytes(), shares.tobytes())
        if key != self._budgets_key:
            self._budgets_key = key
            self._budgets_now = self.memory.for_rank(self.comm.rank, shares, self.holding)
        return self._budgets_now

    def _resize(self, budgets) -> None:
        if budgets is self.budgets:
            return
        self.budgets = budgets
        for buffer, gate, budget in zip(self.buffers, self.gates, budgets):
            buffer.resize(budget.capacity_tokens, budget.window_tokens)
            gate.set_limit(budget.inflight_bytes)

    async def _deliver(self, summaries, plan, lengths) -> Batch:
        me, R, M = self.comm.rank, self.comm.world, self.config.micro_batches
        c = summaries.candidates
        holder = c.rank[plan.take]
        mine: dict[int, np.ndarray] = {}
        for s, buffer in enumerate(self.buffers):
            entries = np.flatnonzero((holder == me) & (c.source[plan.take] == s))
            positions = c.position[plan.take[entries]]
            order = np.argsort(positions, kind="stable")
            short = lengths[entries] < c.length[plan.take[entries]]   # cut to fill a row
            cut = dict(zip(positions[short].tolist(), lengths[entries][short].tolist()))
            items = await buffer.take(positions[order], len(self._windows[s][0]), cut)
            mine.update(zip(entries[order].tolist(), (i.tokens for i in items)))
        entries, tokens = await self._collective(
            lambda: exchange_tokens(self.comm, holder, plan.rank, lengths, mine))
        sources = c.source[plan.take[entries]]
        item_ids = summaries.ids[plan.take[entries]]
        memory = self._row_memory.take()
        half = memory.shape[0] // 2
        rows = pack_rows(tokens, plan.row[entries], M, self.config.micro_batch_tokens,
                         out=(memory[:half], memory[half:]))
        micro_batches = []
        source_list, id_list = sources.tolist(), item_ids.tolist()
        for row in rows:
            ids = [self._sample_id(source_list[k], *id_list[k]) for k in row.item_indices.tolist()]
            seqlens = np.diff(row.cu_seqlens)
            micro_batches.append(MicroBatch(
                tokens=torch.from_numpy(row.tokens), cu_seqlens=torch.from_numpy(row.cu_seqlens),
                position_ids=torch.from_numpy(row.position_ids), sample_ids=ids,
                max_seqlen=int(seqlens.max()) if seqlens.size else 0))
        S = len(self.sources)
        samples = np.bincount(sources, minlength=S)
        delivered = np.bincount(sources, weights=lengths[entries], minlength=S)
        for metrics, n, t in zip(self.source_metrics, samples.tolist(), delivered.tolist()):
            metrics.delivered_samples += n
            metrics.delivered_tokens += int(t)
        rank_rows = plan.rank * M + plan.row
        rank_tokens = np.bincount(plan.rank, weights=lengths, minlength=R)
        rank_cost = self.cost.row_costs(lengths, rank_rows, R * M,
                                        extra_cost=c.extra_cost[plan.take]).reshape(R, M).sum(axis=1)
        self.step_metrics.record(rank_tokens, rank_cost)
        self.step_metrics.exchanged_tokens += int(lengths[holder != plan.rank].sum())
        ages = c.age[plan.take]
        deferral = int(ages.max()) if ages.size else 0
        self.step_metrics.deferral_max = max(self.step_metrics.deferral_max, deferral)
        self.step_metrics.deferral_sum += int(ages.sum())
        self.step_metrics.delivered += int(ages.size)
        return Batch(self.step, self.epoch, micro_batches, rank_tokens, rank_cost,
                     max_deferral=deferral)

    def _autoscale(self) -> None:
        now = time.perf_counter()
        blocked = np.array([b.blocked_s for b in self.buffers])
        if self.autoscaler is not None and self._scale_mark is not None:
            then, blocked_then = self._scale_mark
            fraction = (blocked - blocked_then) / max(now - then, 1e-9)
            self.autoscaler.observe(self.step, self.source_waits.copy(), fraction)
        self._scale_mark = (now, blocked)
        for metrics, wait in zip(self.source_metrics, self.source_waits):
            metrics.step_wait_s += float(wait)

    def _sample_id(self, source: int, shard: int, record: int, chunk: int) -> str:
        """"source/shard/record", ":k" for piece k of a split document, ":k+o" for what was
        left of it after its first o tokens went to an earlier step (`pieces`)."""
        shards = self.shards[source]
        shard %= len(shards)   # a repeated or restarted pass reads the same shard again
        prefix = self._id_prefixes.get((source, shard))
        if prefix is None:
            prefix = self._id_prefixes[(source, shard)] = \
                f"{self.sources[source].name}/{shards[shard].name}/"
        return f"{prefix}{record}{pieces.suffix(chunk)}"

    def stats(self) -> dict:
        sources = {}
        for s, source in enumerate(self.sources):
            counters = self.fetchers[s].store.counters if self.fetchers else None
            buffer = self.buffers[s] if self.buffers else None
            sources[source.name] = self.source_metrics[s].snapshot(counters, buffer)
            knobs = self.knobs[s]
            elapsed = time.perf_counter() - self.started if self.started is not None else 0.0
            sources[source.name].update(
                samples_per_s=self.source_metrics[s].delivered_samples / elapsed if elapsed > 0 else 0.0,
                tokens_per_s=self.source_metrics[s].delivered_tokens / elapsed if elapsed > 0 else 0.0,
                shard_concurrency=knobs.shards, range_readahead=knobs.readahead,
                autoscale_changes=[list(h) for h in knobs.history[-8:]],
                inflight_bytes=self.gates[s].used if self.gates else 0,
                inflight_bytes_peak=self.gates[s].peak if self.gates else 0,
                inflight_over_budget_peak_bytes=self.gates[s].excess_peak if self.gates else 0,
                inflight_budget_bytes=self.budgets[s].inflight_bytes,
                decoded_per_raw_byte=self.gates[s].expansion if self.gates else None,
                buffer_blocked_s=buffer.blocked_s if buffer is not None else 0.0)
        return {"rank": self.comm.rank, "world_size": self.comm.world,
                **self.step_metrics.snapshot(), "sources": sources}
