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
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from .config import LoaderConfig, Source, convert, did_you_mean, field_types, make_config
from .errors import ConfigError
from .plan.mix_spec import LengthQuota, MixPoint, Mixture
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
            _Errors(self.path).fail("loader.tokenizer", f"cannot import {self.tokenizer!r}: {exc}")
        try:
            return as_tokenizer(target)
        except ConfigError as exc:
            _Errors(self.path).fail("loader.tokenizer", f"{self.tokenizer!r}: {exc.problem}")


class _Errors:
    """Raises ConfigError as '<file>: <key path>: <problem>', with `key` the key path."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, key: str, problem: str):
        if not key:
            raise ConfigError(f"{self.path}: {problem}", problem=problem) from None
        raise ConfigError.at(key, problem, where=f"{self.path}: ") from None

    def relabel(self, exc: ConfigError, prefix: str, paths: Optional[dict] = None):
        """`exc` (a struct's error, keyed by the struct's field) raised again at its key path in
        the file: `paths[exc.key]` if listed, else '<prefix>.<exc.key>' ('<prefix>' unkeyed)."""
        if exc.key is None:
            self.fail(prefix, exc.problem)
        self.fail((paths or {}).get(exc.key) or f"{prefix}.{exc.key}", exc.problem)

    def table(self, value: Any, key: str) -> dict:
        if not isinstance(value, dict):
            self.fail(key, f"must be a table, got {_kind(value)}")
        return value

    def keys(self, table: dict, key: str, known) -> None:
        """Every key of `table` in `known`, else an error at the first unknown one: 'unknown
        key; did you mean ...?' when one of `known` is close, else the known keys."""
        unknown = [k for k in table if k not in known]
        if unknown:
            hint = did_you_mean(unknown[0], known)
            self.fail(f"{key}.{unknown[0]}" if key else unknown[0],
                      f"unknown key{hint}" if hint else f"unknown key; known: {', '.join(known)}")

    def typed(self, value: Any, type_, key: str) -> Any:
        """`value` converted to `type_` (`config.convert`), its error keyed by `key`."""
        return convert(value, type_, key, where=f"{self.path}: ")


def _kind(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a float"}.get(type(value), type(value).__name__)


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
    """[loader], [cost] and [retry] as keyword options, validated by `make_config` (the one
    validation of loader options); its errors are re-keyed to the file's key paths."""
    reserved = {"retry": "[retry]", **{v: f"[cost] {k}" for k, v in COST_KEYS.items()}}
    loader_keys = [k for k in field_types(LoaderConfig) if k not in reserved] + ["tokenizer"]
    loader = dict(doc.get("loader", {}))
    for key in loader:
        if key in reserved:
            errors.fail(f"loader.{key}", f"goes in {reserved[key]}")
    errors.keys(loader, "loader", loader_keys)
    tokenizer = loader.pop("tokenizer", None)
    if tokenizer is not None and (not isinstance(tokenizer, str) or ":" not in tokenizer):
        errors.fail("loader.tokenizer", f"must be a string 'module:attribute', got {tokenizer!r}")
    options = dict(loader)
    paths = {key: f"loader.{key}" for key in options}

    cost = doc.get("cost", {})
    errors.keys(cost, "cost", list(COST_KEYS))
    for key, value in cost.items():
        options[COST_KEYS[key]] = value
        paths[COST_KEYS[key]] = f"cost.{key}"

    if "retry" in doc:
        retry = doc["retry"]
        retry_types = field_types(RetryPolicy)
        errors.keys(retry, "retry", list(retry_types))
        values = {k: errors.typed(v, retry_types[k], f"retry.{k}") for k, v in retry.items()}
        try:
            options["retry"] = RetryPolicy(**values)
        except ConfigError as exc:
            errors.relabel(exc, "retry")
        paths["retry"] = "retry"

    try:
        config = make_config(**options)
    except ConfigError as exc:
        errors.relabel(exc, "loader", paths)
    return {key: getattr(config, key) for key in options}, tokenizer


def _sources(errors: _Errors, raw: Any, base_dir: str) -> list[Source]:
    """The [[source]] tables as Sources; `Source` validates every field (the one validation of
    a source), its errors re-keyed to `source[i].<field>`."""
    if raw is None:
        errors.fail("source", "no sources: add at least one [[source]] table with a uri")
    if not isinstance(raw, list):
        errors.fail("source", "must be an array of tables ([[source]]), not a single table")
    fields = list(field_types(Source))
    sources, seen = [], {}
    for i, table in enumerate(raw):
        key = f"source[{i}]"
        errors.table(table, key)
        errors.keys(table, key, fields)
        if "uri" not in table:
            errors.fail(f"{key}.uri", "missing; every source needs a uri")
        values = dict(table)
        uri = values["uri"]
        if isinstance(uri, str) and uri and "://" not in uri and not os.path.isabs(uri):
            values["uri"] = _relative(base_dir, uri)
        try:
            source = Source(**values)
        except ConfigError as exc:
            errors.relabel(exc, key)
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
        # Mixture's field `quotas` is the file's [[mixture.quota]] array.
        if exc.key is not None and (exc.key == "quotas" or exc.key.startswith("quotas[")):
            exc = ConfigError(str(exc), key="quota" + exc.key[len("quotas"):],
                              problem=exc.problem)
        if exc.key == "sources":   # the [[source]] tables' weights, not the [mixture] table's
            errors.fail("source", exc.problem)
        errors.relabel(exc, "mixture")
    return mixture


def _array(errors: _Errors, value: Any, key: str) -> list:
    if not isinstance(value, list):
        errors.fail(key, f"must be an array of tables ([[{key}]]), got {_kind(value)}")
    return value


def _weights(errors: _Errors, value: Any, key: str) -> dict[str, float]:
    """A weights table as floats; MixPoint and Mixture check the values."""
    errors.table(value, key)
    return {name: errors.typed(w, float, f"{key}.{name}") for name, w in value.items()}


def _build(errors: _Errors, key: str, cls, **values):
    try:
        return cls(**values)
    except ConfigError as exc:
        errors.relabel(exc, key)
