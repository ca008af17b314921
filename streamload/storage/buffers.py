"""Byte buffers of the data path (a block's text, a ranged GET's body) allocated out of the C
allocator's arenas.

Blocks of ~1 MB made on the fetch threads and freed later on another thread are the RSS climb
docs/benchmarks.md traces (rss8, hot7): once glibc has raised its dynamic mmap threshold (a freed
mmapped chunk of ~2 MiB raises it), such blocks come from the threads' arenas, and the holes they
leave as they are freed in another order are kept. A buffer of `MAPPED_BYTES` or more here is
its own anonymous mapping (`mmap`), returned to the system when its last view goes, whatever the
process's allocator settings; smaller ones come from NumPy as before."""
from __future__ import annotations

import mmap
from typing import Iterable

import numpy as np

MAPPED_BYTES = 256 * 1024   # from this size a buffer is a mapping of its own
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def byte_buffer(size: int) -> np.ndarray:
    """A writable uint8 array of `size` bytes (contents undefined below MAPPED_BYTES, zero
    from it), a mapping of its own from MAPPED_BYTES on (pages faulted in at once)."""
    if size < MAPPED_BYTES:
        return np.empty(size, np.uint8)
    return np.frombuffer(mmap.mmap(-1, size, flags=_FLAGS), np.uint8)


def joined(pieces: Iterable[bytes], size: int) -> np.ndarray:
    """`pieces` one after another in one `byte_buffer` of `size` bytes, their total length."""
    out = byte_buffer(size)
    view, at = memoryview(out), 0
    for piece in pieces:
        end = at + len(piece)
        view[at:end] = piece
        at = end
    if at != size:
        raise ValueError(f"pieces of {at} bytes for a buffer of {size}")
    return out
