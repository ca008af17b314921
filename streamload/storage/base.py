"""The ObjectStore protocol: list objects under a URI, read byte ranges. Async only."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, order=True)
class ObjectInfo:
    uri: str     # full URI, e.g. "s3://bucket/web/part-000.jsonl.zst" or "/data/code/a.jsonl"
    size: int    # bytes


@dataclass
class StoreCounters:
    """Counters one store keeps; the loader reports them per source in `stats()`."""
    requests: int = 0
    retries: int = 0
    bytes_read: int = 0
    latencies_s: list[float] = field(default_factory=list)  # a bounded recent sample

    def record_latency(self, seconds: float, keep: int = 1024) -> None:
        self.latencies_s.append(seconds)
        if len(self.latencies_s) > 2 * keep:
            del self.latencies_s[:-keep]


@runtime_checkable
class ObjectStore(Protocol):
    counters: StoreCounters

    async def list(self, uri: str) -> list[ObjectInfo]:
        """Objects matching a prefix, a directory or a glob, sorted by URI.
        Raises StorageError naming the URI when the bucket or path does not exist."""

    async def read_range(self, uri: str, start: int, end: int, *,
                         counters: "StoreCounters | None" = None,
                         buffer: "Callable[[int], Any] | None" = None) -> Any:
        """Bytes [start, end) of one object, retried per the store's RetryPolicy.
        Raises StorageError naming the object when retries are exhausted. `counters` (default:
        the store's own) receives the request, retries, latency and bytes, so sources that
        share a store can be counted apart. `bytes`, unless `buffer` is given: a function of
        the range's length giving a writable buffer (`buffers.mapped_buffer`), which a store
        that reads in pieces (S3, local files) fills and returns instead; a store may still
        return bytes, so a caller that passes it takes either."""

    async def aclose(self) -> None:
        """Release pooled connections."""


class CountedStore:
    """A view of a shared store that counts its own requests (one per source)."""

    def __init__(self, store: ObjectStore, counters: StoreCounters | None = None):
        self.store = store
        self.counters = counters or StoreCounters()

    async def list(self, uri: str) -> list[ObjectInfo]:
        return await self.store.list(uri)

    async def read_range(self, uri: str, start: int, end: int, *,
                         counters: StoreCounters | None = None,
                         buffer: Callable[[int], Any] | None = None) -> Any:
        counters = counters or self.counters
        if buffer is None:   # stores that do not know `buffer` (a test's) still serve the rest
            return await self.store.read_range(uri, start, end, counters=counters)
        return await self.store.read_range(uri, start, end, counters=counters, buffer=buffer)

    async def aclose(self) -> None:
        """The shared store is closed by its owner."""
