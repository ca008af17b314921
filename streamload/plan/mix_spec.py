"""The declarative mixture: weights, schedules and length quotas, validated once.

A `Mixture` says *what* the mix should be; `streamload.plan.quota_mixer.QuotaMixer` makes each step
follow it. Nothing here touches data: the structs are plain msgspec values (they round-trip
through JSON and TOML), and the schedule is a pure function of (step, tokens consumed).

    sl.Mixture(weights={"web": 0.6, "code": 0.3, "books": 0.1})   # default: each Source.weight

    sl.Mixture(
        by="tokens",                                   # or "samples"
        schedule=[sl.MixPoint(at=0, weights={"web": 0.7, "code": 0.3, "books": 0.0}),
                  sl.MixPoint(at=10_000, weights={"web": 0.4, "code": 0.3, "books": 0.3})],
        schedule_unit="steps",                         # or "tokens" (tokens consumed so far)
        interpolate="linear",                          # or "step" (stages switch at each point)
        quotas=[sl.LengthQuota(source="books", min_length=8192, fraction=0.2)],
    )

Weights are relative (any scale). 0 leaves a source out while the others have data: it is read
only once they have run out (or when a schedule gives it weight). The same holds for each
Source.weight, and at every point at least one weight must be positive. Without a schedule
they are `weights`, or each Source.weight when `weights` is None. With a schedule, every point
lists every source, and `weights` is not given. Before the first point the first point's
weights apply, after the last point the last's.

A `LengthQuota` asks that at least `fraction` of every step's total (tokens, or samples when
`by="samples"`) come from items with `min_length <= length < max_length`: of one source, or of
any source when `source` is None. Quotas that can apply to the same source must not overlap in
length, and all fractions together are at most 1.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import msgspec
import numpy as np

from ..errors import ConfigError

BY = ("tokens", "samples")
SCHEDULE_UNITS = ("steps", "tokens")
INTERPOLATIONS = ("linear", "step")


def fail(key: str, problem: str, *, where: str = "") -> None:
    """Raise a ConfigError keyed by the struct's own field path (`quotas[1].fraction`), which a
    caller re-prefixes through the error's `key` and `problem` (TOML key paths)."""
    raise ConfigError.at(key, problem, where=where)


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_weights(weights: Any, key: str, where: str) -> dict[str, float]:
    if not isinstance(weights, dict):
        fail(key, f"must be a table of source name -> weight, got {type(weights).__name__}",
             where=where)
    out = {}
    for name, w in weights.items():
        if not isinstance(name, str):
            fail(key, f"source names must be strings, got {name!r}", where=where)
        if not _number(w) or w < 0:
            fail(f"{key}.{name}", f"must be a finite number >= 0, got {w!r}", where=where)
        out[name] = float(w)
    return out


class MixPoint(msgspec.Struct, kw_only=True, frozen=True):
    """The weights at one point of a schedule: a step, or a number of tokens consumed."""
    at: float
    weights: dict[str, float]

    def __post_init__(self):
        if not _number(self.at) or self.at < 0:
            fail("at", f"must be a finite number >= 0, got {self.at!r}", where="MixPoint.")
        _check_weights(self.weights, "weights", "MixPoint.")


class LengthQuota(msgspec.Struct, kw_only=True, frozen=True):
    """At least `fraction` of each step from items with min_length <= length < max_length.

    Lengths are item lengths as the planner sees them: after `long_documents` split or truncated
    documents longer than `micro_batch_tokens`.
    """
    fraction: float
    min_length: int = 1
    max_length: Optional[int] = None      # exclusive; None: no upper bound
    source: Optional[str] = None          # None: items of any source count

    def __post_init__(self):
        where = "LengthQuota."
        if not _number(self.fraction) or not 0 < self.fraction <= 1:
            fail("fraction", f"must be a number in (0, 1], got {self.fraction!r}", where=where)
        if isinstance(self.min_length, bool) or not isinstance(self.min_length, int) \
                or self.min_length < 1:
            fail("min_length", f"must be an integer >= 1, got {self.min_length!r}", where=where)
        if self.max_length is not None and (
                isinstance(self.max_length, bool) or not isinstance(self.max_length, int)
                or self.max_length <= self.min_length):
            fail("max_length", f"must be an integer > min_length ({self.min_length}), "
                               f"got {self.max_length!r}", where=where)
        if self.source is not None and (not isinstance(self.source, str) or not self.source):
            fail("source", f"must be a source name, got {self.source!r}", where=where)

    @property
    def upper(self) -> float:
        return math.inf if self.max_length is None else self.max_length

    def overlaps(self, other: "LengthQuota") -> bool:
        """Could one item count toward both quotas?"""
        same_source = self.source is None or other.source is None or self.source == other.source
        return same_source and self.min_length < other.upper and other.min_length < self.upper

    def describe(self) -> str:
        where = "any source" if self.source is None else f"source {self.source!r}"
        upper = "" if self.max_length is None else f" and < {self.max_length}"
        return f"items >= {self.min_length}{upper} tokens of {where}"


