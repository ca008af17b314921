"""Exceptions. Every message names what the user needs to find the problem:
the source, the URI or shard, and the record where there is one."""
from __future__ import annotations

import difflib


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

    def __init__(self, message: str, uri: str | None = None, missing: bool = False):
        super().__init__(message)
        self.uri = uri
        self.missing = missing   # the object does not exist (not found, 404)


# What a DataError that on_error="skip" would have skipped says about it: the one place of
# this hint, so every format's errors give it alike.
SKIP_RECORDS_HINT = 'To skip bad records and count them in stats(), set on_error="skip".'
SKIP_SHARDS_HINT = ('To skip the rest of a bad shard and count it in stats(), set '
                    'on_error="skip".')


class DataError(StreamloadError, ValueError):
    """A shard or record could not be decoded.

    The message starts with where: `source 'web', shard 'part-3.jsonl', record 41 (line 42)`.
    `record` is the record index as in sample ids (0-based); `line` is the 1-based line of the
    record in the decompressed shard, for line-based formats (JSONL), so that an editor finds it.
    An error that `on_error="skip"` would have skipped says so: every error with a `record`, and
    a shard's error given `skippable=True`."""

    def __init__(self, message: str, *, source: str | None = None, shard: str | None = None,
                 record: int | None = None, line: int | None = None,
                 skippable: bool | None = None):
        at = None
        if record is not None:
            at = f"record {record}" + (f" (line {line})" if line is not None else "")
        elif line is not None:
            at = f"line {line}"
        where = ", ".join(
            part for part in (
                f"source {source!r}" if source is not None else "",
                f"shard {shard!r}" if shard is not None else "",
                at or "",
            ) if part
        )
        text = f"{where}: {message}" if where else message
        if skippable is None:
            skippable = record is not None
        if skippable:
            hint = SKIP_RECORDS_HINT if record is not None or line is not None \
                else SKIP_SHARDS_HINT
            text = f"{text}. {hint}"
        super().__init__(text)
        self.source, self.shard, self.record, self.line = source, shard, record, line


class DistributedError(StreamloadError, RuntimeError):
    """A collective failed or another rank went away."""


class UsageError(StreamloadError, RuntimeError):
    """A call the object cannot take in its present state (e.g. `Loader.load_state_dict()`
    after iterating began). The message says when the call is allowed."""


def did_you_mean(name: str, known) -> str:
    """"; did you mean 'micro_batch_tokens'?" for the closest of `known`, or ""."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
