"""Configuration: msgspec structs, validated once at the boundary. Errors name the key."""
from __future__ import annotations

import functools
import math
import numbers
import re
import typing
from typing import Any, Literal, Optional

import msgspec

from .errors import ConfigError, did_you_mean
from .plan.planner import PlannerMethod
from .storage.retry import RetryPolicy
from .vision.options import Images

OnError = Literal["raise", "skip"]
LongDocuments = Literal["split", "truncate", "drop"]
OnExhausted = Literal["renormalize", "stop", "restart"]
# Shard formats (`streamload.formats`); None on a Source: detected from the file names.
FormatName = Literal["jsonl", "tokens", "parquet", "megatron", "mds", "litdata", "webdataset"]
_GLOB = re.compile(r"[*?\[]")


def convert(value: Any, type_: Any, key: str, *, where: str = "") -> Any:
    """`value` as `type_` the msgspec way (no bool for numbers, ints accepted for floats, a
    table for a struct), or a ConfigError keyed `key`. A Literal's error lists the choices."""
    value = _plain_number(value)   # numpy.int64, numpy.float64, ...
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        cause = exc.__cause__
        if isinstance(cause, ConfigError):   # a struct's own check, e.g. RetryPolicy's
            raise ConfigError.at(f"{key}.{cause.key}" if cause.key else key, cause.problem,
                                 where=where) from None
        choices = _literal_choices(type_)
        if choices is not None:
            problem = _choices_problem(choices, value)
        else:
            problem = str(exc).replace("`", "")
            if repr(value) not in problem:
                problem = f"{problem} ({value!r})"
        raise ConfigError.at(key, problem, where=where) from None


