"""Loader: the public, synchronous face of streamload.

One background thread runs an asyncio loop that does all I/O and collectives (`Runtime`).
The trainer iterates a plain iterator over a thread-safe queue. The queue is bounded by an
asyncio semaphore that the consumer releases, so the loop never blocks a thread to wait.

Ownership: the Runtime and everything under it belong to the loop's thread. The trainer's thread
gets batches and immutable step snapshots through the queue, and reaches the Runtime only
through `_Background.call`, which runs a function on the loop (or directly, once the loop has
ended) and waits for its answer: `state_dict()` and `stats()` read a consistent Runtime however
far ahead the loop runs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import signal
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

import msgspec
import numpy as np

from .batch import Batch
from .metrics import job_totals
from .mixreport import format_mix
from .observe import step_record
from .configfile import load_config
from .plan.cost import CostModel
from .plan.mix_spec import Mixture
from .config import LoaderConfig, Source, check_fields, make_config
from .collective.comm import Comm, connect, connect_broadcast
from .collective.launch import check_launch
from .collective.topology import Parallel, Topology, topology_for
from .errors import ConfigError, DistributedError, UsageError
from .peers import Follower
from .job import StepSnapshot, check_resume, data_options
from .runtime import Runtime
from .pipeline.image_batches import ImageBatches, shared_geometry
from .state import decode_state, encode_state
from .tokenizer import as_tokenizer


log = logging.getLogger("streamload")
T = TypeVar("T")


_STOP = object()   # to the waker thread: the loop has ended


class _End:
    """Sentinel: the background side finished (normally, or with `error`)."""

    def __init__(self, error: Optional[BaseException] = None):
        self.error = error


def _block_signals() -> None:
    """Ctrl-C must reach the trainer's thread. Linux delivers a process signal to any thread
    that does not block it, and threads started from the loop's (transform workers, the
    collective thread) inherit its mask."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


class _Background:
    """The thread, its loop and the hand-off queue. Holds no reference to the Loader, so a
    dropped Loader is garbage collected and its finalizer stops this."""

    def __init__(self, runtime: Runtime, prefetch_steps: int):
        self.runtime = runtime
        # SimpleQueue: a put costs the step loop far less than Queue's condition variables, and
        # its get() is interrupted by Ctrl-C (tests/test_interrupt.py).
        self.queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._serving = True   # the loop still runs callbacks (`call`); under `_serving_lock`
        self._serving_lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.slots = None
        self.prefetch_steps = prefetch_steps
        self.task: Optional[asyncio.Task] = None
        # Per slot the trainer freed, the batch it had before (to drop), for the waker; _STOP
        # ends the waker. See `get`.
        self._freed: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="streamload-loop", daemon=True)
        self._waker = threading.Thread(target=self._wake, name="streamload-waker", daemon=True)
        self.thread.start()
        self._waker.start()

    def _serve(self) -> None:
        _block_signals()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
            with self._serving_lock:   # from now on `call` runs its function itself
                self._serving = False
            # Runs the calls scheduled before that, too (they sit in the loop's ready queue).
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
            self._freed.put(_STOP)   # the waker has nothing more to wake

    def _wake(self) -> None:
        """Off the trainer's thread: drop the batches the trainer is done with and hand the
        slots it freed to the loop."""
        _block_signals()
        while True:
            done = self._freed.get()
            if done is _STOP:
                return
            del done   # the batch's last reference, usually: its tensors are freed here
            try:
                self.loop.call_soon_threadsafe(self.slots.release)
            except RuntimeError:   # the loop closed meanwhile
                return

    async def _main(self) -> None:
        self.slots = asyncio.Semaphore(self.prefetch_steps)
        self.task = asyncio.current_task()
        try:
            await self.runtime.run(self)
            self.queue.put(_End())
        except asyncio.CancelledError:
            self.queue.put(_End())
        except BaseException as exc:  # handed to the trainer's thread with its traceback
            self.queue.put(_End(exc))

    async def reserve(self) -> None:
        """Wait for room for one more batch (the trainer frees it in `get`)."""
        await self.slots.acquire()

    def put(self, batch: Batch, snapshot: StepSnapshot) -> None:
        self.queue.put((batch, snapshot))

    def get(self):
        """(batch, snapshot), or an `_End`. Every batch got is handed back by `done` (which
        frees its slot), once the trainer lets go of it."""
        return self.queue.get()

    def done(self, batch: Optional[Batch]) -> None:
        """The trainer is done with `batch` (None: the first batch had nothing before it):
        the waker drops it, which frees its tensors (a step's 20-odd: tens of µs the trainer's
        thread would pay otherwise) and, once nothing else refers to it, its row memory for
        the step loop (`ArrayRecycler`), and hands its slot back to the loop.

        The trainer's thread does not wake the loop itself: `call_soon_threadsafe` writes to the
        loop's self-pipe, a system call that releases the GIL, and the woken loop thread, about
        to plan a step, often took the GIL there and kept it until the switch interval (5 ms)
        ran out: next() took that long one call in ten with the hand-off queue full. Putting on
        a SimpleQueue releases neither the GIL nor the CPU; the waker thread makes the call
        once the trainer lets go of the GIL (it waits, or runs torch)."""
        self._freed.put(batch)

    def call(self, fn: Callable[[], T]) -> T:
        """fn() on the loop's thread, between its steps, and its answer; fn() here once the loop
        has ended (nothing else runs then)."""
        future: "concurrent.futures.Future[T]" = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:   # re-raised on the caller's thread
                    future.set_exception(exc)

        with self._serving_lock:
            serving = self._serving
            if serving:
                self.loop.call_soon_threadsafe(run)
        if not serving:
            return fn()
        return future.result()

    def stop(self, timeout: float) -> None:
        """Ask the step loop to stop at its next all-gather (so peers are told, and no rank is
        left inside a collective); cancel everything if that takes longer than `timeout`."""
        for action, wait in ((self.runtime.request_close, timeout), (self._cancel, 5.0)):
            if not self.thread.is_alive():
                return
            try:
                self.loop.call_soon_threadsafe(action)
            except RuntimeError:   # the loop already closed
                return
            self.thread.join(wait)

    def _cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


