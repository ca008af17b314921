"""The loader's collective protocol: every collective starts with a status word, and every step
agrees on its summaries through `Agreement.agree`.

A rank that failed still takes part in the next all-gather and says why (FAILED); a rank that is
alive but not ready says WAITING (a heartbeat); a rank that is closing says CLOSING. So no rank is
left inside a collective waiting for a peer that will never come, and the collective timeout is
left to catch dead or frozen processes only.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Optional, Protocol, TypeVar

import numpy as np

from ..errors import DistributedError
from .comm import Comm, collective_thread

T = TypeVar("T")

OK, FAILED, CLOSING, WAITING = 0, 1, 2, 3
RESEND = 4   # control_plane="gather": a summary outgrew the gather; every rank sends it again


class StopStepping(Exception):
    """Every rank agreed to stop: this rank is closing and so is at least one other (or all)."""


def encode_closing() -> np.ndarray:
    return np.array([CLOSING], dtype=np.int64)


def encode_waiting() -> np.ndarray:
    """A heartbeat: this rank is alive but not ready (its trainer has not taken the last batch,
    or its buffers are still filling). Everyone gathers again, so no collective waits on a
    busy rank for longer than the heartbeat period."""
    return np.array([WAITING], dtype=np.int64)


def encode_failure(error: BaseException) -> np.ndarray:
    message = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[:4000]
    return np.concatenate([[FAILED], np.frombuffer(message, dtype=np.uint8).astype(np.int64)])


def check_statuses(gathered: list[np.ndarray], rank: int, local_error: Optional[BaseException],
                   closing: bool) -> bool:
    """Every rank raises if any rank failed: its own error if it failed, else a named one.
    Raises StopStepping if this rank is closing; a peer closing alone is an error here.
    Returns False if some rank is still waiting (gather again), True when all are ready."""
    if local_error is not None:
        raise local_error
    for other, array in enumerate(gathered):
        if array.shape[0] and array[0] == FAILED:
            message = bytes(array[1:].astype(np.uint8)).decode("utf-8", "replace")
            raise DistributedError(f"rank {other} failed, so rank {rank} stops too: {message}")
    if closing:
        raise StopStepping()
    for other, array in enumerate(gathered):
        if array.shape[0] and array[0] == CLOSING:
            raise DistributedError(
                f"rank {other} closed its loader while rank {rank} was still iterating; "
                f"every rank must stop at the same step")
    return not any(array.shape[0] and array[0] == WAITING for array in gathered)


class Agreement:
    """Runs the loader's collectives for the step loop, on their own thread (a blocking gloo call
    must not block the event loop). Loop-owned; `request_close` is called on the loop."""

    def __init__(self, comm: Comm, collective_timeout_s: float):
        self.comm = comm
        self.heartbeat_s = collective_timeout_s / 3
        self.closing = asyncio.Event()
        self.thread = None   # the collective thread, started by the first collective

    def request_close(self) -> None:
        """The step loop stops at its next all-gather, telling the other ranks."""
        self.closing.set()

    def shutdown(self) -> None:
        if self.thread is not None:
            self.thread.shutdown()

    async def run(self, call: Callable[[], T]) -> T:
        """A blocking collective, on the collective thread; with one rank there is nothing to
        wait for, so it runs inline (a thread hop per call costs more than the call)."""
        if self.comm.world == 1:
            return call()
        return await self.run_threaded(call)

    async def run_threaded(self, call: Callable[[], T]) -> T:
        """A blocking collective on the collective thread, whatever this group's size (a
        broadcast to other ranks, `peers`)."""
        if self.thread is None:
            self.thread = collective_thread()
        return await self.thread.run(call)

    async def agree(self, local: Callable[[], Awaitable[np.ndarray]]) -> list[np.ndarray]:
        """All-gather `local()`'s array once every rank has one.

        A rank that is not ready within the heartbeat period gathers WAITING, and everyone
        gathers again: a busy trainer or a slow source never trips the timeout. If `local()`
        raised anywhere, every rank raises. A closing rank sends CLOSING and stops
        (StopStepping) once the gather returns."""
        async def exchange(array, error, closing):
            gathered = await self.run(lambda: self.comm.all_gather(array))
            return gathered if check_statuses(gathered, self.comm.rank, error, closing) else None
        return await self._rounds(local, exchange)

    # -- control_plane="gather": windows to rank 0, each rank's own reply back ------------------
    async def gather_step(self, local: Callable[[], Awaitable[np.ndarray]],
                          plan: Optional[Callable[[list[np.ndarray]], list[np.ndarray]]],
                          side: Optional["Sideband"] = None) -> np.ndarray:
        """Gather `local()`'s array to rank 0 once every rank has one; rank 0 turns them into
        one reply per rank (`plan`, given on rank 0 only), and each rank returns its own.

        The protocol of `agree`, through rank 0: each rank gathers its status (WAITING as a
        heartbeat, FAILED with its error, CLOSING), and rank 0 replies to all with what it saw
        before anything else: gather again (a rank waiting, or a summary that outgrew the
        gather's capacity), stop (a rank failed: every rank raises, naming it; a rank closed),
        or the plan.

        `side`: words that ride on every round whatever its status (`Sideband`): each rank's
        `side.outgoing()` goes to rank 0 with its array, rank 0's `side.answer` gives each
        rank words back with its reply, which `side.receive` takes before the reply's status
        is acted on. While `side.wake` is set a rank does not wait for `local()` to gather."""
        async def exchange(array, error, closing):
            message = array if side is None else _framed(side.outgoing(), array)
            gathered = await self.run(lambda: self.comm.gather(message))
            replies = None
            if self.comm.rank == 0:
                words = None
                if side is not None:
                    words = [None if g is None else _unframe(g)[0] for g in gathered]
                    gathered = [None if g is None else _unframe(g)[1] for g in gathered]
                replies = _control_replies(gathered, self.comm.world)
                final = replies is not None and int(replies[0][0]) == CLOSING   # the run ends
                if replies is None:
                    replies = plan(gathered)
                if side is not None:
                    replies = [_framed(w, r) for w, r in zip(side.answer(words, final), replies)]
            mine = await self.run(lambda: self.comm.scatter(replies))
            if side is not None:
                words, mine = _unframe(mine)
                side.receive(words)
            return mine if _check_reply(mine, self.comm.rank, error, closing) else None
        return await self._rounds(local, exchange, None if side is None else side.wake)

    async def _rounds(self, local: Callable[[], Awaitable[np.ndarray]], exchange,
                      wake: Optional[asyncio.Event] = None):
        """Rounds of `exchange(array, error, closing)` until one returns a result: each round this
        rank sends CLOSING, WAITING (`local()` not ready within the heartbeat, or when `wake`
        is set), FAILED (it raised: told to every rank, then re-raised here) or `local()`'s
        array."""
        task = asyncio.ensure_future(local())
        try:
            while True:
                waits = {asyncio.ensure_future(self.closing.wait())}
                if wake is not None:
                    waits.add(asyncio.ensure_future(wake.wait()))
                await asyncio.wait({task, *waits}, timeout=self.heartbeat_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                for wait in waits:
                    wait.cancel()
                error, closing = None, self.closing.is_set()
                if closing:
                    array = encode_closing()
                elif not task.done():
                    array = encode_waiting()
                elif task.exception() is not None:
                    error = task.exception()
                    array = encode_failure(error)
                else:
                    array = task.result()
                result = await exchange(array, error, closing)
                if result is not None:
                    return result
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


class Sideband(Protocol):
    """Words every rank exchanges with rank 0 on each round of `gather_step`, whatever the
    round's status (the runtime's state requests, `state_relay.StateRelay`)."""
    wake: asyncio.Event   # set: this rank has something to say, so it gathers without waiting

    def outgoing(self) -> np.ndarray: ...
    def answer(self, words: list[Optional[np.ndarray]], final: bool) -> list[np.ndarray]: ...
    def receive(self, words: np.ndarray) -> None: ...


def _framed(words: np.ndarray, array: np.ndarray) -> np.ndarray:
    """A side word count, the side words, then the array."""
    return np.concatenate([np.array([words.shape[0]], np.int64), words.astype(np.int64),
                           array.astype(np.int64)])


def _unframe(message: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = int(message[0])
    return message[1:1 + n], message[1 + n:]


def _control_replies(gathered: list, world: int) -> Optional[list[np.ndarray]]:
    """Rank 0: the reply to every rank when the step cannot be planned (None: it can)."""
    for other, array in enumerate(gathered):
        if array is not None and array.shape[0] and array[0] == FAILED:
            return [np.concatenate([[FAILED, other], array[1:]]).astype(np.int64)] * world
    for other, array in enumerate(gathered):
        if array is not None and array.shape[0] and array[0] == CLOSING:
            return [np.array([CLOSING, other], dtype=np.int64)] * world
    if any(array is None for array in gathered):   # outgrew the capacity, which grew
        return [np.array([RESEND], dtype=np.int64)] * world
    if any(array.shape[0] and array[0] == WAITING for array in gathered):
        return [np.array([WAITING], dtype=np.int64)] * world
    return None


def _check_reply(reply: np.ndarray, rank: int, local_error: Optional[BaseException],
                 closing: bool) -> bool:
    """`check_statuses` on rank 0's reply: raises as every rank would on the gathered
    statuses; False to gather again, True for a plan."""
    if local_error is not None:
        raise local_error
    kind = int(reply[0])
    if kind == FAILED:
        message = bytes(reply[2:].astype(np.uint8)).decode("utf-8", "replace")
        raise DistributedError(f"rank {int(reply[1])} failed, so rank {rank} stops too: {message}")
    if closing:
        raise StopStepping()
    if kind == CLOSING:
        raise DistributedError(
            f"rank {int(reply[1])} closed its loader while rank {rank} was still iterating; "
            f"every rank must stop at the same step")
    return kind == OK
