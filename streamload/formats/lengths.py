"""Measuring a record shard's documents without keeping their tokens
(`ShardFormat.document_lengths` for formats that decode records, such as JSONL).

The shard is read as the fetcher reads it (open, the planned ranges in order, decode, finish)
and each record measured as the loader's transform would count its tokens: a text's UTF-8
bytes without a tokenizer, else the number of ids the tokenizer gives it (one `encode_texts`
call per range, failures handled by `encode_records`, as the fetcher's are). The ids are
counted, not checked: the lengths are what matters here.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

import numpy as np

from ..errors import ConfigError, DataError
from ..storage.base import ObjectInfo, ObjectStore
from ..tokenizer import TextTokenizer, TokenizerError
from .base import DocumentLengths, Problems, RawRecord
from .images import measure_image_records


async def encode_records(records: list[RawRecord],
                         encode: Callable[[list[str]], Awaitable[list]], problems: Problems
                         ) -> list[tuple[RawRecord, Any]]:
    """(record, token ids) for every record of `records`, in order: a token record's own ids,
    a text's from `encode` (one call for all the texts, `TextTokenizer.encode_texts` or a hop
    to where it runs). The one place of what a tokenizer failure is (the fetcher and
    `document_lengths` both come here): a text it fails on (`TokenizerError`) is reported
    (`problems`) and left out, and the call goes on past it; a tokenizer that fails the whole
    call, or returns another number of results, is a DataError naming the records of the call."""
    source, shard_name = problems.source, problems.shard_name
    ids: list[Any] = [r.payload if not isinstance(r.payload, str) else None for r in records]
    failed: set[int] = set()
    todo = [k for k, r in enumerate(records) if isinstance(r.payload, str)]
    while todo:
        span = f"records {records[todo[0]].index}..{records[todo[-1]].index}"
        try:
            tokens = await encode([records[k].payload for k in todo])
        except TokenizerError as exc:
            k = todo[exc.index]
            try:
                problems.record(records[k].index, str(exc))
            except DataError as error:   # chained: the tokenizer's own traceback stays visible
                raise error from exc.__cause__
            tokens, failed = exc.done, failed | {k}
            todo_next = todo[exc.index + 1:]
        except Exception as exc:   # a batch tokenizer: no record to name
            raise DataError(f"the tokenizer failed on {span}: {type(exc).__name__}: {exc}",
                            source=source, shard=shard_name) from exc
        else:
            todo_next = []
            if len(tokens) != len(todo):
                raise DataError(f"the tokenizer returned {len(tokens)} results for {len(todo)} "
                                f"documents ({span})", source=source, shard=shard_name)
        for k, result in zip(todo, tokens):
            ids[k] = result
        todo = todo_next
    return [(r, ids[k]) for k, r in enumerate(records) if k not in failed]


async def measure_records(records: list[RawRecord], tokenizer: Optional[TextTokenizer], *,
                          problems: Problems) -> list[int]:
    """The token count of each record, in order (`encode_records`'s failures left out): a
    text's UTF-8 bytes without a tokenizer."""
    if tokenizer is None:
        return [len(r.payload.encode("utf-8")) if isinstance(r.payload, str)
                else int(np.size(r.payload)) for r in records]

    async def encode(texts: list[str]) -> list:
        return tokenizer.encode_texts(texts)

    pairs = await encode_records(records, encode, problems)
    return [int(np.size(ids)) for _, ids in pairs]


async def stream_lengths(fmt, store: ObjectStore, shard: ObjectInfo, *, problems: Problems,
                         tokenizer: Optional[TextTokenizer], limit: Optional[int],
                         chunk_bytes: int, **open_options) -> DocumentLengths:
    """`fmt.document_lengths` by reading the shard's records: decode, measure (see the module
    docstring). With `limit`, reading stops once that many documents are measured.
    `open_options` go to `fmt.open` (an indexed format's `index`)."""
    out = await stream_measures(fmt, store, shard, problems=problems, tokenizer=tokenizer,
                                limit=limit, chunk_bytes=chunk_bytes,
                                images=getattr(fmt, "images", None), **open_options)
    return DocumentLengths(np.array(out, dtype=np.int64), "scan")


async def stream_measures(fmt, store: ObjectStore, shard: ObjectInfo, *, problems: Problems,
                          tokenizer: Optional[TextTokenizer], limit: Optional[int],
                          chunk_bytes: int, images=None, with_patches: bool = False,
                          **open_options) -> list:
    """Each record's length, read as `stream_lengths` reads them; for image-text records
    (`images`: the source's `Images`) with `with_patches`, (index, key, length, patches per image)
    (`formats.images.measure_image_records`)."""
    if limit is not None and limit < 0:
        raise ConfigError.at("limit", f"must be >= 0, got {limit}")
    out: list = []
    if limit == 0:
        return out
    stream = await fmt.open(store, shard, problems=problems, chunk_bytes=chunk_bytes,
                            **open_options)

    async def add(records: list[RawRecord]) -> bool:
        """Measure `records` (no more than the limit needs); True once the limit is reached."""
        at = 0
        while at < len(records) and (limit is None or len(out) < limit):
            # The records the limit still needs (a bad one, left out, calls for one more).
            end = len(records) if limit is None else at + limit - len(out)
            if images is not None:   # image-text records: text plus visual tokens
                out.extend(measure_image_records(records[at:end], tokenizer, images, problems,
                                                 with_patches))
            else:
                out.extend(await measure_records(records[at:end], tokenizer, problems=problems))
            at = end
        return limit is not None and len(out) >= limit

    for start, end in stream.ranges():
        if await add(stream.decode(await store.read_range(shard.uri, start, end))):
            break
    else:
        await add(stream.finish())
    return out
