"""The cost model: a document of L tokens costs a*L**2 + b*L (plus an optional per-sample term)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    a: float = 1.0 / 4096   # quadratic (attention) coefficient
    b: float = 1.0          # linear coefficient
    document_masking: bool = True  # False: plain causal attention over the whole packed row

    def __post_init__(self):
        if not (np.isfinite(self.a) and np.isfinite(self.b)) or self.a < 0 or self.b < 0:
            from ..errors import ConfigError
            raise ConfigError(f"cost model: a and b must be finite and >= 0, got a={self.a}, b={self.b}")

    def doc_cost(self, lengths) -> np.ndarray:
        """Cost of each document on its own (what it adds to a row with document masking)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.a * lengths * lengths + self.b * lengths

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
