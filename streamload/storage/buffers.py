"""Buffers for a range's bytes that are anonymous mappings of their own, out of the C allocator.

A ranged read's body (1 MiB by default) lives from its GET until its range is decoded, a few
hundred milliseconds later, on another thread. As `bytes` it comes from glibc's malloc, and once
glibc has raised its dynamic mmap threshold (it does so whenever a freed mmapped block was
bigger: botocore's JSON models, read when the S3 client is made, take it to ~2.8 MB), blocks of
that size come from the threads' arenas, which keep the memory after it is freed. A buffer from
`mapped_buffer` is an `mmap` of its own: unmapped, so back to the system, when its last
reference goes, whatever the process's allocator settings (docs/benchmarks.md, rss9).

A reader that asks a store for its bytes in such a buffer (`ObjectStore.read_range(...,
buffer=mapped_buffer)`) must take a `bytes`-like object with `find`, `rfind`, slicing and the
buffer protocol, but neither `count` nor `startswith` (which `mmap` lacks).
"""
from __future__ import annotations

import mmap

# Below this a buffer is a plain bytearray: too small to matter to the arenas, and a mapping
# costs a system call each way.
MAPPED_BYTES = 128 * 1024
# The pages are faulted in by the mmap call itself (one system call, not one fault per page):
# the body is written whole right after.
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def mapped_buffer(size: int) -> mmap.mmap | bytearray:
    """A writable buffer of `size` bytes: its own anonymous mapping from MAPPED_BYTES on, a
    bytearray below. Its contents are zeros."""
    if size < MAPPED_BYTES:
        return bytearray(size)
    return mmap.mmap(-1, size, flags=_FLAGS)