def _literal_choices(type_: Any) -> Optional[tuple]:
    """The values of a Literal type, or of an Optional Literal; None for any other type."""
    if typing.get_origin(type_) is Literal:
        return typing.get_args(type_)
    args = [a for a in typing.get_args(type_) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(args[0]) is Literal:
        return typing.get_args(args[0])
    return None


@functools.cache
def field_types(struct: type) -> dict[str, Any]:
    """{field name: type} of a msgspec struct class (subclasses' own fields included)."""
    return {f.name: f.type for f in msgspec.structs.fields(struct)}


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
    # Relative (any scale). 0 leaves the source out while the others have data, as in a
    # Mixture's weights; one source at least must weigh more than 0 (`Mixture.check`).
    weight: float = 1.0
    name: Optional[str] = None
    # The field (JSONL, Parquet column, MDS/LitData field) or tar member extension holding the
    # text; None: the format's default ("text"; "txt" for WebDataset tars).
    text_field: Optional[str] = None
    # A field of token ids (a Parquet list<int> column, an MDS/LitData ndarray field) read
    # instead of text; None: text.
    tokens_field: Optional[str] = None
    format: Optional[FormatName] = None   # None: detected from the file names
    storage_options: Optional[dict] = None
    # When this source runs out in an epoch: the others go on by their weights ("renormalize"),
    # the whole run stops ("stop"), or it never runs out: it starts its next shuffled pass and
    # keeps its weight, while the other sources end the epoch ("restart").
    on_exhausted: OnExhausted = "renormalize"
    repeat: int = 1                       # passes over this source per epoch (upsampling)
    # DP ranks that read this source's shards (the others get its items through the step's
    # exchange). None: chosen from its share, read_cost and shard count (`plan/readers.py`);
    # more than the ranks or the shards reads on all of them (clamped).
    readers: Optional[int] = None
    read_cost: float = 1.0                # relative cost per token of reading it (decoding,
                                          # tokenizing): a costlier source gets more readers
    # Image-text samples (`vision.Images`: which members or column hold images, the resizing
    # rule, the placeholder ids); None: text only.
    images: Optional[Images] = None

    def __post_init__(self):
        """Every field converted to its type and checked; a ConfigError's `key` is the field."""
        self.uri = convert(self.uri, str, "uri", where="source ")
        if not self.uri:
            raise ConfigError.at("uri", "must not be empty", where="source ")
        self.name = convert(self.name, Optional[str], "name", where=f"source ({self.uri}): ")
        if self.name is None:
            self.name = default_source_name(self.uri)
        where = f"source {self.name!r} ({self.uri}): "
        if "/" in self.name or not self.name:
            raise ConfigError.at("name", "must be non-empty and contain no '/'", where=where)
        for key, type_ in field_types(type(self)).items():
            if key not in ("uri", "name"):
                setattr(self, key, convert(getattr(self, key), type_, key, where=where))
        if not (math.isfinite(self.weight) and self.weight >= 0):   # a Mixture weight's rule
            raise ConfigError.at("weight", f"must be a finite number >= 0, got {self.weight!r}",
                                 where=where)
        if self.repeat < 1:
            raise ConfigError.at("repeat", f"must be an integer >= 1, got {self.repeat!r}",
                                 where=where)
        if self.readers is not None and self.readers < 1:
            raise ConfigError.at("readers", f"must be an integer >= 1 (or None: chosen for it), "
                                 f"got {self.readers!r}", where=where)
        if not (math.isfinite(self.read_cost) and self.read_cost > 0):
            raise ConfigError.at("read_cost", f"must be a finite number > 0, got "
                                 f"{self.read_cost!r}", where=where)


class LoaderConfig(msgspec.Struct, kw_only=True):
    """Everything about a Loader except the sources and the tokenizer callable."""
    micro_batch_tokens: int = 4096          # C: token capacity of one packed row
    micro_batches: int = 2                  # M: rows per rank per step
    seed: int = 0
    epochs: Optional[int] = None            # None: infinite, reshuffled every epoch
    on_error: OnError = "raise"
    # on_error="skip": a source skipping more than this share of its records (once a rank read
    # 100), or all of its first 100, raises a DataError; 1.0 turns the limit off.
    max_skip_fraction: float = 0.1
    long_documents: LongDocuments = "split"
    planner: PlannerMethod = "lookahead"    # "naive" | "balanced" | "lookahead" (the default:
                                            # it groups outliers across steps, issue 20)
    # W for planner="lookahead" (deferral <= 2W). 8: a window that shows every slot a long
    # document like the others often enough (at W = 4 and one row per rank, long documents
    # waited for company until forced, and their sources' forced items pushed the mix 0.05 off)
    lookahead: int = 8
    max_deferral: Optional[int] = 16        # a sample offered this many steps is taken first
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
    # How the DP ranks agree on a step. "gather": the windows go to rank 0 only (through one
    # leader per node on more than one node), which alone steps the job model and sends each
    # rank its own part of the plan; the others get the state from rank 0 (`state_relay`).
    # "all_gather": every rank receives every rank's windows and the whole plan, and tracks
    # the whole job. "auto": gather (with delivery="broadcast" too: over the DP ranks'
    # leaders, rank 0 sending each leader every step's state for its ranks)
    control_plane: Literal["auto", "all_gather", "gather"] = "auto"
    state_every: Optional[int] = None       # under gather: rank 0 also sends every rank the
                                            # state unasked after each step that is a multiple
    retry: RetryPolicy = RetryPolicy()      # storage retries, backoff, per-request timeout
    # Cost model: a*L^2 + b*L per document. The default is a d_model = 4096 decoder (7B class:
    # CostModel.transformer gives a/b = n_layers*d_model/n_params ~ 1/49152 there); set yours
    # with CostModel.transformer(...).a/.b ratios or `streamload calibrate`.
    cost_a: float = 1.0 / 49152
    cost_b: float = 1.0
    # P: pipeline stages of the 1F1B cost model (a rank's step waits on its costliest row too);
    # None: the topology's pp (`parallel` / `mesh`), else 1.
    pipeline_stages: Optional[int] = None
    document_masking: bool = True
    pad_to: Optional[Literal["capacity"]] = None   # "capacity": every row exactly C tokens
    pad_token_id: int = 0                   # the padding's token id (with pad_to)
    # Image sources: decode and resize a step's images in this many worker processes (or daemon
    # threads, "threads": Pillow releases the GIL in its decoder and resampler).
    image_workers: int = 2
    decode_images_in: Literal["processes", "threads"] = "processes"
    # Image sources' cost (issue 23): "hybrid" (the default) plans each image sample at
    # encoder(its images) + backbone(its fused length), the encoder's part from its patches per
    # image (known from the headers) as encoder_cost_a*P^2 + encoder_cost_b*P per image, in the
    # units of cost_a/cost_b; "backbone": the fused length only, as a text sample.
    # The default coefficients: a ViT-600M-like encoder (32 layers, width 1280, bidirectional)
    # against a 7B-like backbone at cost_b = 1 (`vision.cost.EncoderCost.relative_to`).
    image_cost: Literal["hybrid", "backbone"] = "hybrid"
    # Caps per row on what it feeds the vision encoder (OmniBal's caps per packed group):
    # at most this many images and encoder patches in any micro-batch row. None: no cap (a
    # row's tokens are capped at micro_batch_tokens anyway). The planner obeys them
    # (`plan/caps.py`); a sample that alone exceeds one is a record error naming it.
    max_images_per_row: Optional[int] = None
    max_patches_per_row: Optional[int] = None
    encoder_cost_a: float = 12.0 * 32 * 1280 / 42e9
    encoder_cost_b: float = 3.6e9 / 42e9

    def __post_init__(self):
        """The one validation of the loader's options, whether the config comes from keyword
        options (`make_config`, the Loader) or a file (`configfile`): every field converted to
        its type (a Literal lists its choices), then the ranges. A ConfigError's `key` is the
        option."""
        for key, type_ in field_types(type(self)).items():
            setattr(self, key, convert(getattr(self, key), type_, key))

        def fail(key, problem):
            raise ConfigError.at(key, problem)

        def positive_int(key):
            value = getattr(self, key)
            if value < 1:
                fail(key, f"must be an integer >= 1, got {value!r}")
        for key in ("micro_batch_tokens", "micro_batches", "prefetch_steps", "shard_prefetch",
                    "range_readahead", "chunk_bytes", "max_concurrency", "transform_workers",
                    "lookahead", "max_shard_prefetch", "max_range_readahead",
                    "tokenizer_processes", "image_workers"):
            positive_int(key)
        for key in ("epochs", "max_deferral", "memory_budget", "buffer_tokens",
                    "pipeline_stages", "state_every", "max_images_per_row",
                    "max_patches_per_row"):
            if getattr(self, key) is not None:
                positive_int(key)
        if self.buffer_tokens is not None and self.buffer_tokens < self.micro_batch_tokens:
            fail("buffer_tokens", f"must be >= micro_batch_tokens ({self.micro_batch_tokens}), "
                                  f"got {self.buffer_tokens}")
        if not (self.window_factor > 0 and math.isfinite(self.window_factor)):
            fail("window_factor", f"must be a positive number, got {self.window_factor!r}")
        if not (math.isfinite(self.step_overhead) and self.step_overhead >= 0):
            fail("step_overhead", f"must be a number >= 0, got {self.step_overhead!r}")
        if not 0 <= self.max_skip_fraction <= 1:
            fail("max_skip_fraction", f"must be a number in 0..1, got {self.max_skip_fraction!r}")
        if not self.collective_timeout_s > 0:
            fail("collective_timeout_s", f"must be > 0, got {self.collective_timeout_s!r}")
        if not 0 <= self.pad_token_id < 2**31:
            fail("pad_token_id", f"must be a token id in 0..2**31-1, got {self.pad_token_id!r}")
        for key in ("cost_a", "cost_b", "encoder_cost_a", "encoder_cost_b"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) >= 0):
                fail(key, f"must be a finite number >= 0, got {getattr(self, key)!r}")


