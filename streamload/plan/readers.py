"""Which DP ranks read each source (disaggregation). Pure NumPy.

A source need not be read by every rank: its shards are dealt over its *readers* only, and
its items reach the ranks that train on them through the step's exchange. A rank that reads
no shard of a source runs no fetcher, buffer or head window for it.

How many: by hand (`Source.readers`), or enough readers that each one's buffer feeds at most
`READER_LOAD` of a rank's step of the source per step, weighted by the source's cost per token
to read (`Source.read_cost`):

    k = ceil(share · R · read_cost / READER_LOAD),   clamped to 1 .. min(R, shards)

`share` is the source's largest share of the job's step (the mixture's weights, over its
schedule), so the R ranks' step, R·M·C tokens, holds share·R·M·C of it; k readers each supply
share·R·M·C / k <= READER_LOAD · M·C / read_cost. Never more readers than ranks, nor than the
source has shards (a reader with no shard would read nothing).

Which: a rotation. Source s is read by the k_s ranks from its offset on, modulo R; the offsets
are running sums of the earlier sources' reader counts, so fetchers spread evenly over ranks.
A source read by every rank advances the offset by 1 instead (its deal's first shard goes to
rank `offset`: sources with few shards start on different ranks, as before readers existed).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

READER_LOAD = 0.5   # of a rank's step (M·C tokens): what one reader supplies of one source


def choose_readers(shares: Sequence[float], num_shards: Sequence[int], ranks: int,
                   read_cost: Optional[Sequence[float]] = None,
                   requested: Optional[Sequence[Optional[int]]] = None) -> np.ndarray:
    """int64 [S]: how many ranks read each source. `shares`: each source's largest share of
    the step (any scale: normalized here); `num_shards`: listed shards (times repeat);
    `read_cost`: relative cost per token of reading (1: plain tokens); `requested[s]`: the
    count asked for by hand (None: automatic). A source with no shard gets every rank (it has
    nothing to deal)."""
    shares = np.asarray(shares, dtype=np.float64)
    total = shares.sum()
    shares = shares / total if total > 0 else np.full(shares.size, 1.0 / max(shares.size, 1))
    cost = np.ones(shares.size) if read_cost is None else np.asarray(read_cost, np.float64)
    need = np.ceil(shares * ranks * cost / READER_LOAD - 1e-9).astype(np.int64)
    if requested is not None:
        need = np.array([n if r is None else int(r) for n, r in zip(need, requested)],
                        dtype=np.int64)
    shards = np.asarray(num_shards, dtype=np.int64)
    top = np.where(shards > 0, np.minimum(shards, ranks), ranks)
    return np.clip(need, 1, top)


def reader_offsets(readers: Sequence[int], ranks: int) -> np.ndarray:
    """int64 [S]: each source's first reader (the deal's rotation). Running sums of the earlier
    sources' reader counts (1 for a source every rank reads), modulo R."""
    readers = np.asarray(readers, dtype=np.int64)
    step = np.where(readers >= ranks, 1, readers)
    return (np.cumsum(step) - step) % max(ranks, 1)


def reader_mask(readers: Sequence[int], offsets: Sequence[int], ranks: int) -> np.ndarray:
    """bool [R, S]: rank r reads source s (its index among s's readers, (r - offset) mod R, is
    below the count)."""
    readers = np.asarray(readers, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    index = (np.arange(ranks)[:, None] - offsets[None, :]) % max(ranks, 1)
    return index < readers[None, :]
