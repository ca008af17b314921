"""Step-sized arrays, written again once the trainer has let go of them.

Every step packs its rows (int64 tokens, positions and labels, a float32 loss mask: 28 bytes a
token, 7 MiB for 4 x 65,536 tokens) into memory. Fresh arrays that size come from, and go back to, the kernel: the trainer's
thread pays for unmapping them when it drops a batch (half of what a `next()` cost, measured),
and the loop pays page faults to write new ones. So the step loop packs into a few arrays that
it keeps.

An array is free again when its reference count says only the recycler holds it. Every NumPy
view keeps its base array alive and `torch.from_numpy` keeps its array alive, so a batch the
trainer still holds (a micro-batch, a tensor, a slice of one) pins its array and the recycler
allocates another. It keeps at most `keep` arrays; arrays held longer are simply not reused.
The bridge frees a batch as soon as the trainer's loop has moved past it (`Loader.__next__`),
so a trainer that holds only the batch it is on keeps prefetch_steps + 1 arrays in use.
This reads CPython's reference counts, which are exact on the GIL builds streamload runs on.
"""
from __future__ import annotations

import sys

import numpy as np

# References to a free array while `take` looks at it: the recycler's list, the loop variable,
# and getrefcount's own argument.
_FREE = 3


class ArrayRecycler:
    def __init__(self, size: int, dtype, keep: int):
        self.size, self.dtype, self.keep = size, np.dtype(dtype), keep
        self._arrays: list[np.ndarray] = []
        self.allocated = 0   # arrays allocated so far; every other `take` reused one

    def take(self) -> np.ndarray:
        """An array of `size` that nothing else refers to; its contents are arbitrary."""
        for array in self._arrays:
            if sys.getrefcount(array) == _FREE:
                return array
        array = np.empty(self.size, self.dtype)
        self.allocated += 1
        if len(self._arrays) < self.keep:
            self._arrays.append(array)
        return array