# Keyword arguments of `Loader` that are not LoaderConfig options: make_config never sees
# them, but a misspelling of one arrives there, so "did you mean" offers them too.
LOADER_ARGUMENTS = ("sources", "tokenizer", "storage_options", "mixture", "sample_costs",
                    "parallel", "mesh", "on_step")


def make_config(**options) -> LoaderConfig:
    """Build a LoaderConfig from keyword options; unknown keys, wrong types and values out of
    range are ConfigErrors whose `key` is the option (`retry.max_attempts` inside a `retry`
    dict)."""
    known = LoaderConfig.__struct_fields__
    unknown = [key for key in options if key not in known]
    if unknown:
        key = unknown[0]
        others = [k for k in known + LOADER_ARGUMENTS if k != key]
        problem = f"unknown option {key!r}" + (did_you_mean(key, others)
                                                 or f"; known: {', '.join(sorted(known))}")
        raise ConfigError(problem, key=key, problem=problem)
    if isinstance(options.get("retry"), dict):   # checked field by field, keyed retry.<field>
        options["retry"] = from_table(options["retry"], RetryPolicy, "retry")
    return LoaderConfig(**options)


def check_fields(values: dict, struct: type, key: str) -> None:
    """Every key of `values` (a struct given as a dict: `retry`, `mixture`, `parallel`) a field
    of `struct`, else a ConfigError at '<key>.<name>' with the field probably meant. (msgspec
    ignores unknown fields, so a misspelt one would go unnoticed.)"""
    fields = list(struct.__struct_fields__)
    for name in values:
        if name not in fields:
            raise ConfigError.at(f"{key}.{name}", "unknown field" + (
                did_you_mean(str(name), fields) or f"; known: {', '.join(fields)}"))


_AT_PATH = re.compile(r" - at `\$(.*)`$")


def from_table(values: Any, struct: type, key: str) -> Any:
    """`struct` from a dict of its fields (or `values` itself when it is one already), every
    error a ConfigError keyed by its path as the user wrote it: 'retry.max_attempts',
    'parallel.tp', never msgspec's '$.max_attempts'."""
    if isinstance(values, struct):
        return values
    if not isinstance(values, dict):
        raise ConfigError.at(key, f"must be a {struct.__name__} or a dict of its fields, got "
                                  f"{type(values).__name__}")
    check_fields(values, struct, key)
    values = {k: _plain_number(v) for k, v in values.items()}
    try:
        return msgspec.convert(values, struct)
    except msgspec.ValidationError as exc:
        message, cause = str(exc), exc.__cause__
        at = _AT_PATH.search(message)
        path = at.group(1) if at else ""
        if isinstance(cause, ConfigError):   # the struct's own check, keyed by its field
            sub = f"{path}.{cause.key}" if cause.key else path
            raise ConfigError.at(f"{key}{sub}", cause.problem) from None
        field = path[1:] if path.startswith(".") else None
        choices = _literal_choices(field_types(struct)[field]) \
            if field in field_types(struct) else None
        if choices is not None:
            problem = _choices_problem(choices, values[field])
        else:
            problem = (message[:at.start()] if at else message).replace("`", "")
        raise ConfigError.at(f"{key}{path}", problem) from None


def _choices_problem(choices, value: Any) -> str:
    return f"must be one of {', '.join(map(repr, choices))}, got {value!r}"


def _plain_number(value: Any) -> Any:
    """A NumPy (or other) integer or real as a Python int or float; anything else as it is."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value
