"""One owner for every background task: the first failure cancels the rest and is kept.

Like asyncio.TaskGroup, but long-lived (tasks are added while the loader runs) and it
calls `on_failure` at once, so the step loop can stop waiting and report the error.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Coroutine, Optional


class Supervisor:
    def __init__(self, on_failure: Optional[Callable[[BaseException], None]] = None):
        self._tasks: set[asyncio.Task] = set()
        self._on_failure = on_failure
        self.error: Optional[BaseException] = None

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        if self.error is not None:
            coro.close()
            raise self.error
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if self.error is None:
            self.error = task.exception()
            for other in list(self._tasks):
                other.cancel()
            if self._on_failure is not None:
                self._on_failure(self.error)

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
