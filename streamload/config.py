"""Configuration: msgspec structs, validated once at the boundary. Errors name the key."""
from __future__ import annotations

import math
import re
from typing import Literal, Optional

import msgspec

from .errors import ConfigError
from .storage.retry import RetryPolicy

OnError = Literal["raise", "skip"]
LongDocuments = Literal["split", "truncate", "drop"]
_GLOB = re.compile(r"[*?\[]")


def default_source_name(uri: str) -> str:
    """'s3://bucket/web/' -> 'web'; '/data/code/*.jsonl.zst' -> 'code'; 'a/b.jsonl' -> 'b'."""
    path = uri.split("://", 1)[-1]
    parts = [p for p in path.split("/") if p]
    while parts and _GLOB.search(parts[-1]):
        parts.pop()
    if not parts:
        return "source"
    name = parts[-1]
    if len(parts) > 1 and "." in name and not uri.endswith("/"):
        name = name.split(".", 1)[0]   # a single file: its stem
    return name


class Source(msgspec.Struct):
    """One data source: a URI (prefix, directory or glob; s3://, local, file:// or fsspec)."""
    uri: str
    weight: float = 1.0
    name: Optional[str] = None
    text_field: str = "text"
    format: Optional[str] = None          # "jsonl" | "tokens"; None = by file name
    storage_options: Optional[dict] = None
    # When this source runs out in an epoch: the others go on by their weights ("renormalize"),
    # the whole run stops ("stop"), or it never runs out: it starts its next shuffled pass and
    # keeps its weight, while the other sources end the epoch ("restart").
    on_exhausted: Literal["renormalize", "stop", "restart"] = "renormalize"
    repeat: int = 1                       # passes over this source per epoch (upsampling)

    def __post_init__(self):
        if not isinstance(self.uri, str) or not self.uri:
            raise ConfigError(f"source uri: must be a non-empty string, got {self.uri!r}")
        if self.name is None:
            self.name = default_source_name(self.uri)
        if "/" in self.name or not self.name:
            raise ConfigError(f"source {self.name!r} ({self.uri}): name must be non-empty and contain no '/'")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) \
                or not math.isfinite(self.weight) or self.weight <= 0:
            raise ConfigError(f"source {self.name!r} ({self.uri}): weight must be a positive number, "
                              f"got {self.weight!r}")
        self.weight = float(self.weight)
        if isinstance(self.repeat, bool) or not isinstance(self.repeat, int) or self.repeat < 1:
            raise ConfigError(f"source {self.name!r} ({self.uri}): repeat must be an integer >= 1, "
                              f"got {self.repeat!r}")
        if self.on_exhausted not in ("renormalize", "stop", "restart"):
            raise ConfigError(f"source {self.name!r} ({self.uri}): on_exhausted must be "
                              f"'renormalize', 'stop' or 'restart', got {self.on_exhausted!r}")
        if self.format not in (None, "jsonl", "tokens"):
            raise ConfigError(f"source {self.name!r} ({self.uri}): format must be 'jsonl' or 'tokens', "
                              f"got {self.format!r}")


class LoaderConfig(msgspec.Struct, kw_only=True):
    """Everything about a Loader except the sources and the tokenizer callable."""
    micro_batch_tokens: int = 4096          # C: token capacity of one packed row
    micro_batches: int = 2                  # M: rows per rank per step
    seed: int = 0
    epochs: Optional[int] = None            # None: infinite, reshuffled every epoch
    on_error: OnError = "raise"
    long_documents: LongDocuments = "split"
    planner: str = "balanced"               # "naive" | "balanced" | "lookahead"
    lookahead: int = 4                      # W for planner="lookahead" (also its max deferral)
    max_deferral: Optional[int] = 8         # a sample offered this many steps is taken first
    step_overhead: float = 0.05             # per-step cost the planner weighs against an empty
                                            # slot: this share of a rank's full step at b/token
    window_factor: float = 2.0              # head window per source per rank, in steps of quota
    buffer_tokens: Optional[int] = None     # per source per rank; default: 2 windows + one row
    prefetch_steps: int = 2                 # planned batches queued ahead of the trainer
    memory_budget: Optional[int] = None     # bytes per rank for buffers and data in flight;
                                            # None: 32 MiB, more if the sources need it
    shard_prefetch: int = 2                 # shards read at once per source (initial; adapts)
    range_readahead: int = 2                # byte ranges in flight per shard (initial; adapts)
    max_shard_prefetch: int = 8             # the autoscaler's ceilings
    max_range_readahead: int = 8
    autoscale: bool = True                  # adapt the two knobs to measured waits
    chunk_bytes: int = 1 << 20              # size of one ranged read
    max_concurrency: int = 16               # concurrent requests per store
    transform_workers: int = 2              # threads for decode + tokenize
    tokenize_in: Literal["threads", "processes"] = "threads"   # processes: GIL-bound tokenizers
    tokenizer_processes: int = 2            # size of that process pool
    collective_timeout_s: float = 300.0     # a collective waiting longer than this fails
    retry: RetryPolicy = RetryPolicy()      # storage retries, backoff, per-request timeout
    cost_a: float = 1.0 / 4096              # cost model: a*L^2 + b*L per document
    cost_b: float = 1.0
    document_masking: bool = True

    def __post_init__(self):
        def positive_int(key):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}: must be an integer >= 1, got {value!r}")
        for key in ("micro_batch_tokens", "micro_batches", "prefetch_steps", "shard_prefetch",
                    "range_readahead", "chunk_bytes", "max_concurrency", "transform_workers",
                    "lookahead", "max_shard_prefetch", "max_range_readahead",
                    "tokenizer_processes"):
            positive_int(key)
        if self.epochs is not None:
            positive_int("epochs")
        if self.max_deferral is not None:
            positive_int("max_deferral")
        if self.memory_budget is not None:
            positive_int("memory_budget")
        if self.buffer_tokens is not None:
            positive_int("buffer_tokens")
            if self.buffer_tokens < self.micro_batch_tokens:
                raise ConfigError(f"buffer_tokens: must be >= micro_batch_tokens "
                                  f"({self.micro_batch_tokens}), got {self.buffer_tokens}")
        if not (self.window_factor > 0 and math.isfinite(self.window_factor)):
            raise ConfigError(f"window_factor: must be a positive number, got {self.window_factor!r}")
        if isinstance(self.step_overhead, bool) or not isinstance(self.step_overhead, (int, float)) \
                or not (math.isfinite(self.step_overhead) and self.step_overhead >= 0):
            raise ConfigError(f"step_overhead: must be a number >= 0, got {self.step_overhead!r}")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"collective_timeout_s: must be > 0, got {self.collective_timeout_s!r}")
        if self.on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error: must be 'raise' or 'skip', got {self.on_error!r}")
        if self.long_documents not in ("split", "truncate", "drop"):
            raise ConfigError(f"long_documents: must be 'split', 'truncate' or 'drop', "
                              f"got {self.long_documents!r}")


def make_config(**options) -> LoaderConfig:
    """Build a LoaderConfig from keyword options; unknown keys and wrong types are ConfigErrors."""
    known = set(LoaderConfig.__struct_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return msgspec.convert(options, LoaderConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None
