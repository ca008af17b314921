"""TOML configuration files: sources, batch geometry, cost model and mixture in one place.

    spec = load_config("train.toml")       # -> LoaderSpec
    spec.sources, spec.options, spec.mixture, spec.storage_options, spec.load_tokenizer()

Tables (all optional except at least one `[[source]]`):

    [loader]            LoaderConfig options: micro_batch_tokens, micro_batches, seed, epochs,
                        planner, ... (docs/configuration.md), and tokenizer = "module:attribute"
    [cost]              a, b, document_masking  (the loader options cost_a, cost_b, ...)
    [retry]             RetryPolicy fields
    [storage]           storage options for non-local sources, e.g. endpoint_url
    [mixture]           by, weights = {name = w}, schedule_unit, interpolate
    [[mixture.schedule]]  at, weights = {name = w}
    [[mixture.quota]]     source, min_length, max_length, fraction
    [[source]]          uri, name, weight, text_field, format, storage_options = {...}, and any
                        other field `Source` has

A relative local `uri` is relative to the file's directory, so a config and its data can move
together. Every problem raises ConfigError naming the file, the key path (`source[2].weight`,
`mixture.schedule[1].weights.web`) and what is wrong; invalid TOML names the line.
"""
from __future__ import annotations

import importlib
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from .config import LoaderConfig, Source, make_config
from .errors import ConfigError
from .plan.mix_spec import LengthQuota, MixPoint, Mixture
from .plan.planner import METHODS
from .storage.retry import RetryPolicy
from .tokenizer import as_tokenizer

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10: the same parser, as a package
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

TABLES = ("loader", "cost", "retry", "storage", "mixture", "source")
COST_KEYS = {"a": "cost_a", "b": "cost_b", "document_masking": "document_masking"}
MIXTURE_KEYS = ("by", "weights", "schedule_unit", "interpolate", "schedule", "quota")


@dataclass
class LoaderSpec:
    """A parsed and validated configuration file."""
    path: str
    sources: list[Source]
    options: dict = field(default_factory=dict)     # keyword options for Loader / make_config
    mixture: Mixture = field(default_factory=Mixture)
    storage_options: Optional[dict] = field(default=None, repr=False)   # may hold credentials
    tokenizer: Optional[str] = None                 # "module:attribute", imported by the Loader

    def config(self) -> LoaderConfig:
        return make_config(**self.options)

    def load_tokenizer(self):
        """The tokenizer `tokenizer = "module:attribute"` names, imported (a callable, a Hugging
        Face tokenizer, ...: see `streamload.tokenizer`); None if not given."""
        if self.tokenizer is None:
            return None
        module_name, _, attr = self.tokenizer.partition(":")
        try:
            target = importlib.import_module(module_name)
            for part in attr.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{self.path}: loader.tokenizer: cannot import "
                              f"{self.tokenizer!r}: {exc}") from None
        try:
            return as_tokenizer(target)
        except ConfigError as exc:
            raise ConfigError(f"{self.path}: loader.tokenizer: {self.tokenizer!r}: "
                              f"{exc}") from None


class _Errors:
    """Raises ConfigError as '<file>: <key path>: <problem>'."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, key: str, problem: str):
        raise ConfigError(f"{self.path}: {key}: {problem}" if key else f"{self.path}: {problem}")

    def table(self, value: Any, key: str) -> dict:
        if not isinstance(value, dict):
            self.fail(key, f"must be a table, got {_kind(value)}")
        return value

    def keys(self, table: dict, key: str, known) -> None:
        unknown = [k for k in table if k not in known]
        if unknown:
            self.fail(f"{key}.{unknown[0]}" if key else unknown[0],
                      f"unknown key; known: {', '.join(known)}")

    def typed(self, value: Any, type_, key: str) -> Any:
        """`value` converted to `type_` the msgspec way (no bool for numbers, ints for floats)."""
        try:
            return msgspec.convert(value, type_)
        except msgspec.ValidationError as exc:
            choices = [a for a in typing.get_args(type_) if a is not type(None)]
            if typing.get_origin(type_) is typing.Literal or (
                    len(choices) == 1 and typing.get_origin(choices[0]) is typing.Literal):
                allowed = typing.get_args(type_ if typing.get_origin(type_) is typing.Literal
                                          else choices[0])
                self.fail(key, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")
            problem = str(exc).split(" - at `", 1)[0].replace("`", "")
            self.fail(key, problem if repr(value) in problem else f"{problem} ({value!r})")


def _kind(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a float"}.get(type(value), type(value).__name__)


def _fields(struct) -> dict:
    return {f.name: f.type for f in msgspec.structs.fields(struct)}


def _struct_error(errors: _Errors, prefix: str, exc: Exception, paths: dict[str, str]) -> None:
    """A ConfigError from a struct's own checks, re-labelled with the file's key path. Their
    messages start with the option's name ("micro_batches: must be ...", "retry.max_attempts
    must be ..."); `paths` maps option name -> key path in the file."""
    text = str(exc).split(" - at `", 1)[0]
    for option, key in paths.items():
        for sep in (":", " "):
            if text.startswith(option + sep):
                errors.fail(key, text[len(option) + 1:].strip())
    errors.fail(prefix, text)