class Loader:
    """Stream samples from many sources and yield cost-balanced, packed batches.

    >>> with Loader([Source("s3://bucket/web/", weight=0.7)], micro_batch_tokens=4096) as loader:
    ...     for batch in loader: ...

    In a job with tensor, context or pipeline parallelism, pass `parallel=Parallel(tp=.., cp=..,
    pp=..)` (the default group laid out as Megatron does) or `mesh=device_mesh` (dimension names
    from "pp", "dp", "dp_replicate", "dp_shard", "cp", "tp"). Only DP ranks get distinct data;
    `rank` and `world_size` are then the DP rank and degree, and each rank receives its view of
    its DP rank's step (`stage_view`). With context parallelism a row holds cp x
    micro_batch_tokens tokens, shared by the CP group: each CP rank receives its part, of at
    most micro_batch_tokens tokens plus padding.
    """

    def __init__(self, sources: Iterable[Source], micro_batch_tokens: int = 4096,
                 micro_batches: int = 2, tokenizer: Any = None, seed: int = 0,
                 epochs: Optional[int] = None, *, storage_options: Optional[dict] = None,
                 mixture: Optional[Mixture] = None, sample_costs: Optional[dict] = None,
                 parallel: Optional[Parallel] = None, mesh: Any = None,
                 on_step: Optional[Callable[[dict], Any]] = None, **options):
        self.sources = [s if isinstance(s, Source) else Source(s) for s in sources]
        if not self.sources:   # (unique names: `Mixture.check`, when the Runtime is built)
            raise ConfigError.at("sources", "at least one Source is required")
        tokenizer = as_tokenizer(tokenizer)   # a callable, a Hugging Face tokenizer, ...
        self.config: LoaderConfig = make_config(
            micro_batch_tokens=micro_batch_tokens, micro_batches=micro_batches, seed=seed,
            epochs=epochs, **options)
        check_launch()   # under torchrun, the process group must exist before the loader
        self.topology: Optional[Topology] = topology_for(parallel, mesh)
        timeout, peers = self.config.collective_timeout_s, None
        # gather (not all_gather) on more than one node: through one leader per node
        by_node = self.config.control_plane != "all_gather"
        if self.topology is not None and self.topology.broadcast:
            comm, peers = connect_broadcast(timeout, self.topology, by_node)
        else:
            comm = connect(timeout, self.topology, by_node=by_node)
        self.comm: Optional[Comm] = comm   # None: this rank builds no batch (a `Follower`)
        # stats(scope="job") gathers over every rank of the job on a group of its own, so it
        # never interleaves with the step loop's collectives. Made on its first call (creating
        # a group is collective, as that call is): a job that never asks holds no extra group.
        self._job_comm: Optional[Comm] = None
        row_config = self.config
        if self.topology is not None and self.topology.cp > 1:   # the CP group shares a row
            row_config = msgspec.structs.replace(
                self.config, micro_batch_tokens=self.topology.cp * self.config.micro_batch_tokens)
        if self.config.pipeline_stages is None and self.topology is not None and \
                self.topology.pp > 1:   # the 1F1B cost model takes P from the topology
            row_config = msgspec.structs.replace(row_config, pipeline_stages=self.topology.pp)
        if isinstance(mixture, dict):   # checked as Mixture(**mixture) is, nested keys too
            check_fields(mixture, Mixture, "mixture")
            mixture = Mixture(**mixture)
        elif mixture is not None and not isinstance(mixture, Mixture):
            raise ConfigError.at("mixture", f"must be a Mixture or a dict of its fields, got "
                                            f"{type(mixture).__name__}")
        # sample_costs: {source name: fn(lengths) -> extra cost per sample}, e.g. a vision
        # encoder's cost per image, in the units of cost_a / cost_b.
        # What decides the data, checked against a saved state on every rank (`check_resume`),
        # followers too: a Hugging Face tokenizer's digest is worked out then, if ever.
        self._data_options = functools.partial(data_options, row_config, self.sources, tokenizer)
        if comm is None:
            self._runtime = Follower(peers, self.topology, self.config.pad_token_id)
        else:
            self._runtime = Runtime(self.sources, row_config, tokenizer, comm, storage_options,
                                    mixture, sample_costs, self.topology, peers)
        self._use_images(row_config)
        self._runtime_step_tokens = row_config.micro_batches * row_config.micro_batch_tokens * \
            self.world_size
        self._source_names = [src.name for src in self.sources]
        if comm is not None and self.rank == 0:
            log.info("planner %s, %s; %d pipeline stage(s) (1F1B)", row_config.planner,
                     CostModel(row_config.cost_a, row_config.cost_b,
                               row_config.document_masking).describe(),
                     row_config.pipeline_stages or 1)
        self._background: Optional[_Background] = None
        self._finished = False
        self._closed = False   # close() was called: next() is a mistake, not an end
        self._finalizer = None
        self._last_snapshot: Optional[StepSnapshot] = None   # of the last batch returned
        # The last batch returned: held so that the trainer dropping it frees nothing on its
        # thread; the next next() hands it to the waker (`_Background.done`).
        self._last_batch: Optional[Batch] = None
        self._stall_s = 0.0   # time the trainer waited in next()
        self._steps_taken = 0
        # on_step(record): each step's metrics as a flat dict of numbers (`observe.step_record`),
        # called on the trainer's thread as next() returns the step (W&B, Prometheus, MLflow,
        # `observe.MetricsLog`, `observe.TensorBoardWriter`).
        self._on_step = on_step

    @classmethod
    def from_config(cls, path, *, tokenizer: Any = None, **overrides) -> "Loader":
        """Build a Loader from a TOML file (sources, weights, schedules, geometry, cost model).
        Keyword arguments override the file's loader options."""
        spec = load_config(path)
        return cls(spec.sources, tokenizer=tokenizer if tokenizer is not None else spec.load_tokenizer(),
                   mixture=spec.mixture, storage_options=spec.storage_options,
                   **{**spec.options, **overrides})

    @property
    def rank(self) -> int:
        """This rank's DP rank (its rank, without a parallel topology)."""
        return self.topology.dp_rank if self.topology is not None else self.comm.rank

    @property
    def world_size(self) -> int:
        """The DP degree (the world size, without a parallel topology)."""
        return self.topology.dp if self.topology is not None else self.comm.world

    def __iter__(self) -> Iterator[Batch]:
        if self._background is None and not self._finished:
            self._background = _Background(self._runtime, self.config.prefetch_steps)
            self._finalizer = weakref.finalize(self, self._background.stop,
                                               self.config.collective_timeout_s)
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise UsageError("next() on a closed Loader: it was closed (close() or the end of "
                             "its `with` block) and delivers nothing more; build a new Loader, "
                             "from state_dict() to resume")
        if self._finished:
            raise StopIteration
        if self._background is None:
            iter(self)
        started = time.perf_counter()
        # The batch returned last is the one the trainer is done with. `for batch in loader`
        # still holds it until this returns, so it is handed to the waker as the last thing
        # here: the waker runs once this thread lets go of the GIL, after the loop's variable
        # has moved on, so the waker's reference is the last one and the batch is freed there
        # (if the trainer still holds it, it lives on and the recycler leaves its memory alone).
        # A step's row memory is free for the step loop again one call after its batch was
        # returned: the loop runs `prefetch_steps` ahead, so prefetch_steps + 1 steps of row
        # memory are in use (`Runtime`'s `batches_held`).
        done, self._last_batch = self._last_batch, None
        try:
            item = self._background.get()
        except BaseException:   # interrupted (Ctrl-C): still the one to hand back
            self._last_batch = done
            raise
        self._stall_s += time.perf_counter() - started
        if isinstance(item, _End):
            self._finished = True
            self._finalizer()
            if item.error is not None:
                raise item.error
            raise StopIteration
        try:
            batch, self._last_snapshot = item
            self._last_batch = batch
            self._steps_taken += 1
            if self._on_step is not None:
                self._on_step(step_record(batch, self._runtime_step_tokens, self._source_names))
        finally:   # every batch got frees one slot, even if on_step raised
            self._background.done(done)
            del done
        return batch

    def state_dict(self) -> dict:
        """Where this job is, as of the last batch `next()` returned: small, plain data.

        Every rank returns the same state, so any rank's copy resumes the job, at this world
        size or another. Works as a torch.distributed.checkpoint Stateful. The value is JSON
        text written by msgspec. Under control_plane="gather" (the default) only rank 0 keeps
        the job's state: another rank asks rank 0 for it in its loop's next round, and rank 0
        sends it to every rank when its own trainer asks (`state_relay`), so call it on every
        rank at the same step (as a checkpoint save does), or on rank 0 alone."""
        snapshot = self._last_snapshot
        state = self._on_loop(lambda: self._runtime.state(snapshot))
        if isinstance(state, concurrent.futures.Future):   # a rank other than 0, under gather
            try:
                state = state.result(timeout=self.config.collective_timeout_s)
            except concurrent.futures.TimeoutError:
                raise DistributedError(
                    f"state_dict(): rank 0 did not send rank {self.rank} the state within "
                    f"collective_timeout_s ({self.config.collective_timeout_s:g} s); is rank "
                    f"0's loader still iterating?") from None
        payload = state if isinstance(state, bytes) else encode_state(state)
        return {"streamload": payload.decode()}

    def load_state_dict(self, state_dict) -> None:
        """Resume from `state_dict()`'s output (a dict, or its JSON bytes). Call before iterating.

        Raises ConfigError, naming every difference, when the state was saved with another seed
        or another option that decides which tokens are delivered (micro_batch_tokens,
        long_documents, the tokenizer, a source's text_field, tokens_field, format,
        on_exhausted, repeat: `job.check_resume`). The world size, the weights, the
        planner and micro_batches may change."""
        if self._background is not None:
            raise UsageError("load_state_dict() must be called before iterating the loader: "
                             "build a Loader, call load_state_dict(state), then iterate")
        payload = state_dict.get("streamload") if isinstance(state_dict, dict) else state_dict
        if payload is None:
            raise ConfigError("loader state: expected the dict returned by Loader.state_dict()")
        state = decode_state(payload.encode() if isinstance(payload, str) else payload)
        check_resume(state, self.config.seed, self._data_options())
        self._runtime.load_state(state)
        self._last_snapshot = None

    def stats(self, scope: str = "rank") -> dict:
        """This rank's counters: per step, per source, the mix, fill, bytes read; every field is
        described in docs/metrics.md. `steps` counts the batches next() returned;
        `steps_planned` the steps the loop has planned (it runs up to prefetch_steps ahead).

        `scope="job"`: every rank's stats, gathered (a collective: call it on every rank at
        the same point), as {"ranks": [each rank's stats], "job": totals over the ranks}."""
        if scope not in ("rank", "job"):
            raise ConfigError.at("scope", f"must be 'rank' or 'job', got {scope!r}")
        mine = {**self._on_loop(self._runtime.stats), "steps": self._steps_taken,
                "stall_s": self._stall_s}
        if scope == "rank":
            return mine
        if self._job_comm is None:
            self._job_comm = connect(self.config.collective_timeout_s)
        payload = np.frombuffer(msgspec.json.encode(mine), dtype=np.uint8).astype(np.int64)
        ranks = [msgspec.json.decode(part.astype(np.uint8).tobytes())
                 for part in self._job_comm.all_gather(payload)]
        return {"ranks": ranks, "job": job_totals(ranks)}

    def summary(self) -> str:
        """A few readable lines: steps, tokens per step and fill, balance, the mix against its
        target, and what was read for what was delivered."""
        s = self.stats()
        lines = [f"streamload: {s['steps']} steps taken ({s.get('steps_planned', s['steps'])} "
                 f"planned), DP rank {self.rank} of {self.world_size}"]
        per_step = s.get("tokens_per_step") or {}
        if per_step.get("mean") is not None:
            lines.append(f"  tokens/step: mean {per_step['mean']:,.0f}, p1 {per_step['p1']:,}, "
                         f"p50 {per_step['p50']:,}, p99 {per_step['p99']:,} of "
                         f"{s['step_capacity_tokens']:,} (fill {per_step['fill']:.3f}, "
                         f"{per_step['steps_below_90pct']} steps below 90%)")
        if s.get("pieces_cut"):
            lines.append(f"  {s['pieces_cut']:,} pieces of long documents cut to fill rows")
        if s.get("imbalance_mean") is not None:
            lines.append(f"  balance: max/mean rank cost {s['imbalance_mean']:.3f} on average; "
                         f"trainer waited {s['stall_s']:.2f} s in next()")
        if s.get("mix"):   # target as configured, realized while all had data, per epoch
            steps = s["mix_steps"]
            lines += ["  " + line for line in format_mix({**steps, "sources": s["mix"]},
                                                         steps["unit"])]
        skipped = {name: src for name, src in (s.get("sources") or {}).items()
                   if src.get("skipped_records") or src.get("skipped_shards")}
        if skipped:   # on_error="skip": what this rank left out, and the first reason
            lines.append("  skipped (on_error='skip'): " + "; ".join(
                f"{name} {src['skipped_records']:,} record(s), {src['skipped_shards']:,} "
                f"shard(s) (first: {src.get('first_skip')})" for name, src in skipped.items()))
        if s.get("tokens_delivered"):
            lines.append(f"  read {s['bytes_read']:,} bytes for {s['tokens_delivered']:,} tokens "
                         f"delivered ({s['bytes_read_per_token']:.2f} B/token)")
        return "\n".join(lines)

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """fn() where the Runtime lives: on its loop while it runs, else here."""
        if self._background is None:   # not started: nothing runs on the Runtime yet
            return fn()
        return self._background.call(fn)

    def close(self) -> None:
        """Stop fetching and release everything. Safe to call twice; next() afterwards
        raises UsageError."""
        self._finished = self._closed = True
        self._last_batch = None
        if self._finalizer is not None:
            self._finalizer()
        if isinstance(self._runtime, Runtime):
            self._runtime.delivery.close()

    def _use_images(self, config: LoaderConfig) -> None:
        """A job with an image source: every step moves and decodes images
        (`pipeline/image_batches.py`) on each DP rank's builder. Under broadcast delivery the
        images travel to the DP rank's other ranks with the rest of the step (`peers.py`);
        with pipeline parallelism only the first stage keeps them (`stage_view`). Context
        parallelism is refused: a CP rank holds only its part of each row's image positions,
        and how the encoder's work and outputs would be split over the CP group is the
        model's choice, which the loader cannot make."""
        options = [s.images for s in self.sources]
        if all(o is None for o in options):
            return
        if self.topology is not None and self.topology.cp > 1:
            raise ConfigError.at("parallel.cp", f"image sources are not supported with "
                                 f"context parallelism (cp={self.topology.cp}): the loader "
                                 f"would split each row's image positions over the CP ranks, "
                                 f"but not its images; use cp=1 for an image job, or tp/pp")
        geometry = shared_geometry([s.name for s in self.sources], options)
        if self.comm is None:   # a Follower: its DP rank's builder sends it the images
            return
        self._runtime.delivery.use_images(
            ImageBatches(geometry, config.image_workers, config.decode_images_in))

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
