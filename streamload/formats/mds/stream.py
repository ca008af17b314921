"""Reading one MDS shard: a raw shard by ranges of samples (`MdsRawStream`), a compressed one
whole, decompressed (`MdsCompressedStream`).
"""
from __future__ import annotations

import bz2
import gzip
import zlib
from typing import Optional

import numpy as np
import zstandard

from ..base import BadShard, PlannedStream, Problems, RawRecord, Records
from .index import Entry
from .layouts import Decoder, check_header


DECOMPRESSORS = ("zstd", "gz", "bz2")


# ---------------------------------------------------------------- streams


class MdsRawStream(PlannedStream):
    """An uncompressed shard: samples read by range, consecutive ones coalesced."""

    def __init__(self, decoder: Decoder, offsets: np.ndarray, chunk_bytes: int, *,
                 problems: Problems):
        super().__init__(problems)
        self._decoder = decoder
        self._offsets = offsets
        self._runs = []
        n, first = len(offsets) - 1, 0
        while first < n:
            end = int(np.searchsorted(offsets, offsets[first] + chunk_bytes, side="right")) - 1
            end = min(max(end, first + 1), n)
            self._runs.append((first, end))
            first = end
        self._ranges = [(int(offsets[a]), int(offsets[b])) for a, b in self._runs]

    def decode(self, chunk: bytes) -> list[RawRecord]:
        first, end, start = self._next_run(chunk, "samples")
        bounds = self._offsets[first:end + 1] - start
        return self._decoder.records(chunk, bounds[:-1], bounds[1:], first)

    def decode_columns(self, chunk: bytes) -> Records:
        first, end, start = self._next_run(chunk, "samples")
        bounds = self._offsets[first:end + 1] - start
        return self._decoder.columns(chunk, bounds[:-1], bounds[1:], first)

    def finish(self) -> list[RawRecord]:
        return []


class MdsCompressedStream(PlannedStream):
    """A compressed shard: read whole (one range), decompressed, then decoded."""

    def __init__(self, decoder: Decoder, entry: Entry, size: int, *, problems: Problems):
        super().__init__(problems)
        self._decoder, self._entry, self._size = decoder, entry, size
        self._ranges = [(0, size)]

    def decode(self, chunk: bytes) -> list[RawRecord]:
        samples = self._samples(chunk)
        return [] if samples is None else self._decoder.records(*samples)

    def decode_columns(self, chunk: bytes) -> Records:
        samples = self._samples(chunk)
        return Records.empty() if samples is None else self._decoder.columns(*samples)

    def _samples(self, chunk: bytes) -> Optional[tuple[bytes, np.ndarray, np.ndarray, int]]:
        """(data, starts, ends, first) of the shard's samples, decompressed; None when the
        shard is corrupt (reported)."""
        self._next_range()
        try:
            if len(chunk) != self._size:
                raise BadShard(f"expected {self._size} bytes, got {len(chunk)}")
            data = self._decompress(chunk)
            entry = self._entry
            if entry.raw_bytes is not None and len(data) != entry.raw_bytes:
                raise BadShard(f"decompresses to {len(data)} bytes, the index says "
                                f"{entry.raw_bytes}")
            offsets = check_header(data[:4 * (entry.samples + 2)], entry.samples, len(data),
                                    f"the decompressed shard ({entry.raw})")
        except BadShard as exc:
            self._shard_error(str(exc))   # says that on_error="skip" would skip it
            return None
        return data, offsets[:-1], offsets[1:], 0

    def finish(self) -> list[RawRecord]:
        return []

    def _decompress(self, chunk: bytes) -> bytes:
        algo = self._entry.compression
        try:
            if algo == "zstd":
                inflater = zstandard.ZstdDecompressor().decompressobj()
                data = inflater.decompress(chunk)
                if not inflater.eof:
                    raise BadShard("corrupt zstd data: the stream is truncated")
                return data
            if algo == "gz":
                return gzip.decompress(chunk)
            return bz2.decompress(chunk)
        except (zstandard.ZstdError, zlib.error, OSError, EOFError, ValueError) as exc:
            raise BadShard(f"corrupt {algo} data: {exc}") from None
