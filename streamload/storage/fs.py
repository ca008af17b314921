"""Local files (plain paths, file://) and any other fsspec filesystem (memory://, gcs://, ...).

Both do blocking I/O, so each call runs in a worker thread, under the store's concurrency bound
and the shared retry helper. Listing follows the same rules as S3Store: an exact file returns
itself, a directory lists its files recursively, and a glob (see listing.py) filters a walk of
the directory above its first wildcard.
"""
from __future__ import annotations

import asyncio
import difflib
import errno
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from streamload.errors import ConfigError, StorageError
from streamload.storage.base import ObjectInfo, StoreCounters
from streamload.storage.listing import (
    glob_base,
    glob_depth,
    glob_regex,
    has_glob,
    literal_prefix,
    local_path,
)
from streamload.storage.retry import RetryPolicy, describe, with_retries

T = TypeVar("T")

# Network filesystems (NFS, Lustre, FUSE mounts of object stores) report hiccups with these.
_TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EINTR, errno.EIO, errno.ETIMEDOUT, errno.ESTALE})


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def _storage_error(exc: OSError, uri: str) -> StorageError:
    if isinstance(exc, FileNotFoundError):
        return StorageError(f"no such file or directory: {uri}", uri=uri, missing=True)
    if isinstance(exc, IsADirectoryError):
        return StorageError(f"{uri} is a directory, not a file", uri=uri)
    if isinstance(exc, PermissionError):
        return StorageError(f"permission denied: {uri}", uri=uri)
    return StorageError(f"{uri}: {describe(exc)}", uri=uri)


class _ThreadedStore:
    """The async half shared by stores whose I/O blocks: subclasses give _read and _list."""

    def __init__(self, *, retry: RetryPolicy | None, max_concurrency: int):
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.counters = StoreCounters()
        self.retry = retry or RetryPolicy()
        self.max_concurrency = max_concurrency
        self._slots = asyncio.Semaphore(max_concurrency)

    def _read(self, uri: str, start: int, end: int,
              buffer: Callable[[int], Any] | None = None) -> Any:
        raise NotImplementedError

    def _list(self, uri: str) -> list[ObjectInfo]:
        raise NotImplementedError

    async def _run(self, uri: str, fn: Callable[..., T], *args: Any,
                   counters: StoreCounters | None = None) -> T:
        counters = counters or self.counters

        async def attempt() -> T:
            counters.requests += 1
            return await asyncio.to_thread(fn, *args)

        async with self._slots:
            try:
                return await with_retries(attempt, policy=self.retry, what=uri,
                                          counters=counters, is_retryable=is_retryable)
            except StorageError:  # already says what went wrong (and is an OSError too)
                raise
            except OSError as exc:
                raise _storage_error(exc, uri) from exc

    async def read_range(self, uri: str, start: int, end: int, *,
                         counters: StoreCounters | None = None,
                         buffer: Callable[[int], Any] | None = None) -> Any:
        if not 0 <= start <= end:
            raise ValueError(f"bad byte range [{start}, {end}) for {uri}")
        if start == end:
            return b""
        counters = counters or self.counters
        began = time.perf_counter()
        data = await self._run(uri, self._read, uri, start, end, buffer, counters=counters)
        counters.record_latency(time.perf_counter() - began)
        counters.bytes_read += len(data)
        return data

    async def list(self, uri: str) -> list[ObjectInfo]:
        return sorted(await self._run(uri, self._list, uri))

    async def aclose(self) -> None:
        """Nothing pooled to release."""

    async def __aenter__(self) -> _ThreadedStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _pread_all(path: str, start: int, end: int,
               buffer: Callable[[int], Any] | None = None) -> Any:
    """Bytes [start, end) of a file; fewer at its end. pread may return short, so loop.
    With `buffer`: read into `buffer(length)` (the length the file holds), returned."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if buffer is not None:
            out = buffer(max(0, min(end, os.fstat(fd).st_size) - start))
            with memoryview(out) as view:
                at = 0
                while at < len(view):
                    read = os.preadv(fd, [view[at:]], start + at)
                    if not read:   # the file shrank under us: say so, as a short read would
                        raise OSError(errno.EIO, f"{path} ended at byte {start + at}, "
                                                 f"{len(view) - at} bytes short")
                    at += read
            return out
        parts, offset = [], start
        while offset < end:
            chunk = os.pread(fd, end - offset, offset)
            if not chunk:
                break
            parts.append(chunk)
            offset += len(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def _may_hold(directory: str, literal: str) -> bool:
    """Whether files under `directory` (ending in '/') can start with `literal`."""
    return directory.startswith(literal) or literal.startswith(directory)


def _walk_files(top: str, pattern: str | None = None) -> list[ObjectInfo]:
    """Files under `top`, recursively; with a glob `pattern`, only those matching it. Walks no
    deeper than the pattern can match, and skips directories outside its literal prefix."""
    regex = glob_regex(pattern) if pattern else None
    depth = glob_depth(pattern) if pattern else None
    literal = literal_prefix(pattern) if pattern else ""
    found = []
    for root, dirs, files in os.walk(top):
        level = 0 if root == top else os.path.relpath(root, top).count(os.sep) + 1
        dirs[:] = [d for d in dirs
                   if (depth is None or level + 1 < depth)
                   and _may_hold(os.path.join(root, d) + "/", literal)]
        for name in files:
            path = os.path.join(root, name)
            if regex is None or regex.fullmatch(path):
                found.append(ObjectInfo(path, os.stat(path).st_size))
    return found


class LocalStore(_ThreadedStore):
    """ObjectStore for local paths and file:// URIs. Returns absolute plain paths as URIs."""

    def __init__(self, *, retry: RetryPolicy | None = None, max_concurrency: int = 16):
        super().__init__(retry=retry, max_concurrency=max_concurrency)

    def _read(self, uri: str, start: int, end: int,
              buffer: Callable[[int], Any] | None = None) -> Any:
        return _pread_all(local_path(uri), start, end, buffer)

    def _list(self, uri: str) -> list[ObjectInfo]:
        path = local_path(uri)
        if has_glob(path):
            found = _walk_files(glob_base(path) or "/", path)
            if not found:
                raise StorageError(f"no files match {uri}", uri=uri)
            return found
        if os.path.isfile(path):
            return [ObjectInfo(path, os.stat(path).st_size)]
        if not os.path.isdir(path):
            raise StorageError(f"no such file or directory: {uri}", uri=uri)
        found = _walk_files(path)
        if not found:
            raise StorageError(f"directory {uri} holds no files", uri=uri)
        return found


