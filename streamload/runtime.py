"""The loader's asyncio side: lifecycle and the step loop.

`run` opens the stores, lists the shards (every rank must list the same), resumes, starts one
fetcher per source under one supervisor, and runs the step loop until the data ends, the run
is closed, or something fails; then it releases everything in order.

Each step, on every rank: wait until every source's head window is complete, and send the
windows to rank 0 (`Agreement.gather_step`; through one leader per node on more than one node),
which alone steps the job model (`JobModel.begin` / `assign` / `commit`) and sends each rank its
own part of the plan (`_gather_loop`, `_plan_replies`); each rank resizes the buffers the new
windows need and delivers (`Delivery`) a Batch to the bridge with what stands for the step's
state (rank 0's `StepSnapshot`; elsewhere the step, whose state `state_relay` gets from rank 0).
Under control_plane="all_gather" (`_step_loop`) every rank all-gathers every window
(`Agreement.agree`) and steps its own copy of the job model; rank 0 broadcasts the assignment.

Everything here is owned by the loop's thread. The Loader reaches it only through
`Background.call` (a hop to the loop) or after the loop has ended.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np

from .batch import Batch
from .collective.comm import Comm, GlooComm
from .collective.messages import (OUTCOMES, LocalPlan, PlanMessage, SourceWindow,
                                  decode_local_plan, decode_plan, decode_summaries,
                                  encode_local_plan, encode_plan, encode_summary, plan_size,
                                  step_totals)
from .collective.protocol import Agreement, StopStepping
from .collective.topology import Topology
from .config import LoaderConfig, Source
from .delivery import Delivery
from .errors import ConfigError, DistributedError
from .formats.catalog import Shard, catalog
from .metrics import SourceMetrics, StepMetrics, rank_stats
from .mixreport import MixTally, MixTracker, StepMix
from .pipeline.autoscale import Autoscaler, Knobs, MemoryGate
from .pipeline.buffer import SourceBuffer, UnreadBuffer
from .pipeline.fetch import SourceFetcher
from .pipeline.skips import SkipLedger
from .pipeline.supervisor import Supervisor
from .pipeline.transform import tokenizer_pool
from .pipeline.workers import DaemonExecutor, run_detached
from .plan.cost import CostModel
from .plan.memory import SourceBudget
from .plan.mix_spec import Mixture
from .peers import encode_end, encode_step
from .vision.cost import EncoderCost
from .vision.hybrid import encoder_model, window_costs
from .job import JobModel, RankShare, StepSnapshot, data_options, listing_crc
from .watch import RunWatch
from .stage_view import needs_view, stage_view
from .state import LoaderState, encode_state
from .state_relay import StateRelay
from .storage import ObjectStore, open_store, source_store_options
from .tokenizer import TextTokenizer

log = logging.getLogger("streamload")
WORKERS_FINISH_S = 30.0   # closing waits this long, at most, for tokenizer calls in flight


class Handoff(Protocol):
    """Where batches go: `reserve()` waits for room (the trainer took an earlier batch),
    `put()` hands one over, with its state snapshot, and never blocks."""

    async def reserve(self) -> None: ...
    def put(self, batch: Batch, snapshot: StepSnapshot) -> None: ...


@dataclass(frozen=True)
class RemoteState:
    """control_plane="gather", a rank other than 0: what stands for a batch's `StepSnapshot`:
    its step, whose state rank 0 has (`state_relay.StateRelay`)."""
    step: int


class Runtime:
    def __init__(self, sources: list[Source], config: LoaderConfig, tokenizer: Optional[TextTokenizer],
                 comm: Comm, storage_options: Optional[dict] = None,
                 mixture: Optional[Mixture] = None, sample_costs: Optional[dict] = None,
                 topology: Optional[Topology] = None, peers: Optional[GlooComm] = None):
        """`comm`: the loader's group over the DP ranks; `topology`: where this rank sits in a
        TP/CP/PP job (None: every rank is a DP rank), for `stage_view`; `peers`: with
        broadcast delivery, the group of this DP rank's ranks, which this one feeds (`peers`)."""
        self.sources, self.config, self.tokenizer, self.comm = sources, config, tokenizer, comm
        self.topology, self.peers = topology, peers
        self.sample_costs = dict(sample_costs or {})   # source name -> SampleCostHook
        # Image sources under image_cost="hybrid": each item's encoder cost from its patches
        # per image, added to its extra cost (vision/hybrid.py); None: lengths only.
        encoder = encoder_model(config)
        self._encoders = [encoder if s.images is not None else None for s in sources]
        unknown = sorted(set(self.sample_costs) - {s.name for s in sources})
        if unknown:
            raise ConfigError(f"sample_costs: no source named {unknown}; sources are "
                              f"{[s.name for s in sources]}", key="sample_costs")
        self.storage_options = storage_options or {}
        # Steps packed and alive at once: queued or being packed (prefetch_steps) and the one
        # the trainer holds (`Loader.__next__`), and room for one more a trainer keeps a while
        # (the row memory the recycler keeps; states in flight).
        batches_held = config.prefetch_steps + 2
        # control_plane="gather" (the default, "auto"): rank 0 alone keeps and steps the job
        # model (`_plan_replies`); the other ranks keep their share of it (`RankShare`: the
        # geometry, their start-up buffers, their fetchers' layouts) and get the state from
        # rank 0
        self.gathering = config.control_plane != "all_gather"
        data = functools.partial(data_options, config, sources, tokenizer)
        self.job: "JobModel | RankShare" = \
            JobModel.build(config, sources, mixture, comm.world, batches_held, data) \
            if not self.gathering or comm.rank == 0 else \
            RankShare.build(config, sources, mixture, comm.world, comm.rank, data)
        self.stepper = self.job.stepper   # the geometry, cost, mixer and memory plan
        self.agreement = Agreement(comm, config.collective_timeout_s)
        self.source_metrics = [SourceMetrics() for _ in sources]
        self.step_metrics = StepMetrics(step_tokens=self.stepper.geometry.step_tokens,
                                        mix=MixTally([s.name for s in sources]))
        self.mix_tracker = MixTracker(len(sources))   # each step's target, tail, run-outs
        self.delivery = Delivery(comm, self.stepper.geometry, self.stepper.cost,
                                 [s.name for s in sources], self.source_metrics, self.step_metrics,
                                 batches_held, pad_to=config.pad_to,
                                 pad_token_id=config.pad_token_id,
                                 # the encoder's part of a step's cost: the extra cost of the
                                 # sources the planner gave an encoder cost
                                 encoder_sources=np.array([e is not None for e in self._encoders],
                                                          bool),
                                 # an image that fails to decode at delivery, under the
                                 # source's skip limit (`Delivery._skip_undecodable`)
                                 on_error=config.on_error,
                                 skip_ledgers=[SkipLedger(s.name, s.uri, config.max_skip_fraction,
                                                          m) if s.images is not None else None
                                               for s, m in zip(sources, self.source_metrics)])
        # Each source's concurrency knobs, capped by what its start-up memory allows.
        self.budgets = self.stepper.memory.initial(self.stepper.mixer.max_shares())
        self.knobs = [Knobs(min(config.shard_prefetch, max_shards), min(config.range_readahead, max_ranges),
                            max_shards, max_ranges)
                      for b in self.budgets
                      for ranges in [max(1, b.inflight_bytes // config.chunk_bytes)]
                      for max_shards, max_ranges in [(min(config.max_shard_prefetch, ranges),
                                                      min(config.max_range_readahead, ranges))]]
        self.autoscaler = Autoscaler(self.knobs) if config.autoscale else None
        self.stores: list[ObjectStore] = []
        self.shards: list[list[Shard]] = []
        self.buffers: list[SourceBuffer] = []
        self.gates: list[MemoryGate] = []
        self.fetchers: list[Optional[SourceFetcher]] = []   # None: a source this rank does not read
        self.source_waits = np.zeros(len(sources))   # this step's wait for each head window
        self.started: Optional[float] = None          # when run() began (for rates)
        self._scale_mark: Optional[tuple] = None      # (time, buffers' blocked_s) at last step
        self._slot_held = False                       # room reserved for this step's batch
        self._handoff: Optional[Handoff] = None
        self.watch = RunWatch(sources, self.job, comm)   # the logger
        self._window_sizes: list[int] = [0] * len(sources)   # this rank's last summary's
        self._sent_budgets: list = []        # rank 0, gather: the budgets each rank was sent
        self._snapshot: Optional[StepSnapshot] = None   # rank 0, gather: after the last step
        # rank 0, gather: the last step's totals with every rank's figures (a reply carries
        # only its rank's: `encode_local_plan`)
        self._totals = None
        # rank 0, gather: its own part of the step it just planned, not encoded (`_plan_replies`)
        self._own: Optional[LocalPlan] = None
        # gather, more than one rank: the states of recent steps, from rank 0 to the others.
        # With broadcast delivery every DP rank's leader sends its ranks each step's state with
        # the step (`peers`), so rank 0 sends every step's state with that step's reply.
        self.relay = StateRelay(
            comm.rank, comm.world, batches_held + 2,
            lambda snapshot: encode_state(self.job.state(snapshot)),
            1 if peers is not None else config.state_every) \
            if self.gathering and comm.world > 1 else None

    # -- called from the Loader before the loop starts, or on the loop ----------------------------
    def load_state(self, state: LoaderState) -> None:
        self.job.load(state)

    def request_close(self) -> None:
        """Called on the loop. The step loop stops at its next all-gather, telling the other
        ranks, so no rank is left inside a collective."""
        self.agreement.request_close()

    def state(self, snapshot) -> "LoaderState | bytes | concurrent.futures.Future[bytes]":
        """The state as of `snapshot` (None: where this loader starts). Under gather, its
        encoded bytes: rank 0's (which it then sends every rank), or on another rank what rank
        0 sent, or a future of it, which this rank's next round asks for (`StateRelay`)."""
        if isinstance(snapshot, RemoteState):   # control_plane="gather", a rank other than 0
            return self.relay.get(snapshot.step)
        if self.relay is not None and snapshot is not None:   # gather, rank 0
            return self.relay.own(snapshot.step - 1)   # snapshot.step: steps taken
        return self.job.state(snapshot)

    def stats(self) -> dict:
        return rank_stats(self)

    def control_plane(self) -> dict:
        """How this rank agrees on steps (`stats()["control_plane"]`): the path ("all_gather",
        "gather", "node_gather" through one leader per node, "local" for one rank), the
        layout of the nodes, and the bytes this rank's control collectives sent and received
        (the exchange of samples not included), and the state requests it made."""
        out = {**self.comm.layout(), **self.comm.traffic.snapshot()}
        if not self.gathering and self.comm.world > 1:
            out["path"] = "all_gather"
        if self.relay is not None:
            out.update(state_requests=self.relay.requests,
                       states_received=self.relay.states_received)
        return out

    # -- lifecycle ---------------------------------------------------------------------------------
    async def run(self, handoff: Handoff) -> None:
        self.started = time.perf_counter()
        self._handoff = handoff
        executor = DaemonExecutor(self.config.transform_workers, "streamload-transform")
        processes = tokenizer_pool(self.config, self.tokenizer)
        supervisor = Supervisor(on_failure=lambda exc: [b.fail(exc) for b in self.buffers])
        self.stores = self._open_stores()
        failure: Optional[BaseException] = None
        try:
            await self._list_shards()
            self.job.start()
            self.watch.started(self.shards)
            self.budgets = self.job.budgets(self.comm.rank)
            # A source this rank does not read (`plan/readers.py`): no fetcher, and a buffer
            # that is always empty and at its epoch's end; its items come by the exchange.
            reads = [self.job.reads_source(self.comm.rank, s) for s in range(len(self.sources))]
            # An image source's encoder cost per item, from its images' grids: worked out
            # once, as its block enters the buffer (the window's `cost` column).
            self.buffers = [SourceBuffer(b.capacity_tokens, b.window_tokens,
                                         None if encoder is None else
                                         functools.partial(_encoder_costs, encoder))
                            if read else UnreadBuffer()
                            for b, read, encoder in zip(self.budgets, reads, self._encoders)]
            self.gates = [MemoryGate(b.inflight_bytes) for b in self.budgets]
            for s, source in enumerate(self.sources):
                if not reads[s]:
                    self.fetchers.append(None)
                    continue
                fetcher = SourceFetcher(
                    source_index=s, source=source, shards=self.shards[s], store=self.stores[s],
                    buffer=self.buffers[s], metrics=self.source_metrics[s], config=self.config,
                    rank=self.comm.rank, world=self.comm.world, tokenizer=self.tokenizer,
                    executor=executor, supervisor=supervisor, tokenizer_processes=processes,
                    layout_for=functools.partial(self.job.layout_for, s),
                    knobs=self.knobs[s], gate=self.gates[s],
                    resume_ages=self.job.resume_ages[s] if self.job.resumed() else None)
                self.fetchers.append(fetcher)
                supervisor.spawn(fetcher.run(self.job.epoch), name=f"fetch {source.name}")
            await self._step_loop()
        except StopStepping:
            pass
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if self.relay is not None:
                self.relay.end(failure)
            if self.peers is not None:   # the ranks this one feeds: the run ended, or failed
                await self.agreement.run_threaded(functools.partial(
                    self.peers.broadcast_bytes, encode_end(failure), self.peers.leader))
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
            self.agreement.shutdown()

    def _open_stores(self) -> list[ObjectStore]:
        """One store per distinct (scheme, options), shared by the sources that use it."""
        cache: dict[tuple, ObjectStore] = {}
        out = []
        for s in self.sources:
            options = source_store_options(s.uri, self.storage_options, s.storage_options)
            scheme = s.uri.split("://", 1)[0] if "://" in s.uri else "file"
            key = (scheme, tuple(sorted((k, repr(v)) for k, v in options.items())))
            if key not in cache:
                cache[key] = open_store(s.uri, options, retry=self.config.retry,
                                        max_concurrency=self.config.max_concurrency)
            out.append(cache[key])
        return out

    async def _list_shards(self) -> None:
        """List every source; every rank must have listed the same shards."""
        async def listing() -> np.ndarray:
            catalogs = await asyncio.gather(
                *(catalog(s, store) for s, store in zip(self.sources, self.stores)))
            self.shards = [c.shards for c in catalogs]
            for c in catalogs:   # objects of no known format: said once, at start (rank 0)
                if c.left_out and self.comm.rank == 0:
                    log.warning("%s", c.warning())
            return np.array([0] + [listing_crc([sh.name for sh in shards])
                                   for shards in self.shards], dtype=np.int64)

        gathered = await self.agreement.agree(listing)
        for s, source in enumerate(self.sources):
            if len({int(g[1 + s]) for g in gathered}) > 1:
                raise DistributedError(f"source {source.name!r}: ranks listed different shards "
                                       f"for {source.uri}; is the bucket changing under the job?")
        names = [[sh.name for sh in shards] for shards in self.shards]
        self.job.listed(names)
        self.delivery.listed(names)
        for metrics, shards in zip(self.source_metrics, self.shards):
            metrics.shards_listed = len(shards)

    # -- the step loop -----------------------------------------------------------------------------
    async def _summary(self) -> np.ndarray:
        """This rank's head windows, once every one is complete."""
        if not self._slot_held:   # room for this step's batch first: then the step can't stall
            await self._handoff.reserve()
            self._slot_held = True
        await asyncio.gather(*(self._wait_ready(s) for s in range(len(self.buffers))))
        windows = []
        for s, buffer in enumerate(self.buffers):
            # columns: lengths, ages, ids (shard, record, chunk), cost (an image source's
            # encoder cost per item, fixed as it came in)
            window = buffer.window()
            self._window_sizes[s] = int(window.lengths.shape[0])
            hook = self.sample_costs.get(self.sources[s].name)
            extra = window.cost
            if hook is not None:   # the hook's cost of each item's length (pieces change it)
                extra = CostModel.extra_cost(hook, window.lengths) + \
                    (0.0 if extra is None else extra)
            visual = None   # an image source's images and patches per item: the caps per row
            if self.sources[s].images is not None:
                visual = window.visual if window.visual is not None else \
                    np.zeros((2, window.lengths.shape[0]), np.int64)
            windows.append(SourceWindow(window.lengths, window.ages, window.ids, window.done,
                                        extra, visual))
        return encode_summary(windows)

    async def _wait_ready(self, s: int) -> None:
        started = time.perf_counter()
        await self.buffers[s].wait_ready()
        self.source_waits[s] = time.perf_counter() - started

    async def _step_loop(self) -> None:
        if self.gathering:
            return await self._gather_loop()
        job, agreement = self.job, self.agreement
        S = len(self.sources)
        while True:
            summaries = decode_summaries(await agreement.agree(self._summary), S)
            c = summaries.candidates
            step = job.begin(c, summaries.exhausted)
            message = None
            if self.comm.rank == 0:
                assignment = None
                if step.outcome == "continue":
                    started = time.perf_counter()
                    assignment = job.assign(step)
                    self.step_metrics.plan_ms.append((time.perf_counter() - started) * 1e3)
                message = encode_plan(assignment, OUTCOMES.index(step.outcome))
            size = plan_size(len(c))
            plan = decode_plan(await agreement.run(lambda: self.comm.broadcast(message, size)))
            outcome = OUTCOMES[plan.outcome]
            if outcome == "stop":   # a source with on_exhausted="stop" ran out
                self.watch.stopped(c)
                return
            if outcome == "end_epoch":
                self.delivery.end_epoch()   # the skip limit of what failed at delivery
                for s, buffer in enumerate(self.buffers):
                    if not job.endless(s):   # an endless stream has no end marker
                        buffer.next_epoch()
                finished = job.end_epoch()
                self.step_metrics.epoch = job.epoch
                if finished:
                    return
                self.watch.new_epoch()
                self._resize()
                continue
            window_sizes = [int(n) for n in np.bincount(
                c.source[c.rank == self.comm.rank], minlength=S)]
            self.mix_tracker.begin(job.stepper, step)
            units = job.commit(step, plan.take, plan.length, summaries.ids)
            mix = self.mix_tracker.commit(job.stepper)
            self.watch.step(step.index, float(plan.length.sum()))
            self._resize()
            self._autoscale(step.index)
            batch = await self.delivery.deliver(step.index, job.epoch, summaries, plan,
                                                self.buffers, window_sizes, agreement.run, mix)
            self.step_metrics.record_mix(job.epoch, step.index, batch.source_tokens, units,
                                         mix)
            batch.skipped = np.array([[m.skipped_records, m.skipped_shards]
                                      for m in self.source_metrics], dtype=np.int64)
            snapshot = job.snapshot()
            if self.peers is not None:   # broadcast delivery: the whole step to this DP rank's ranks
                message = encode_step(batch, encode_state(job.state(snapshot)))
                await agreement.run_threaded(functools.partial(self.peers.broadcast_bytes,
                                                               message, self.peers.leader))
            if needs_view(self.topology):   # this rank's CP part, its pipeline stage's fields
                batch = stage_view(batch, self.topology, self.config.pad_token_id)
            self._handoff.put(batch, snapshot)
            self._slot_held = False

    # -- control_plane="gather" ----------------------------------------------------------------
    async def _gather_loop(self) -> None:
        """The step loop when the windows go to rank 0 only: each rank receives its own part of
        the plan (`LocalPlan`) and delivers it as in the all-gather loop."""
        agreement, S = self.agreement, len(self.sources)
        R, M = self.comm.world, self.stepper.geometry.micro_batches
        if self.comm.rank == 0:
            self._sent_budgets = [self.job.budgets(r) for r in range(R)]
        plan_replies = self._plan_replies if self.comm.rank == 0 else None
        while True:
            mine = await agreement.gather_step(self._summary, plan_replies, self.relay)
            # Rank 0's own part of a step it planned stays here, as the whole plan (the
            # all-gather loop's); its reply carries the header only (`_plan_replies`)
            local, self._own = self._own or decode_local_plan(mine, S, R, M), None
            totals = local.totals if self.comm.rank else self._totals   # rank 0: every rank's
            if local.budgets is not None:
                self._set_budgets(local.budgets)
            outcome = OUTCOMES[local.outcome]
            if outcome == "stop":
                return
            if outcome == "end_epoch":
                self.delivery.end_epoch()
                for s, buffer in enumerate(self.buffers):
                    if self.sources[s].on_exhausted != "restart":   # endless: no end marker
                        buffer.next_epoch()
                self.step_metrics.epoch = local.epoch
                if local.finished:
                    return
                continue
            self._autoscale(local.step)
            target, tail, ran_out = local.mix
            mix = StepMix(target, tail, ran_out)
            batch = await self.delivery.deliver(local.step, local.epoch, local.summaries,
                                                local.plan, self.buffers, self._window_sizes,
                                                agreement.run, mix, totals)
            self.step_metrics.record_mix(local.epoch, local.step, batch.source_tokens,
                                         local.units, mix)
            batch.skipped = np.array([[m.skipped_records, m.skipped_shards]
                                      for m in self.source_metrics], dtype=np.int64)
            snapshot = self._snapshot if self.comm.rank == 0 else RemoteState(local.step)
            if self.peers is not None:   # broadcast delivery: the step to this DP rank's ranks
                await agreement.run_threaded(functools.partial(
                    self.peers.broadcast_bytes, encode_step(batch, self._step_state(local.step)),
                    self.peers.leader))
            if needs_view(self.topology):   # this rank's CP part, its pipeline stage's fields
                batch = stage_view(batch, self.topology, self.config.pad_token_id)
            self._handoff.put(batch, snapshot)
            self._slot_held = False

    def _step_state(self, step: int) -> bytes:
        """Gather with broadcast delivery: the state after batch `step`, for this DP rank's
        other ranks. Rank 0 encodes it (once: its trainer's `state_dict()` takes the same
        bytes); another rank received it with the step's reply (the relay sends every step's)."""
        if self.relay is None:   # one DP rank
            return encode_state(self.job.state(self._snapshot))
        state = self.relay.encoded(step) if self.comm.rank == 0 else self.relay.get(step)
        if not isinstance(state, bytes):   # the relay sends it with the reply: a bug if not
            raise DistributedError(f"rank {self.comm.rank}: rank 0's reply for step {step} did "
                                   f"not carry the step's state")
        return state

    def _plan_replies(self, gathered: list[np.ndarray]) -> list[np.ndarray]:
        """Rank 0: step the job model on every rank's windows and give each rank its reply:
        what it takes from its buffers and sends, what it receives, the job's totals, and its
        buffers for the next step when they changed (the states go on the side: `relay`)."""
        job, S, R = self.job, len(self.sources), self.comm.world
        summaries = decode_summaries(gathered, S)
        c = summaries.candidates
        step = job.begin(c, summaries.exhausted)
        if step.outcome == "stop":   # a source with on_exhausted="stop" ran out
            self.watch.stopped(c)
            if self.relay is not None:
                self.relay.finish()
            return [encode_local_plan(OUTCOMES.index("stop"), job.epoch, step.index)] * R
        if step.outcome == "end_epoch":
            finished = job.end_epoch()
            if not finished:
                self.watch.new_epoch()
            elif self.relay is not None:
                self.relay.finish()
            return [encode_local_plan(OUTCOMES.index("end_epoch"), job.epoch, step.index,
                                      finished=finished, budgets=self._budgets_for(r))
                    for r in range(R)]
        started = time.perf_counter()
        a = job.assign(step)
        self.step_metrics.plan_ms.append((time.perf_counter() - started) * 1e3)
        plan = PlanMessage(0, a.take.astype(np.int64), a.rank.astype(np.int64),
                           a.row.astype(np.int64), a.length.astype(np.int64))
        self.mix_tracker.begin(job.stepper, step)
        units = job.commit(step, plan.take, plan.length, summaries.ids)
        mix = self.mix_tracker.commit(job.stepper)
        self.watch.step(step.index, float(plan.length.sum()))
        totals = self._totals = step_totals(c, plan, self.stepper.cost, self.stepper.geometry,
                                            self.delivery.encoder_sources)
        self._snapshot = job.snapshot()
        if self.relay is not None:
            self.relay.kept(step.index, self._snapshot)
        self._own = LocalPlan(0, False, job.epoch, step.index, summaries, plan, totals, units,
                              (mix.target, mix.tail, mix.ran_out), self._budgets_for(0))
        holder = c.rank[plan.take] if R > 1 else None
        return [encode_local_plan(0, job.epoch, step.index)] + \
            [encode_local_plan(0, job.epoch, step.index, c=c, ids=summaries.ids, plan=plan,
                               entries=np.flatnonzero((holder == r) | (plan.rank == r)),
                               totals=totals, rank=r, units=units, mix=mix,
                               budgets=self._budgets_for(r))
             for r in range(1, R)]

    def _budgets_for(self, rank: int) -> Optional[np.ndarray]:
        """Rank 0: `rank`'s buffers for the next step, if they changed since it was told."""
        budgets = self.job.budgets(rank)
        if budgets is self._sent_budgets[rank]:
            return None
        self._sent_budgets[rank] = budgets
        return np.array([[b.capacity_tokens, b.window_tokens, b.inflight_bytes]
                         for b in budgets], dtype=np.int64).reshape(-1, 3)

    def _set_budgets(self, rows: np.ndarray) -> None:
        self.budgets = [SourceBudget(int(c), int(w), int(i)) for c, w, i in rows.tolist()]
        for buffer, gate, budget in zip(self.buffers, self.gates, self.budgets):
            buffer.resize(budget.capacity_tokens, budget.window_tokens)
            gate.set_limit(budget.inflight_bytes)

    def _resize(self) -> None:
        """The buffers and gates the next step's windows need (when they changed)."""
        budgets = self.job.budgets(self.comm.rank)
        if budgets is self.budgets:
            return
        self.budgets = budgets
        for buffer, gate, budget in zip(self.buffers, self.gates, budgets):
            buffer.resize(budget.capacity_tokens, budget.window_tokens)
            gate.set_limit(budget.inflight_bytes)

    def _autoscale(self, step: int) -> None:
        now = time.perf_counter()
        blocked = np.array([b.blocked_s for b in self.buffers])
        if self.autoscaler is not None and self._scale_mark is not None:
            then, blocked_then = self._scale_mark
            fraction = (blocked - blocked_then) / max(now - then, 1e-9)
            self.autoscaler.observe(step, self.source_waits.copy(), fraction)
        self._scale_mark = (now, blocked)
        for metrics, wait in zip(self.source_metrics, self.source_waits):
            metrics.step_wait_s += float(wait)


def _encoder_costs(encoder: EncoderCost, block) -> np.ndarray:
    """A buffer block's items' encoder costs (`SourceBuffer`'s `item_cost`)."""
    return window_costs(block.images or [()] * len(block), encoder)
