"""One entry point for planning a step: select by quota, then assign to (rank, row)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import CostModel
from .naive import assign_naive, finish
from .select import select
from .types import Assignment, Candidates, Geometry

METHODS = ("naive",)


@dataclass
class Planner:
    geometry: Geometry
    cost: CostModel
    method: str = "naive"
    seed: int = 0
    max_age: int | None = None   # an item offered this many steps is selected first

    def plan(self, c: Candidates, targets: np.ndarray, step: int) -> Assignment:
        selected = select(c, targets, max_age=self.max_age)
        if self.method == "naive":
            take, rank, row = assign_naive(c, selected, self.geometry)
        else:
            raise ValueError(f"unknown planning method {self.method!r}; choose from {METHODS}")
        return finish(c, take, rank, row, self.geometry, self.cost)