class FsspecStore(_ThreadedStore):
    """ObjectStore for any other fsspec protocol. URIs come back as "<protocol>://<path>", with
    the path in the filesystem's own form (e.g. "memory:///dir/a.jsonl")."""

    def __init__(self, protocol: str, storage_options: dict[str, Any] | None = None, *,
                 retry: RetryPolicy | None = None, max_concurrency: int = 16):
        import fsspec  # here, so that local-only and S3-only users never pay for it

        super().__init__(retry=retry, max_concurrency=max_concurrency)
        self.protocol = protocol
        try:
            self.fs = fsspec.filesystem(protocol, **(storage_options or {}))
        except ImportError as exc:   # fsspec knows the protocol; its package is not installed
            raise ConfigError(f"{protocol}:// URIs: {exc}", key="uri") from None
        except ValueError as exc:   # "Protocol not known: gcss"
            close = difflib.get_close_matches(protocol, fsspec.available_protocols(), n=1)
            hint = f"; did you mean {close[0]}://?" if close else ""
            raise ConfigError(f"{protocol}:// URIs: {exc}{hint}", key="uri") from None
        except TypeError as exc:   # an option the filesystem does not take
            raise ConfigError(f"storage_options for {protocol}:// URIs: {exc}",
                              key="storage_options") from None

    def _uri(self, path: str) -> str:
        return f"{self.protocol}://{path}"

    def _read(self, uri: str, start: int, end: int,
              buffer: Callable[[int], Any] | None = None) -> bytes:
        """Bytes, whatever `buffer` says: fsspec hands them over whole."""
        return self.fs.cat_file(self.fs._strip_protocol(uri), start, end)

    def _files(self, top: str, maxdepth: int | None = None) -> dict[str, dict[str, Any]]:
        try:
            entries = self.fs.find(top, maxdepth=maxdepth, withdirs=False, detail=True)
        except FileNotFoundError:
            return {}
        return {name: info for name, info in entries.items() if info.get("type") == "file"}

    def _list(self, uri: str) -> list[ObjectInfo]:
        path = self.fs._strip_protocol(uri)
        if has_glob(path):
            regex = glob_regex(path)
            entries = self._files(glob_base(path), glob_depth(path))
            found = [ObjectInfo(self._uri(name), int(info["size"]))
                     for name, info in entries.items() if regex.fullmatch(name)]
            if not found:
                raise StorageError(f"no files match {uri}", uri=uri)
            return found
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            raise StorageError(f"no such file or directory: {uri}", uri=uri) from None
        if info.get("type") != "directory":
            return [ObjectInfo(self._uri(info["name"]), int(info["size"]))]
        found = [ObjectInfo(self._uri(name), int(info["size"]))
                 for name, info in self._files(path).items()]
        if not found:
            raise StorageError(f"directory {uri} holds no files", uri=uri)
        return found
