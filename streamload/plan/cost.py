"""The cost model: a document of L tokens costs a*L**2 + b*L (plus an optional per-sample term).

Pure NumPy, no torch and no I/O beyond `load` / `save` of a small JSON file.

Row cost
    With document masking (varlen / block-diagonal causal attention), attention never crosses
    document boundaries, so a packed row costs the *sum* of its documents' costs. With plain
    causal attention over the whole packed row (`document_masking=False`), the row's total length
    is put into the formula instead.

Where a and b come from
    * `CostModel.transformer(n_params, n_layers, d_model)`: FLOPs of forward plus backward.
      The linear part is 6·N FLOPs per token (2·N forward, 4·N backward), so b = 6·n_params.
      Causal attention is 6·n_layers·d_model·L² FLOPs per document of L tokens: forward
      computes QKᵀ and PV, 2·L²·d FLOPs each for the full square, half of that under a causal
      mask, so 2·L²·d per layer; backward is twice forward. So a = 6·n_layers·d_model.
      Bidirectional attention (`causal=False`) does the full square: a = 12·n_layers·d_model.
      Units are FLOPs; the planner only uses ratios, so the units do not matter.
    * `streamload calibrate` (streamload/commands/calibrate.py) measures a and b in seconds on the
      actual device and writes a JSON file that `CostModel.load(path)` reads.
    * `CostModel.from_fit(...)` builds one from fitted coefficients (clipped at 0).

    A constant cost per row (kernel launches, the loss, the optimizer share) does not change
    the balance, because every rank runs exactly M rows, so the model has no such term.

Per-sample cost hook
    A source can add cost per sample that the length does not explain, for example per image
    for a vision encoder. Such a hook is a `SampleCostHook`: a function from the samples'
    token lengths (an int64 array) to their extra costs (a float64 array of the same shape, in
    the same units as a and b). Its result reaches the planner as `Candidates.extra_cost`, and
    `row_costs(..., extra_cost=...)` adds it to the row each sample lands in, with or without
    document masking. `CostModel.extra_cost(hook, lengths)` applies a hook with checks.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Callable

import numpy as np

_COST_BLOCK = 1 << 16   # items per block of `CostModel.split_cost` (0.5 MB of floats)

# lengths (int64 [n]) -> extra cost per sample (float64 [n]), in the cost model's units.
SampleCostHook = Callable[[np.ndarray], np.ndarray]


def pipeline_time(row_costs, stages: int) -> np.ndarray:
    """Each rank's step time from its rows' costs (`row_costs` [..., M]) under a 1F1B pipeline
    of `stages` stages: (sum + (P - 1) * max) / P. The first micro-batch fills the pipeline and
    the last drains it, so the costliest one is paid P - 1 more times (in stage units: the cost
    model's row cost is the whole model's, a stage does 1/P of it). With P = 1, the sum.

    Limits: the non-interleaved schedule with equal stages; an interleaved (virtual pipeline)
    schedule of v chunks shrinks the bubble to (P - 1) / v of the max, which this does not model.
    """
    row_costs = np.asarray(row_costs, dtype=np.float64)
    total = row_costs.sum(axis=-1)
    if stages <= 1 or row_costs.shape[-1] == 0:
        return total
    return (total + (stages - 1) * row_costs.max(axis=-1)) / stages


def balanced_time(row_costs, stages: int) -> float:
    """The step's time had its work been spread evenly over all R·M rows (`row_costs` [R, M]):
    every rank's 1F1B time is then work/R · (M + P − 1)/(M·P). What `pipeline_time`'s slowest
    rank is measured against (1.0: no rank and no micro-batch waits on another)."""
    row_costs = np.asarray(row_costs, dtype=np.float64)
    R, M = row_costs.shape
    return float(row_costs.sum()) / R * (M + stages - 1) / (M * stages)


def _max_over_mean(maximum: float, mean: float) -> float:
    return maximum / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class StepCosts:
    """A step's job-wide cost figures, of fixed size whatever R: what `Batch.imbalance`,
    `step_time`, `pipeline_efficiency` and the encoder / backbone imbalances read, so that they
    are the same on every rank when only rank 0 holds every rank's figures
    (control_plane="gather": a rank's reply carries these and its own rank's figures)."""
    tokens: float = 0.0           # the job's tokens this step
    rank_cost_max: float = 0.0
    rank_cost_mean: float = 0.0
    row_cost_max: float = 0.0
    step_time: float = 0.0        # the slowest rank's 1F1B time (`pipeline_time`)
    balanced_time: float = 0.0    # `balanced_time`; `step_time` without rows
    encoder_max: float = 0.0      # the vision encoder's part of the rank costs
    encoder_mean: float = 0.0
    backbone_max: float = 0.0     # the rest
    backbone_mean: float = 0.0

    @property
    def imbalance(self) -> float:
        return _max_over_mean(self.rank_cost_max, self.rank_cost_mean)

    @property
    def encoder_imbalance(self) -> float:
        return _max_over_mean(self.encoder_max, self.encoder_mean)

    @property
    def backbone_imbalance(self) -> float:
        return _max_over_mean(self.backbone_max, self.backbone_mean)

    @property
    def pipeline_efficiency(self) -> float:
        return self.balanced_time / self.step_time if self.step_time > 0 else 1.0

    def to_array(self) -> np.ndarray:
        return np.array([getattr(self, f.name) for f in fields(self)], dtype=np.float64)

    @classmethod
    def from_array(cls, values) -> "StepCosts":
        return cls(*(float(v) for v in values))

    @classmethod
    def of(cls, rank_tokens, rank_cost, row_cost=None, stages: int = 1,
           encoder_cost=None) -> "StepCosts":
        """From every rank's figures: tokens [R], cost [R], rows [R, M] (None: a rank's step
        time is its cost), the encoder's part of each rank's cost [R] (None: none)."""
        cost = np.asarray(rank_cost, dtype=np.float64).reshape(-1)
        encoder = np.zeros_like(cost) if encoder_cost is None \
            else np.asarray(encoder_cost, dtype=np.float64).reshape(-1)
        backbone = cost - encoder
        has_rows = row_cost is not None and np.size(row_cost) > 0
        rows = np.asarray(row_cost, dtype=np.float64) if has_rows else None
        time = pipeline_time(rows, stages) if has_rows else cost
        def top(values):
            return float(values.max()) if values.size else 0.0
        def mean(values):
            return float(values.mean()) if values.size else 0.0
        return cls(float(np.sum(rank_tokens)), top(cost), mean(cost),
                   top(rows) if has_rows else 0.0, top(time),
                   balanced_time(rows, stages) if has_rows else top(time),
                   top(encoder), mean(encoder), top(backbone), mean(backbone))


STEP_COSTS_FIELDS = len(fields(StepCosts))


def _config_error(message: str):
    from ..errors import ConfigError
    return ConfigError(message)


@dataclass(frozen=True)
class CostModel:
    a: float = 1.0 / 49152  # quadratic (attention) coefficient: a d_model = 4096 decoder
                            # (7B class), relative to b; see `transformer`
    b: float = 1.0          # linear coefficient
    document_masking: bool = True  # False: plain causal attention over the whole packed row

    def __post_init__(self):
        if not (np.isfinite(self.a) and np.isfinite(self.b)) or self.a < 0 or self.b < 0:
            raise _config_error(f"cost model: a and b must be finite and >= 0, got a={self.a}, b={self.b}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def transformer(cls, n_params: float, n_layers: int, d_model: int, causal: bool = True,
                    document_masking: bool = True) -> "CostModel":
        """Forward-plus-backward FLOPs of a decoder: b = 6·n_params, a = 6·n_layers·d_model.

        `n_params` should count the parameters that every token passes through (the blocks and
        the output head; not the embedding lookup). `causal=False` (bidirectional attention)
        doubles a, because the whole L×L square is computed instead of its lower half.
        """
        if n_params <= 0 or n_layers <= 0 or d_model <= 0:
            raise _config_error("cost model: transformer() needs n_params, n_layers and d_model > 0, "
                                f"got n_params={n_params}, n_layers={n_layers}, d_model={d_model}")
        attention = 6.0 if causal else 12.0
        return cls(a=attention * n_layers * d_model, b=6.0 * float(n_params),
                   document_masking=document_masking)

    @classmethod
    def from_fit(cls, a: float, b: float, document_masking: bool = True, **_ignored) -> "CostModel":
        """From fitted coefficients (e.g. a calibration's output); clips tiny negatives to 0.

        Extra keys (c, r2, device, ...) are accepted and ignored, so a calibration's full
        JSON record can be passed as keyword arguments.
        """
        return cls(a=max(float(a), 0.0), b=max(float(b), 0.0),
                   document_masking=bool(document_masking))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostModel":
        """Read a JSON file written by `save` or by `streamload calibrate --output`."""
        try:
            with open(path, "r", encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise _config_error(f"cost model: cannot read {os.fspath(path)!r}: {e}") from e
        if not isinstance(data, dict) or "a" not in data or "b" not in data:
            raise _config_error(f"cost model: {os.fspath(path)!r} must hold a JSON object with "
                                "keys 'a' and 'b'")
        known = {f.name for f in fields(cls)}
        return cls.from_fit(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        """Write {"a", "b", "document_masking"} as JSON; `CostModel(**json)` reads it back."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    def describe(self) -> str:
        """One line for the start-up log: the coefficients, what they mean, how to set them."""
        width = self.crossover_length
        return (f"cost model a*L^2 + b*L per document, a={self.a:.4g}, b={self.b:.4g}: attention "
                f"costs as much as the rest at L={width:,.0f} tokens, as in a decoder of d_model "
                f"~{width / 12:,.0f} (b/a = n_params/(n_layers*d_model) ~ 12*d_model); the "
                f"default is d_model = 4096. Set yours with CostModel.transformer(...) or "
                f"`streamload calibrate`. Document masking "
                f"{'on' if self.document_masking else 'off'}")

    # ------------------------------------------------------------------ costs
    @property
    def crossover_length(self) -> float:
        """The document length at which attention costs as much as the linear part (b / a)."""
        return self.b / self.a if self.a > 0 else float("inf")

    def doc_cost(self, lengths) -> np.ndarray:
        """Cost of each document on its own (what it adds to a row with document masking)."""
        return self.split_cost(lengths)[0]

    def split_cost(self, lengths) -> tuple[np.ndarray, np.ndarray]:
        """(`doc_cost`, its linear part b·L) of each document: the attention part is then the
        difference, with no second pass for b·L. Worked in place over arrays (two of them
        made, not four: at 10^6 candidates a step, each is a pass), a block at a time (the
        four passes over a block while it is in cache, not over arrays of up to 50 MB); the
        same floats, elementwise."""
        lengths = np.asarray(lengths, dtype=np.float64)
        if lengths.ndim == 0:
            linear = self.b * lengths
            return self.a * lengths * lengths + linear, linear
        lengths = np.ascontiguousarray(lengths)
        total, linear = np.empty(lengths.shape), np.empty(lengths.shape)
        flat, flat_total, flat_linear = lengths.ravel(), total.ravel(), linear.ravel()   # views
        for start in range(0, flat.shape[0], _COST_BLOCK):
            block = slice(start, start + _COST_BLOCK)
            part, out, lin = flat[block], flat_total[block], flat_linear[block]
            np.multiply(self.b, part, out=lin)
            np.multiply(self.a, part, out=out)
            out *= part
            out += lin
        return total, linear

    def cut_savings(self, lengths, taken) -> float:
        """The attention work that cutting items of `lengths` tokens to their first `taken`
        tokens takes out of the data (the rest stays in its buffer, a document of its own):
        doc_cost(L) - doc_cost(h) - doc_cost(L - h) = 2·a·h·(L - h) summed, with document
        masking; 0 without it (a row's cost does not see document boundaries). Successive cuts
        of one piece add up to what cutting it into all its parts saves."""
        if not self.document_masking:
            return 0.0
        lengths = np.asarray(lengths, dtype=np.float64)
        taken = np.asarray(taken, dtype=np.float64)
        return float((2.0 * self.a * taken * (lengths - taken)).sum())

    @staticmethod
    def extra_cost(hook: SampleCostHook | None, lengths) -> np.ndarray:
        """Apply a per-sample cost hook to `lengths`; zeros when there is no hook."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if hook is None:
            return np.zeros(lengths.shape, dtype=np.float64)
        extra = np.asarray(hook(lengths), dtype=np.float64)
        if extra.shape != lengths.shape:
            extra = np.broadcast_to(extra, lengths.shape).astype(np.float64)
        if not np.all(np.isfinite(extra)) or np.any(extra < 0):
            raise _config_error("cost model: a sample cost hook returned a negative or "
                                "non-finite cost")
        return extra

    def row_costs(self, lengths, rows, num_rows: int, extra_cost=None) -> np.ndarray:
        """Cost of each of `num_rows` packed rows; item i (of `lengths`) sits in row `rows[i]`."""
        lengths = np.asarray(lengths, dtype=np.float64)
        rows = np.asarray(rows, dtype=np.int64)
        if self.document_masking:
            per_item = self.doc_cost(lengths)
            if extra_cost is not None:
                per_item = per_item + np.asarray(extra_cost, dtype=np.float64)
            return np.bincount(rows, weights=per_item, minlength=num_rows)
        row_tokens = np.bincount(rows, weights=lengths, minlength=num_rows)
        costs = self.doc_cost(row_tokens)
        if extra_cost is not None:
            costs = costs + np.bincount(rows, weights=np.asarray(extra_cost, np.float64),
                                        minlength=num_rows)
        return costs
