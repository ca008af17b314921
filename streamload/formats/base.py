"""The shard-format protocol.

A format turns one shard (an object in a store) into records. Reading is split in two so that
I/O stays on the event loop and CPU work stays off it:

* `await fmt.open(store, shard)` (async, on the loop) reads whatever small index the shard needs
  and returns a `ShardStream`.
* `stream.ranges()` lists the byte ranges to fetch, in order. The fetcher reads them with bounded
  concurrency and hands the bytes back **in the same order** to `stream.decode(chunk)`, which runs
  in a worker thread and may keep state between calls (decompressors, partial lines).
* `stream.finish()` flushes what is left after the last range.

`decode` and `finish` return `RawRecord`s: a record index (stable: the line number for JSONL, the
document number for token shards) and either text (to be tokenized) or a token array.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, Union

import numpy as np

from ..storage.base import ObjectInfo, ObjectStore

# on_error="skip" passes a callback (record_index or None for the whole shard, reason);
# on_error="raise" passes None and the stream raises DataError.
SkipCallback = Callable[[Union[int, None], str], None]


@dataclass(frozen=True)
class RawRecord:
    index: int
    payload: Union[str, np.ndarray]   # str for text formats, 1-D integer array for token formats


class ShardStream(Protocol):
    def ranges(self) -> Sequence[tuple[int, int]]: ...
    def decode(self, chunk: bytes) -> list[RawRecord]: ...
    def finish(self) -> list[RawRecord]: ...


class ShardFormat(Protocol):
    name: str

    def matches(self, uri: str) -> bool:
        """True when this format reads `uri` (by its name). Companion files (indexes) return False."""

    async def open(self, store: ObjectStore, shard: ObjectInfo, *, source: str, shard_name: str,
                   on_skip: SkipCallback | None, chunk_bytes: int) -> ShardStream: ...