def _coerce(items: Any, cls, key: str) -> tuple:
    """A list of `cls` or of plain dicts (as TOML and JSON give them) -> tuple of `cls`."""
    if items is None:
        return ()
    if not isinstance(items, (list, tuple)):
        fail(key, f"must be a list, got {type(items).__name__}", where="mixture.")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, cls):
            out.append(item)
            continue
        if not isinstance(item, dict):
            fail(f"{key}[{i}]", f"must be a {cls.__name__} or a table, got {type(item).__name__}",
                 where="mixture.")
        unknown = sorted(set(item) - set(cls.__struct_fields__))
        if unknown:
            fail(f"{key}[{i}]", f"unknown key(s) {', '.join(unknown)}; known: "
                                f"{', '.join(cls.__struct_fields__)}", where="mixture.")
        try:
            out.append(cls(**item))
        except TypeError as exc:
            fail(f"{key}[{i}]", str(exc), where="mixture.")
        except ConfigError as exc:
            fail(f"{key}[{i}].{exc.key}" if exc.key else f"{key}[{i}]", exc.problem,
                 where="mixture.")
    return tuple(out)


class Mixture(msgspec.Struct, kw_only=True):
    """How the sources mix: see the module docstring and docs/mixing.md."""
    by: str = "tokens"
    weights: Optional[dict[str, float]] = None
    schedule: tuple[MixPoint, ...] = ()
    schedule_unit: str = "steps"
    interpolate: str = "linear"
    quotas: tuple[LengthQuota, ...] = ()

    def __post_init__(self):
        where = "mixture."
        if self.by not in BY:
            fail("by", f"must be 'tokens' or 'samples', got {self.by!r}", where=where)
        if self.schedule_unit not in SCHEDULE_UNITS:
            fail("schedule_unit", f"must be 'steps' or 'tokens', got {self.schedule_unit!r}",
                 where=where)
        if self.interpolate not in INTERPOLATIONS:
            fail("interpolate", f"must be 'linear' or 'step', got {self.interpolate!r}",
                 where=where)
        if self.weights is not None:
            self.weights = _check_weights(self.weights, "weights", where)
        self.schedule = _coerce(self.schedule, MixPoint, "schedule")
        self.quotas = _coerce(self.quotas, LengthQuota, "quotas")
        if self.weights is not None and self.schedule:
            fail("weights", "give either weights or a schedule (whose points hold the weights), "
                            "not both", where=where)
        for i in range(1, len(self.schedule)):
            if not self.schedule[i].at > self.schedule[i - 1].at:
                fail(f"schedule[{i}].at", f"points must be in increasing order of `at`: "
                                          f"{self.schedule[i].at!r} follows "
                                          f"{self.schedule[i - 1].at!r}", where=where)
        for i, q in enumerate(self.quotas):
            for j in range(i):
                if q.overlaps(self.quotas[j]):
                    fail(f"quotas[{i}]", f"{q.describe()} overlaps quotas[{j}] "
                                         f"({self.quotas[j].describe()}); quotas that can apply "
                                         f"to one item must cover disjoint lengths", where=where)
        total = sum(q.fraction for q in self.quotas)
        if total > 1 + 1e-9:
            fail("quotas", f"fractions add up to {total:g}, more than 1", where=where)

    # -- against the sources ---------------------------------------------------------------
    def base_weights(self, names: Sequence[str], source_weights: Sequence[float]) -> np.ndarray:
        """Weights without a schedule: `weights` if given, else each source's own."""
        if self.weights is not None:
            return np.array([self.weights[n] for n in names], dtype=np.float64)
        return np.array([float(w) for w in source_weights], dtype=np.float64)

    def check(self, names: Sequence[str], source_weights: Optional[Sequence[float]] = None, *,
              capacity: Optional[int] = None) -> None:
        """Everything that needs the sources: names known, some weight at every point, quotas
        that can be met. `capacity` is micro_batch_tokens (the longest an item can be)."""
        where = "mixture."
        names = list(names)
        known = set(names)
        listing = ", ".join(names)
        if len(known) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            fail("sources", f"names must be unique, {dup} repeat; pass name=... to tell them "
                 f"apart")
        tables = [("weights", self.weights)] if self.weights is not None else []
        tables += [(f"schedule[{i}].weights", p.weights) for i, p in enumerate(self.schedule)]
        for key, weights in tables:
            for name in weights:
                if name not in known:
                    fail(f"{key}.{name}", f"unknown source {name!r}; sources: {listing}",
                         where=where)
            missing = [n for n in names if n not in weights]
            if missing:
                fail(key, f"missing source(s) {', '.join(missing)}: list every source "
                          f"(weight 0 leaves one out)", where=where)
        for i, q in enumerate(self.quotas):
            if q.source is not None and q.source not in known:
                fail(f"quotas[{i}].source", f"unknown source {q.source!r}; sources: {listing}",
                     where=where)
            if capacity is not None and q.min_length > capacity:
                fail(f"quotas[{i}].min_length",
                     f"{q.min_length} is more than micro_batch_tokens ({capacity}): items are "
                     f"split or truncated to at most {capacity} tokens, so none can count",
                     where=where)
        if source_weights is None:
            source_weights = [1.0] * len(names)
        table = self.weight_table(names, source_weights)[1]
        labels = [f"schedule[{i}]" for i in range(len(self.schedule))] or ["weights"]
        for label, row in zip(labels, table):
            if not row.sum() > 0:
                if self.schedule or self.weights is not None:
                    fail(f"{label}.weights" if self.schedule else "weights",
                         "every source's weight is 0; at least one must be positive",
                         where=where)
                fail("sources", "every source's weight is 0; at least one must be positive "
                                "(weight 0 leaves a source out while others have data)")
            shares = row / row.sum()
            for i, q in enumerate(self.quotas):
                if q.source is None:
                    continue
                share = shares[names.index(q.source)]
                if 0 < share < q.fraction - 1e-9:   # share 0: the source sits this stage out
                    fail(f"quotas[{i}].fraction",
                         f"{q.fraction:g} of every step from source {q.source!r}, but its share "
                         f"is only {share:.4g} at {label}", where=where)

    def weight_table(self, names: Sequence[str], source_weights: Sequence[float]
                     ) -> tuple[np.ndarray, np.ndarray]:
        """The schedule compiled: points `at` [P] and weights [P, S] (P = 1 without a schedule)."""
        if not self.schedule:
            return np.zeros(1), self.base_weights(names, source_weights)[None, :]
        rows = [[point.weights[n] for n in names] for point in self.schedule]
        return (np.array([p.at for p in self.schedule], dtype=np.float64),
                np.array(rows, dtype=np.float64))

    def max_shares(self, names: Sequence[str], source_weights: Sequence[float]) -> np.ndarray:
        """The largest share each source reaches anywhere on the schedule (for buffer sizing).

        Between two points a share is w_s(x) / sum(w(x)) with both parts linear in x, which is
        monotone, so the extremes are at the points."""
        table = self.weight_table(names, source_weights)[1]
        sums = table.sum(axis=1, keepdims=True)
        return (table / np.where(sums > 0, sums, 1.0)).max(axis=0)


class Schedule:
    """Weights as a function of the schedule position (a step, or tokens consumed)."""

    def __init__(self, at: np.ndarray, table: np.ndarray, interpolate: str):
        self.at, self.table, self.interpolate = at, table, interpolate

    def __call__(self, x: float) -> np.ndarray:
        at, table = self.at, self.table
        if at.size == 1 or x <= at[0]:
            return table[0].copy()
        if x >= at[-1]:
            return table[-1].copy()
        k = int(np.searchsorted(at, x, side="right")) - 1     # at[k] <= x < at[k + 1]
        if self.interpolate == "step":
            return table[k].copy()
        t = (x - at[k]) / (at[k + 1] - at[k])
        return (1 - t) * table[k] + t * table[k + 1]
