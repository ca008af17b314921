"""A cancellation-safe "something changed" signal for coroutines on one event loop.

Waiters check their condition, then `await changes.wait()`; every state change calls
`notify()`, which wakes them all to check again. Everything runs on the loader's one loop
thread, so no lock is needed: nothing can happen between the check and the wait.

This replaces asyncio.Condition in the buffers and memory gates: there is no lock to take for
every item put, and a cancelled waiter leaves at once (a Condition's waiter must re-acquire the
lock first).
"""
from __future__ import annotations

import asyncio


class Changes:
    def __init__(self) -> None:
        self._waiters: list[asyncio.Future] = []

    async def wait(self) -> None:
        """Until the next `notify()`."""
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future
        finally:
            if not future.done():   # cancelled: forget it
                self._waiters.remove(future)

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(None)
