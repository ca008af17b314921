"""Choose the step's samples from the head windows, following per-source token targets.

Pure NumPy. Within a source, candidates are taken in *arrival order*: round-robin over ranks by
buffer position (position 0 of every rank, then position 1, ...), so no rank's buffer is drained
ahead of the others and every buffer is consumed as a FIFO. Items that have waited `max_age`
steps or more are always selected first (bounded deferral).
"""
from __future__ import annotations

import numpy as np

from .length_buckets import water_fill
from .types import Candidates


def _stable_order(keys: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """`order` (default: all indices) stably sorted by `keys[order]`. Keys that fit 16 bits sort
    by radix, in linear time."""
    values = keys if order is None else keys[order]
    if values.size and 0 <= values.min() and values.max() < 1 << 16:
        values = values.astype(np.uint16)
    by = np.argsort(values, kind="stable")
    return by if order is None else order[by]


def arrival_order(c: Candidates, items: np.ndarray | None = None) -> np.ndarray:
    """Indices of all candidates (or of `items`, increasing candidate indices), per source in
    round-robin arrival order (source-major): by (source, position, rank).

    Stable sorts, least significant key first, each a linear radix sort for the small integers
    these are (one lexsort costs n log n three times): (source, position) as one 16-bit key
    when it fits, and the rank only when the layout does not already put a window's ranks in
    order (`Candidates` laid out by (source, rank, position), as windows make them)."""
    order = np.arange(len(c)) if items is None else np.asarray(items, dtype=np.int64)
    if order.size == 0:
        return order
    if not _ranks_in_order(c):
        order = _stable_order(c.rank, order)
    span = int(c.position.max()) + 1
    if c.num_sources * span <= 1 << 16:
        key = c.source[order].astype(np.int32) * span + c.position[order]
        return order[np.argsort(key.astype(np.uint16), kind="stable")]
    return _stable_order(c.source, _stable_order(c.position, order))


def _ranks_in_order(c: Candidates) -> bool:
    """Whether (source, rank) never decreases in candidate order: then items of one (source,
    position) already come by rank."""
    if len(c) < 2:
        return True
    if "window_bounds" in vars(c):   # known (or found) already: None exactly when it decreases
        return c.window_bounds is not None
    window = c.source.astype(np.int64) * max(c.num_ranks, int(c.rank.max()) + 1) + c.rank
    return bool((window[1:] >= window[:-1]).all())


def select(c: Candidates, targets: np.ndarray, *, max_age: int | None = None,
           counts: np.ndarray | None = None) -> np.ndarray:
    """Indices of selected candidates, interleaved across sources in proportion to their targets.

    `targets[s]` is how much source s should contribute, in the unit of `counts`: what each
    candidate counts toward its source's target (default: its length, so targets are in tokens;
    `np.ones(len(c))` makes them sample counts). A source takes items while what it took so far
    is below its target (so it overshoots by at most one item). When a source has less than its
    target, the shortfall goes to the other sources in proportion to their targets, so the step
    stays full while any data is left.
    """
    num_sources = c.num_sources
    targets = np.maximum(np.asarray(targets, dtype=np.float64), 0.0).copy()
    order = arrival_order(c)
    if max_age is not None and len(c):
        # Overdue items jump to the front of their source's queue, keeping arrival order.
        overdue = c.age[order] >= max_age
        order = _stable_order(c.source, np.concatenate([order[overdue], order[~overdue]]))
    lengths = (c.length if counts is None else np.asarray(counts))[order].astype(np.float64)
    sources = c.source[order]
    bounds = np.searchsorted(sources, np.arange(num_sources + 1))
    available = np.array([lengths[bounds[s]:bounds[s + 1]].sum() for s in range(num_sources)])

    targets = water_fill(targets, available)   # a short source's shortfall goes to the others

    picked, keys = [], []
    for s in range(num_sources):
        lo, hi = bounds[s], bounds[s + 1]
        if hi == lo or targets[s] <= 0:
            continue
        before = np.cumsum(lengths[lo:hi]) - lengths[lo:hi]
        n = int(np.searchsorted(before, targets[s], side="left"))
        picked.append(order[lo:lo + n])
        keys.append(before[:n] / targets[s])   # fraction of the source's target reached
    if not picked:
        return np.zeros(0, dtype=np.int64)
    picked_all = np.concatenate(picked)
    key_all = np.concatenate(keys)
    # Interleave sources by progress through their targets; ties break by source index. Each
    # source's keys ascend and the sources come in order, so a stable sort merges sorted runs.
    interleave = np.argsort(key_all, kind="stable")
    return picked_all[interleave].astype(np.int64)


def interleaved(c: Candidates, items: np.ndarray) -> np.ndarray:
    """`items` (candidate indices) in arrival order within each source, the sources interleaved
    by progress through their tokens among `items`, as `select` interleaves what it picks."""
    member = np.zeros(len(c), dtype=bool)
    member[items] = True
    order = arrival_order(c, np.flatnonzero(member))
    if order.size == 0:
        return order.astype(np.int64)
    sources = c.source[order]
    lengths = c.length[order].astype(np.float64)
    totals = np.bincount(sources, weights=lengths, minlength=c.num_sources)
    # Tokens ahead of each item in its source (whole numbers: the float sums are exact).
    ahead = np.cumsum(lengths) - lengths - (np.cumsum(totals) - totals)[sources]
    return order[np.argsort(ahead / totals[sources], kind="stable")].astype(np.int64)


def interleaved_head(c: Candidates, member: np.ndarray, longest: int,
                     tokens: float) -> np.ndarray | None:
    """The start of `interleaved(c, np.flatnonzero(member))`, as far as its items of at most
    `longest` tokens hold `tokens` tokens (at least): those items, in order. None when that is
    most of the order (work it out in full then).

    Without sorting every member: a histogram of tokens per (source, position) gives each
    source's cut, the whole positions that the head can reach; only the members before the cuts
    are sorted. Of their order, the part no member past a cut can precede is the head (a
    member past the cut of source s comes after every member that `interleaved` ranks below
    the first one past it: tokens ahead / the source's tokens, then the source)."""
    S = c.num_sources
    span = int(c.position.max()) + 1
    key = c.arrival_key
    # The members' tokens, and the short members': all candidates' less the others' (whole
    # numbers: exact; the members are most of the candidates, the others few).
    tok = c.arrival_tokens_less(np.flatnonzero(~member))
    long_members = np.flatnonzero(member & (c.length > longest))
    short_tok = tok - np.bincount(key[long_members], weights=c.float_length[long_members],
                                  minlength=S * span)
    through = np.cumsum(tok.reshape(S, span), axis=1)
    totals = through[:, -1]
    if float(short_tok.sum()) <= tokens:
        return None
    # The smallest share of every source's tokens whose whole positions hold `tokens` of short
    # members (positions in order of the share they complete).
    share = (through / np.maximum(totals, 1.0)[:, None]).ravel()
    by_share = np.argsort(share, kind="stable")
    enough = np.searchsorted(np.cumsum(short_tok[by_share]), tokens, side="left")
    for _ in range(3):
        if enough >= by_share.size:
            return None
        level = float(share[by_share[enough]])
        if level >= 0.5:
            return None
        start = through - tok.reshape(S, span)               # tokens before each position
        cut = np.array([np.searchsorted(start[s], level * totals[s], side="right")
                        for s in range(S)])
        head = np.flatnonzero(member & (c.position < c.by_source(cut)))
        order = arrival_order(c, head)
        sources = c.source[order]
        lengths = c.length[order].astype(np.float64)
        within = np.bincount(sources, weights=lengths, minlength=S)   # whole positions
        ahead = np.cumsum(lengths) - lengths - (np.cumsum(within) - within)[sources]
        fraction = ahead / np.maximum(totals, 1.0)[sources]
        merged = np.argsort(fraction, kind="stable")
        # The first member past a cut, per source that has one: nothing after it is sure.
        past = np.flatnonzero(within < totals)
        trusted = merged.size
        if past.size:
            first_past = within[past] / totals[past]
            bound = int(np.lexsort((past, first_past))[0])
            bound_fraction, bound_source = first_past[bound], past[bound]
            f, src = fraction[merged], sources[merged]
            trusted = int(np.count_nonzero((f < bound_fraction) |
                                           ((f == bound_fraction) & (src < bound_source))))
        out = order[merged[:trusted]]
        out = out[c.length[out] <= longest]
        if float(c.length[out].sum()) >= tokens:
            return out.astype(np.int64)
        enough = min(2 * enough + 1, by_share.size)
    return None
