"""Exceptions. Every message names what the user needs to find the problem:
the source, the URI or shard, and the record where there is one."""
from __future__ import annotations


class StreamloadError(Exception):
    """Base class of every error streamload raises on purpose."""


class ConfigError(StreamloadError, ValueError):
    """A bad argument or configuration value. The message names the key."""


class StorageError(StreamloadError, OSError):
    """An object could not be listed or read (missing bucket, no match, retries exhausted)."""

    def __init__(self, message: str, uri: str | None = None):
        super().__init__(message)
        self.uri = uri


class DataError(StreamloadError, ValueError):
    """A shard or record could not be decoded."""

    def __init__(self, message: str, *, source: str | None = None, shard: str | None = None,
                 record: int | None = None):
        where = ", ".join(
            part for part in (
                f"source {source!r}" if source is not None else "",
                f"shard {shard!r}" if shard is not None else "",
                f"record {record}" if record is not None else "",
            ) if part
        )
        super().__init__(f"{where}: {message}" if where else message)
        self.source, self.shard, self.record = source, shard, record


class DistributedError(StreamloadError, RuntimeError):
    """A collective failed or another rank went away."""
