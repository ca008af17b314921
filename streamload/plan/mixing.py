"""Per-step token targets from the mixture weights, with carried deficits.

A source that got less than its target this step (its item did not fit, or its window ran
short) carries the difference into the next step, so the realized mix tracks the weights over
a window of steps instead of drifting. Sources whose data is gone for the epoch drop out and
the others go on in proportion to their weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Mixer:
    weights: np.ndarray                      # positive, any scale
    carry: np.ndarray = field(default=None)  # tokens owed to each source (may be negative)

    def __post_init__(self):
        self.weights = np.asarray(self.weights, dtype=np.float64)
        if self.carry is None:
            self.carry = np.zeros_like(self.weights)

    def targets(self, step_tokens: int, active: np.ndarray) -> np.ndarray:
        """Tokens each source should contribute this step; `active` marks sources with data."""
        weights = np.where(active, self.weights, 0.0)
        if weights.sum() == 0:
            return np.zeros_like(weights)
        share = weights / weights.sum() * step_tokens
        return np.maximum(share + np.where(active, self.carry, 0.0), 0.0)

    def update(self, targets: np.ndarray, realized: np.ndarray, active: np.ndarray,
               step_tokens: int) -> None:
        carry = np.clip(targets - realized, -step_tokens, step_tokens)
        self.carry = np.where(active, carry, 0.0)