def load_config(path: str | os.PathLike) -> LoaderSpec:
    """Read and validate a TOML configuration file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration file: {exc.strerror}") from None
    return parse_config(raw.decode("utf-8", errors="replace"), path)


def parse_config(text: str, path: str = "<config>") -> LoaderSpec:
    """Validate a TOML document; `path` names it in errors and anchors relative URIs."""
    errors = _Errors(path)
    if tomllib is None:
        errors.fail("", "reading TOML needs Python >= 3.11 or the `tomli` package")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        errors.fail("", f"invalid TOML: {exc}")
    errors.keys(doc, "", TABLES)
    for name in ("loader", "cost", "retry", "storage", "mixture"):
        if name in doc:
            errors.table(doc[name], name)

    options, tokenizer = _loader_options(errors, doc)
    storage = doc.get("storage")
    sources = _sources(errors, doc.get("source"), os.path.dirname(os.path.abspath(path)))
    capacity = options.get("micro_batch_tokens",
                           _fields_default(LoaderConfig, "micro_batch_tokens"))
    mixture = _mixture(errors, doc.get("mixture", {}), sources, capacity)
    return LoaderSpec(path, sources, options, mixture, dict(storage) if storage else None,
                      tokenizer)


def _fields_default(struct, name: str):
    return next(f.default for f in msgspec.structs.fields(struct) if f.name == name)


def _loader_options(errors: _Errors, doc: dict) -> tuple[dict, Optional[str]]:
    types = _fields(LoaderConfig)
    reserved = {"retry": "[retry]", **{v: f"[cost] {k}" for k, v in COST_KEYS.items()}}
    loader_keys = [k for k in types if k not in reserved] + ["tokenizer"]
    loader = dict(doc.get("loader", {}))
    for key in loader:
        if key in reserved:
            errors.fail(f"loader.{key}", f"goes in {reserved[key]}")
    errors.keys(loader, "loader", loader_keys)
    tokenizer = loader.pop("tokenizer", None)
    if tokenizer is not None and (not isinstance(tokenizer, str) or ":" not in tokenizer):
        errors.fail("loader.tokenizer", f"must be a string 'module:attribute', got {tokenizer!r}")
    options = {key: errors.typed(value, types[key], f"loader.{key}")
               for key, value in loader.items()}
    if options.get("planner", METHODS[0]) not in METHODS:
        errors.fail("loader.planner", f"must be one of {', '.join(map(repr, METHODS))}, "
                                      f"got {options['planner']!r}")
    paths = {key: f"loader.{key}" for key in options}

    cost = doc.get("cost", {})
    errors.keys(cost, "cost", list(COST_KEYS))
    for key, value in cost.items():
        option = COST_KEYS[key]
        options[option] = errors.typed(value, types[option], f"cost.{key}")
        paths[option] = f"cost.{key}"
    for key in ("cost_a", "cost_b"):
        if key in options and not (math.isfinite(options[key]) and options[key] >= 0):
            errors.fail(paths[key], f"must be a finite number >= 0, got {options[key]!r}")

    if "retry" in doc:
        retry = doc["retry"]
        retry_types = _fields(RetryPolicy)
        errors.keys(retry, "retry", list(retry_types))
        values = {k: errors.typed(v, retry_types[k], f"retry.{k}") for k, v in retry.items()}
        try:
            options["retry"] = RetryPolicy(**values)
        except ConfigError as exc:
            _struct_error(errors, "retry", exc, {f"retry.{k}": f"retry.{k}" for k in values})

    try:
        make_config(**options)
    except ConfigError as exc:
        _struct_error(errors, "loader", exc, paths)
    return options, tokenizer


def _sources(errors: _Errors, raw: Any, base_dir: str) -> list[Source]:
    if raw is None:
        errors.fail("source", "no sources: add at least one [[source]] table with a uri")
    if not isinstance(raw, list):
        errors.fail("source", "must be an array of tables ([[source]]), not a single table")
    types = _fields(Source)
    sources, seen = [], {}
    for i, table in enumerate(raw):
        key = f"source[{i}]"
        errors.table(table, key)
        errors.keys(table, key, list(types))
        if "uri" not in table:
            errors.fail(f"{key}.uri", "missing; every source needs a uri")
        values = {k: errors.typed(v, types[k], f"{key}.{k}") for k, v in table.items()}
        if not values["uri"]:
            errors.fail(f"{key}.uri", "must not be empty")
        if "://" not in values["uri"] and not os.path.isabs(values["uri"]):
            values["uri"] = _relative(base_dir, values["uri"])
        weight = values.get("weight", 1.0)
        if not (math.isfinite(weight) and weight > 0):
            errors.fail(f"{key}.weight", f"must be a finite number > 0, got {weight!r}")
        try:
            source = Source(**values)
        except ConfigError as exc:
            problem = str(exc).split(": ", 1)[-1]
            field_name = next((f for f in types if problem.startswith(f + " ")), None)
            errors.fail(f"{key}.{field_name}" if field_name else key, problem)
        if source.name in seen:
            errors.fail(f"{key}.name", f"duplicate source name {source.name!r} (also "
                                       f"source[{seen[source.name]}]); names must be unique")
        seen[source.name] = i
        sources.append(source)
    return sources


def _relative(base_dir: str, uri: str) -> str:
    """Join, keeping a trailing '/' (a prefix) as written."""
    joined = os.path.normpath(os.path.join(base_dir, uri))
    return joined + "/" if uri.endswith("/") and not joined.endswith("/") else joined


def _mixture(errors: _Errors, raw: dict, sources: list[Source], capacity: int) -> Mixture:
    errors.keys(raw, "mixture", MIXTURE_KEYS)
    values: dict[str, Any] = {}
    for key in ("by", "schedule_unit", "interpolate"):
        if key in raw:
            values[key] = errors.typed(raw[key], str, f"mixture.{key}")
    if "weights" in raw:
        values["weights"] = _weights(errors, raw["weights"], "mixture.weights")
    points = []
    for i, point in enumerate(_array(errors, raw.get("schedule", []), "mixture.schedule")):
        key = f"mixture.schedule[{i}]"
        errors.table(point, key)
        errors.keys(point, key, ("at", "weights"))
        for required in ("at", "weights"):
            if required not in point:
                errors.fail(f"{key}.{required}", "missing")
        at = errors.typed(point["at"], float, f"{key}.at")
        points.append(_build(errors, key, MixPoint, at=at,
                             weights=_weights(errors, point["weights"], f"{key}.weights")))
    quotas = []
    quota_types = {"source": Optional[str], "min_length": int, "max_length": Optional[int],
                   "fraction": float}
    for i, quota in enumerate(_array(errors, raw.get("quota", []), "mixture.quota")):
        key = f"mixture.quota[{i}]"
        errors.table(quota, key)
        errors.keys(quota, key, list(quota_types))
        if "fraction" not in quota:
            errors.fail(f"{key}.fraction", "missing")
        quotas.append(_build(errors, key, LengthQuota, **{
            k: errors.typed(v, quota_types[k], f"{key}.{k}") for k, v in quota.items()}))
    try:
        mixture = Mixture(schedule=points, quotas=quotas, **values)
        mixture.check([s.name for s in sources], [s.weight for s in sources], capacity=capacity)
    except ConfigError as exc:
        key = getattr(exc, "key", None)
        if key is None:
            raise ConfigError(f"{errors.path}: mixture: {exc}") from None
        key = key.replace("quotas[", "quota[").replace("quotas", "quota")
        errors.fail(f"mixture.{key}", exc.problem)
    return mixture


def _array(errors: _Errors, value: Any, key: str) -> list:
    if not isinstance(value, list):
        errors.fail(key, f"must be an array of tables ([[{key}]]), got {_kind(value)}")
    return value


def _weights(errors: _Errors, value: Any, key: str) -> dict[str, float]:
    errors.table(value, key)
    out = {}
    for name, w in value.items():
        w = errors.typed(w, float, f"{key}.{name}")
        if not (math.isfinite(w) and w >= 0):
            errors.fail(f"{key}.{name}", f"must be a finite number >= 0, got {w!r}")
        out[name] = w
    return out


def _build(errors: _Errors, key: str, cls, **values):
    try:
        return cls(**values)
    except ConfigError as exc:
        errors.fail(f"{key}.{getattr(exc, 'key', '')}".rstrip("."),
                    getattr(exc, "problem", str(exc)))
