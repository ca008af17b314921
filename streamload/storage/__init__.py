"""Storage: list objects under a URI and read byte ranges, asynchronously, with retries.

open_store() picks the store for a URI's scheme: s3:// -> S3Store (aiobotocore), a plain path
or file:// -> LocalStore, anything else -> FsspecStore.
"""
from __future__ import annotations

from typing import Any

from streamload.errors import ConfigError
from streamload.storage.base import ObjectInfo, ObjectStore, StoreCounters
from streamload.storage.listing import relative_name, scheme_of
from streamload.storage.retry import RetryPolicy

__all__ = [
    "ObjectInfo", "ObjectStore", "RetryPolicy", "StoreCounters", "open_store", "relative_name",
    "source_store_options",
]


def source_store_options(uri: str, shared_options: dict[str, Any] | None,
                         own_options: dict[str, Any] | None) -> dict[str, Any]:
    """The storage options a source's store gets: the options shared by every source (the
    loader's `storage_options`, e.g. an S3 endpoint) when `uri` is remote, since local paths
    take none, overridden key by key by the source's own `storage_options`. `{}` when there are
    none. The local test is `open_store`'s: a plain path or file:// (scheme_of)."""
    shared = shared_options if shared_options and scheme_of(uri) not in ("", "file") else {}
    return {**shared, **(own_options or {})}


def open_store(uri: str, storage_options: dict[str, Any] | None = None, *,
               retry: RetryPolicy | None = None, max_concurrency: int = 16) -> ObjectStore:
    """A store that can list and read `uri` and its neighbours. Close it with `await aclose()`."""
    scheme = scheme_of(uri)
    if scheme == "s3":
        from streamload.storage.s3 import S3Store  # imports aiobotocore only when needed

        return S3Store(storage_options, retry=retry, max_concurrency=max_concurrency)
    from streamload.storage.fs import FsspecStore, LocalStore

    if scheme in ("", "file"):
        if storage_options:
            raise ConfigError(f"local paths take no storage_options, got {sorted(storage_options)}"
                              f" for {uri}")
        return LocalStore(retry=retry, max_concurrency=max_concurrency)
    return FsspecStore(scheme, storage_options, retry=retry, max_concurrency=max_concurrency)
