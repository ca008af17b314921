"""A small thread pool of daemon threads.

concurrent.futures joins its workers at interpreter exit, so one long tokenizer call (or a
collective waiting on a dead peer) would keep a Ctrl-C'd trainer from exiting. These threads
never hold the process up; the work they do is either finished or not needed any more.

One thing must not happen, though: the interpreter exiting while a daemon thread is inside
native code that will take the GIL back (a Hugging Face tokenizer's `encode_batch`). Python
stops such a thread by unwinding it, and Rust code aborts the whole process on that ("FATAL:
exception not rethrown"). So a loader with such a tokenizer, when it closes, lets each thread
finish the job in hand (`finish`, bounded by a timeout) before it returns. Python code needs no
wait (a slow pure-Python tokenizer would only delay Ctrl-C).

Waiting for that is a hand-off, not a poll: each thread, as the very last thing it does, resolves
a `concurrent.futures.Future` (in a `finally`, so an exception ends it too), and the event loop
awaits those futures, woken through `call_soon_threadsafe` the moment the last one ends, or gives
up when the timeout passes. `Thread.join` would block the event loop; polling `is_alive()` would
cost a wake-up every few milliseconds and return up to a period late.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Executor, Future
from typing import Callable, TypeVar

T = TypeVar("T")


class DaemonExecutor(Executor):
    def __init__(self, workers: int, name: str):
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._ended: list[Future] = []      # one per thread, resolved as it ends
        for i in range(workers):
            thread, ended = _daemon_thread(self._serve, f"{name}-{i}")
            self._threads.append(thread)
            self._ended.append(ended)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # handed to whoever awaits the future
                    future.set_exception(exc)

    def submit(self, fn: Callable[..., T], /, *args, **kwargs) -> "Future[T]":
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Await fn(*args) from the event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = True) -> None:
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for thread in self._threads:
                thread.join()

    async def finish(self, timeout: float) -> bool:
        """After `shutdown`: wait, without blocking the event loop, until every thread has
        finished its job in hand (at most `timeout` seconds). True if they all did."""
        return await _joined(self._ended, timeout)


async def run_detached(fn: Callable[[], object], timeout: float) -> bool:
    """fn() on a daemon thread, awaited for at most `timeout` seconds (a blocking shutdown that
    must not block the event loop, nor the interpreter's exit). True if it returned (or raised:
    the exception goes to `threading.excepthook`, as for any thread)."""
    _, ended = _daemon_thread(fn, "streamload-shutdown")
    return await _joined([ended], timeout)


def _daemon_thread(target: Callable[[], object], name: str) -> "tuple[threading.Thread, Future]":
    """Start target() on a daemon thread; the future resolves (to None) when the thread is done
    with it, however it ended."""
    ended: Future = Future()

    def run() -> None:
        try:
            target()
        finally:
            ended.set_result(None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, ended


async def _joined(ended: "list[Future]", timeout: float) -> bool:
    """Wait until every future in `ended` has resolved (True) or `timeout` seconds have passed
    (False), without blocking the event loop."""
    pending = [f for f in ended if not f.done()]
    if not pending:
        return True
    loop = asyncio.get_running_loop()
    all_ended = loop.create_future()
    left = len(pending)
    lock = threading.Lock()

    def wake() -> None:                 # on the event loop
        if not all_ended.done():
            all_ended.set_result(True)

    def one_ended(_: Future) -> None:   # on the thread that ended (or here, if it already had)
        nonlocal left
        with lock:
            left -= 1
            if left:
                return
        try:
            loop.call_soon_threadsafe(wake)
        except RuntimeError:            # the loop has closed: nobody is waiting any more
            pass

    for future in pending:
        future.add_done_callback(one_ended)
    try:
        done, _ = await asyncio.wait([all_ended], timeout=timeout)
        return bool(done)
    finally:
        all_ended.cancel()              # no-op if woken; else a late wake() finds it done
