"""DaemonExecutor.finish and run_detached: woken by the threads' ends, bounded by the timeout.

"Woken by the ends, not by a poll" is checked by counting how often the event loop's selector
is asked for events while it waits: a poll every few milliseconds would wake it dozens of times
over the waits below, a hand-off once or twice.
"""
from __future__ import annotations

import asyncio
import logging
import selectors
import threading
import time

import pytest

from streamload.pipeline.workers import DaemonExecutor, run_detached

pytestmark = pytest.mark.timeout(60)

BLOCK_S = 0.2      # how long a job blocks before it is let go
MAX_WAKEUPS = 8    # a 5 ms poll over BLOCK_S would be ~80


class CountingSelector(selectors.DefaultSelector):
    """The default selector, counting the loop's waits for events."""

    def __init__(self):
        super().__init__()
        self.selects = 0

    def select(self, timeout=None):
        self.selects += 1
        return super().select(timeout)


def run_counted(coro_fn):
    """Run coro_fn() on a fresh event loop; (its result, how often the loop waited for events
    while it ran)."""
    selector = CountingSelector()
    loop = asyncio.SelectorEventLoop(selector)
    try:
        async def main():
            await asyncio.sleep(0)          # settle the loop before counting
            before = selector.selects
            result = await coro_fn()
            return result, selector.selects - before
        return loop.run_until_complete(main())
    finally:
        loop.close()


class Blocker:
    """Jobs that block until `go` is set; `running(n)` waits until n of them have started (so
    that `shutdown` finds them in hand, not queued)."""

    def __init__(self):
        self.go = threading.Event()
        self._started = threading.Semaphore(0)

    def job(self) -> bool:
        self._started.release()
        return self.go.wait()

    def running(self, n: int) -> None:
        for _ in range(n):
            assert self._started.acquire(timeout=10)


def release_later(event: threading.Event, delay: float) -> threading.Timer:
    timer = threading.Timer(delay, event.set)
    timer.start()
    return timer


def test_threads_are_daemons():
    executor = DaemonExecutor(2, "test-daemon")
    try:
        assert len(executor._threads) == 2
        assert all(t.daemon and t.is_alive() for t in executor._threads)
        assert [t.name for t in executor._threads] == ["test-daemon-0", "test-daemon-1"]
    finally:
        executor.shutdown(wait=True)


def test_finish_returns_true_as_soon_as_the_threads_end():
    executor = DaemonExecutor(3, "test-finish")
    blocker = Blocker()
    jobs = [executor.submit(blocker.job) for _ in range(3)]
    blocker.running(3)
    executor.shutdown()
    timer = release_later(blocker.go, BLOCK_S)

    async def finish():
        started = time.monotonic()
        ok = await executor.finish(timeout=30)
        return ok, time.monotonic() - started

    (ok, elapsed), wakeups = run_counted(finish)
    timer.join()
    assert ok is True
    assert elapsed < 20, elapsed                 # nowhere near the 30 s timeout, even loaded
    assert wakeups <= MAX_WAKEUPS, wakeups       # woken by the threads, not by a poll
    assert all(j.result() is True for j in jobs)   # each finished its job in hand
    for thread in executor._threads:
        thread.join(timeout=5)
        assert not thread.is_alive()


async def test_finish_with_idle_threads_and_twice():
    executor = DaemonExecutor(4, "test-idle")
    assert await executor.run(sum, [1, 2, 3]) == 6
    executor.shutdown()
    assert await executor.finish(timeout=10) is True
    assert await executor.finish(timeout=0) is True      # already ended: no wait at all


async def test_finish_counts_a_job_that_raised_as_finished():
    executor = DaemonExecutor(1, "test-raise")

    def boom():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await executor.run(boom)
    executor.shutdown()
    assert await executor.finish(timeout=10) is True


def test_finish_returns_false_after_the_timeout_when_a_job_blocks():
    executor = DaemonExecutor(2, "test-blocked")
    blocker = Blocker()
    in_hand = executor.submit(blocker.job)       # one thread blocks; the other is idle
    blocker.running(1)
    queued = executor.submit(blocker.job)        # the idle thread may take this one
    queued_too = executor.submit(blocker.job)
    executor.shutdown()                          # cancels what no thread has taken yet
    go = blocker.go

    async def finish():
        started = time.monotonic()
        ok = await executor.finish(timeout=BLOCK_S)
        return ok, time.monotonic() - started

    try:
        (ok, elapsed), wakeups = run_counted(finish)
        assert ok is False
        assert BLOCK_S <= elapsed < BLOCK_S + 20, elapsed   # at the timeout (a loaded machine
                                                             # may be late), never before
        assert wakeups <= MAX_WAKEUPS, wakeups
        assert queued.cancelled() or queued_too.cancelled()
    finally:
        go.set()
    assert in_hand.result(timeout=5) is True
    for thread in executor._threads:
        thread.join(timeout=5)
        assert not thread.is_alive()


def test_a_thread_ending_after_the_loop_closed_logs_nothing(caplog):
    executor = DaemonExecutor(1, "test-late")
    blocker = Blocker()
    executor.submit(blocker.job)
    blocker.running(1)
    executor.shutdown()
    go = blocker.go
    caplog.set_level(logging.DEBUG)
    (ok, _) = run_counted(lambda: executor.finish(timeout=0.05))   # closes its loop after
    assert ok is False
    go.set()                          # the thread ends now, its waiter long gone
    executor._threads[0].join(timeout=5)
    assert not executor._threads[0].is_alive()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_run_detached_returns_as_soon_as_fn_returns():
    returned_at = []

    def fn():
        time.sleep(BLOCK_S)           # the blocking call being waited for (not a poll)
        returned_at.append(time.monotonic())

    async def detached():
        ok = await run_detached(fn, timeout=30)
        return ok, time.monotonic()

    (ok, woke_at), wakeups = run_counted(detached)
    assert ok is True
    assert returned_at and woke_at - returned_at[0] < 1.0
    assert wakeups <= MAX_WAKEUPS, wakeups       # one hand-off, no periodic wake-ups


async def test_run_detached_gives_up_after_the_timeout():
    go = threading.Event()
    started = time.monotonic()
    try:
        assert await run_detached(go.wait, timeout=BLOCK_S) is False
        assert BLOCK_S <= time.monotonic() - started < BLOCK_S + 5
        names = [t.name for t in threading.enumerate()]
        detached = [t for t in threading.enumerate() if t.name == "streamload-shutdown"]
        assert detached and all(t.daemon for t in detached), names
    finally:
        go.set()


async def test_run_detached_of_a_quick_fn_many_times():
    calls = []
    for i in range(50):
        assert await run_detached(lambda i=i: calls.append(i), timeout=10) is True
    assert calls == list(range(50))
