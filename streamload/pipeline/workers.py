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
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Executor, Future
from typing import Callable, TypeVar

T = TypeVar("T")


class DaemonExecutor(Executor):
    def __init__(self, workers: int, name: str):
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

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
        return await _joined(self._threads, timeout)


async def run_detached(fn: Callable[[], object], timeout: float) -> bool:
    """fn() on a daemon thread, awaited for at most `timeout` seconds (a blocking shutdown that
    must not block the event loop, nor the interpreter's exit). True if it returned."""
    thread = threading.Thread(target=fn, name="streamload-shutdown", daemon=True)
    thread.start()
    return await _joined([thread], timeout)


async def _joined(threads: list[threading.Thread], timeout: float) -> bool:
    """Poll until `threads` have ended (True) or `timeout` seconds have passed (False)."""
    deadline = time.monotonic() + timeout
    while any(t.is_alive() for t in threads):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True
