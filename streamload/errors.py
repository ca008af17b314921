"""Exceptions. Every message names what the user needs to find the problem:
the source, the URI or shard, and the record where there is one."""
from __future__ import annotations


class StreamloadError(Exception):
    """Base class of every error streamload raises on purpose."""


class ConfigError(StreamloadError, ValueError):
    """A bad argument or configuration value. The message names the key.

    `key` is what is wrong: an option ("planner"), a field of the struct that raised the error
    ("weight" for a Source, "quotas[1].fraction" for a Mixture) or, from a configuration file,
    the key path in the file ("loader.planner", "source[1].weight"); None where no one key is
    at fault. `problem` is what is wrong with it, without the key or any context (the whole
    message when there is no key). Code that adds context, a file name or a key path prefix,
    builds a new error from these two fields (`ConfigError.at`), never from the message text.
    """

    def __init__(self, message: str, *, key: str | None = None, problem: str | None = None):
        super().__init__(message)
        self.key = key
        self.problem = message if problem is None else problem

    @classmethod
    def at(cls, key: str, problem: str, *, where: str = "") -> "ConfigError":
        """The error '<where><key>: <problem>', e.g. ConfigError.at("epochs", "must be ...") or,
        with context, ConfigError.at("source[1].weight", "must be ...", where="train.toml: ")."""
        return cls(f"{where}{key}: {problem}", key=key, problem=problem)


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
