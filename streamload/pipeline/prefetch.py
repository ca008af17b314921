"""Run coroutines with a bounded number in flight and yield their results in submission order."""
from __future__ import annotations

import asyncio
from collections import deque
from typing import AsyncIterator, Awaitable, Callable, Iterable, TypeVar, Union

T = TypeVar("T")
K = TypeVar("K")


async def ordered_prefetch(keys: Iterable[K], fetch: Callable[[K], Awaitable[T]],
                           depth: Union[int, Callable[[], int]]) -> AsyncIterator[T]:
    """Like `for k in keys: yield await fetch(k)`, but up to `depth` fetches overlap.

    `depth` may be a callable, read each time a fetch could start, so an autoscaler can change
    it while the iteration runs. Leftover fetches are cancelled when the consumer stops early
    or fails, so nothing outlives the generator.
    """
    limit = depth if callable(depth) else (lambda: depth)
    pending: deque[asyncio.Task] = deque()
    keys = iter(keys)
    exhausted = False

    def top_up() -> None:
        nonlocal exhausted
        while not exhausted and len(pending) < max(1, limit()):
            key = next(keys, _DONE)
            if key is _DONE:
                exhausted = True
            else:
                pending.append(asyncio.ensure_future(fetch(key)))

    try:
        top_up()
        while pending:
            result = await pending.popleft()
            top_up()
            yield result
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


_DONE = object()
