"""Measuring a record shard's documents without keeping their tokens
(`ShardFormat.document_lengths` for formats that decode records, such as JSONL).

The shard is read as the fetcher reads it (open, the planned ranges in order, decode, finish)
and each record measured as the loader's transform would count its tokens: a text's UTF-8
bytes without a tokenizer, else the number of ids the tokenizer gives it (one `encode_texts`
call per range, failures handled as `SourceFetcher._tokenize` handles them). The ids are
counted, not checked: the lengths are what matters here.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import ConfigError, DataError
from ..storage.base import ObjectInfo, ObjectStore
from ..tokenizer import TextTokenizer, TokenizerError
from .base import DocumentLengths, RawRecord, SkipCallback


def measure_records(records: list[RawRecord], tokenizer: Optional[TextTokenizer], *,
                    source: str, shard_name: str,
                    on_skip: Optional[SkipCallback]) -> list[int]:
    """The token count of each record, in order; records the tokenizer fails on raise a
    DataError naming them, or with `on_skip` are left out and reported."""
    lengths: list[Optional[int]] = [None] * len(records)
    todo = []
    for k, record in enumerate(records):
        if not isinstance(record.payload, str):   # token ids already
            lengths[k] = int(np.size(record.payload))
        elif tokenizer is None:
            lengths[k] = len(record.payload.encode("utf-8"))
        else:
            todo.append(k)
    while todo:
        try:
            tokens = tokenizer.encode_texts([records[k].payload for k in todo])
        except TokenizerError as exc:
            record = records[todo[exc.index]].index
            if on_skip is None:   # chained: the tokenizer's own traceback stays visible
                raise DataError(str(exc), source=source, shard=shard_name,
                                record=record) from exc.__cause__
            on_skip(record, str(exc))
            tokens, todo_next = exc.done, todo[exc.index + 1:]
        except Exception as exc:   # a batch tokenizer: no record to name
            raise DataError(f"the tokenizer failed on records {records[todo[0]].index}.."
                            f"{records[todo[-1]].index}: {type(exc).__name__}: {exc}",
                            source=source, shard=shard_name) from exc
        else:
            todo_next = []
            if len(tokens) != len(todo):
                raise DataError(f"the tokenizer returned {len(tokens)} results for "
                                f"{len(todo)} documents (records {records[todo[0]].index}.."
                                f"{records[todo[-1]].index})", source=source, shard=shard_name)
        for k, ids in zip(todo, tokens):
            lengths[k] = int(np.size(ids))
        todo = todo_next
    return [n for n in lengths if n is not None]


async def stream_lengths(fmt, store: ObjectStore, shard: ObjectInfo, *, source: str,
                         shard_name: str, on_skip: Optional[SkipCallback],
                         tokenizer: Optional[TextTokenizer], limit: Optional[int],
                         chunk_bytes: int) -> DocumentLengths:
    """`fmt.document_lengths` by reading the shard's records: decode, measure (see the module
    docstring). With `limit`, reading stops once that many documents are measured."""
    if limit is not None and limit < 0:
        raise ConfigError.at("limit", f"must be >= 0, got {limit}")
    out: list[int] = []
    if limit == 0:
        return DocumentLengths(np.zeros(0, np.int64), "scan")
    stream = await fmt.open(store, shard, source=source, shard_name=shard_name,
                            on_skip=on_skip, chunk_bytes=chunk_bytes)

    def add(records: list[RawRecord]) -> bool:
        """Measure `records` (no more than the limit needs); True once the limit is reached."""
        at = 0
        while at < len(records) and (limit is None or len(out) < limit):
            # The records the limit still needs (a bad one, left out, calls for one more).
            end = len(records) if limit is None else at + limit - len(out)
            out.extend(measure_records(records[at:end], tokenizer, source=source,
                                       shard_name=shard_name, on_skip=on_skip))
            at = end
        return limit is not None and len(out) >= limit

    for start, end in stream.ranges():
        if add(stream.decode(await store.read_range(shard.uri, start, end))):
            break
    else:
        add(stream.finish())
    return DocumentLengths(np.array(out, dtype=np.int64), "scan")
