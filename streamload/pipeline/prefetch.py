"""Run coroutines with at most `depth` in flight and yield their results in submission order."""
from __future__ import annotations

import asyncio
from collections import deque
from typing import AsyncIterator, Awaitable, Callable, Iterable, TypeVar

T = TypeVar("T")
K = TypeVar("K")


async def ordered_prefetch(keys: Iterable[K], fetch: Callable[[K], Awaitable[T]],
                           depth: int) -> AsyncIterator[T]:
    """Like `for k in keys: yield await fetch(k)`, but up to `depth` fetches overlap.

    Leftover fetches are cancelled when the consumer stops early or fails, so nothing
    outlives the generator.
    """
    pending: deque[asyncio.Task] = deque()
    keys = iter(keys)
    try:
        for key in keys:
            pending.append(asyncio.ensure_future(fetch(key)))
            if len(pending) >= depth:
                break
        while pending:
            result = await pending.popleft()
            for key in keys:
                pending.append(asyncio.ensure_future(fetch(key)))
                break
            yield result
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
