"""Length-bucket quotas as virtual sub-sources, and feasible per-step targets. Pure NumPy.

A length quota splits the sources it covers into *virtual sources*: per real source, one bucket
per quota that applies to it (items in the quota's length range) plus the *rest* bucket (every
other item). The planner then selects from virtual sources exactly as from real ones, in arrival
order within each bucket, so a quota costs nothing but a relabelling of `Candidates.source`.

Targets are made feasible top-down, so that source weights stay exact first and quotas are met
within them:
1. per real source: a shortfall (less data in the window than the target) goes to the other
   sources in proportion to their targets (`water_fill`, the rule `select` applies);
2. per quota: its target is split over the sources it covers in proportion to their targets,
   capped by what each has in the bucket; a bucket never gets less than its *natural* part of
   the source (the bucket's share of the source's window), so items in a bucket never pile up
   in the window because the quota is below what the data holds;
3. per real source: its buckets share the source's target, and a bucket's shortfall goes to
   its siblings (`water_fill` again), so the source's total does not move.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


def water_fill(targets: np.ndarray, available: np.ndarray) -> np.ndarray:
    """Cap each target at what is available and hand the surplus to the others in proportion
    to their targets (uniformly when those are all 0), until nothing is short or nothing open.

    The total is kept while the total available allows it. At most len(targets) rounds: each
    round retires at least one target."""
    targets = np.maximum(np.asarray(targets, dtype=np.float64), 0.0).copy()
    available = np.asarray(available, dtype=np.float64)
    for _ in range(targets.size):
        short = targets > available
        if not short.any():
            break
        surplus = float((targets[short] - available[short]).sum())
        targets[short] = available[short]
        open_ = available > targets
        if not open_.any():
            break
        share = targets[open_] if targets[open_].sum() > 0 else np.ones(int(open_.sum()))
        targets[open_] += surplus * share / share.sum()
    return targets


@dataclass(frozen=True)
class Buckets:
    """The static layout of virtual sources.

    Virtual sources are numbered source by source: source s owns ids first[s] .. first[s+1]-1,
    its rest bucket first. `quota_ids[q]` holds, per real source, the virtual id of quota q's
    bucket in that source, or -1 where the quota does not apply.
    """
    virtual_source: np.ndarray    # int32 [V]: the real source of each virtual source
    virtual_quota: np.ndarray     # int32 [V]: the quota of each bucket; -1 for a rest bucket
    low: np.ndarray               # int64 [V]: length range [low, high) of each quota bucket
    high: np.ndarray              # float64 [V]: inf for "no upper bound" and for rest buckets
    first: np.ndarray             # int64 [S + 1]
    quota_ids: np.ndarray         # int64 [Q, S]

    @property
    def num_virtual(self) -> int:
        return int(self.virtual_source.shape[0])

    @staticmethod
    def build(num_sources: int, quotas: Sequence[tuple[int, int, float]]) -> "Buckets":
        """`quotas[q]` = (source index or -1 for every source, min_length, max_length or inf).
        Ranges that can apply to one source must be disjoint (Mixture checks this)."""
        vsource, vquota, low, high, first = [], [], [], [], [0]
        quota_ids = np.full((len(quotas), num_sources), -1, dtype=np.int64)
        for s in range(num_sources):
            vsource.append(s); vquota.append(-1); low.append(0); high.append(np.inf)
            for q, (source, lo, hi) in enumerate(quotas):
                if source in (-1, s):
                    quota_ids[q, s] = len(vsource)
                    vsource.append(s); vquota.append(q); low.append(lo); high.append(hi)
            first.append(len(vsource))
        return Buckets(np.array(vsource, np.int32), np.array(vquota, np.int32),
                       np.array(low, np.int64), np.array(high, np.float64),
                       np.array(first, np.int64), quota_ids)

    def classify(self, source: np.ndarray, length: np.ndarray) -> np.ndarray:
        """The virtual source of each item (its source's rest bucket unless a quota's range
        holds its length)."""
        virtual = self.first[:-1][source].astype(np.int32)
        for v in np.flatnonzero(self.virtual_quota >= 0):
            hit = (source == self.virtual_source[v]) & (length >= self.low[v]) \
                & (length < self.high[v])
            virtual[hit] = v
        return virtual


def bucket_targets(buckets: Buckets, source_targets: np.ndarray, available: np.ndarray,
                   quota_targets: np.ndarray) -> np.ndarray:
    """Targets per virtual source, given feasible per-source targets (step 1 above done),
    what each bucket holds (`available`, [V]) and each quota's wanted total (`quota_targets`,
    [Q], deficits included). Steps 2 and 3 of the module docstring."""
    S = source_targets.shape[0]
    first = buckets.first
    if buckets.num_virtual == S and len(quota_targets) == 0:
        # No quotas: each source is its rest bucket, and the loop below comes to each target
        # capped at what is available (`water_fill` of one item), all at once (the loop's
        # `target - 0.0` is the target, bit for bit)
        targets = np.maximum(np.asarray(source_targets, np.float64), 0.0)
        available = np.asarray(available, np.float64)
        return np.where(targets > available, available, targets)
    source_available = np.add.reduceat(available, first[:-1]) if available.size else np.zeros(S)
    out = np.zeros(buckets.num_virtual)
    for q, wanted in enumerate(quota_targets):
        ids = buckets.quota_ids[q]
        covered = np.flatnonzero((ids >= 0) & (source_targets > 0))
        if covered.size == 0:
            continue
        t = source_targets[covered]
        in_bucket = available[ids[covered]]
        cap = np.minimum(t, in_bucket)
        split = water_fill(wanted * t / t.sum(), cap)
        natural = t * in_bucket / source_available[covered]
        out[ids[covered]] = np.minimum(np.maximum(split, natural), cap)
    for s in range(S):
        lo, hi = first[s], first[s + 1]
        quota_part = out[lo + 1:hi]
        if quota_part.sum() > source_targets[s]:
            quota_part *= source_targets[s] / quota_part.sum()
        out[lo] = source_targets[s] - quota_part.sum()
        out[lo:hi] = water_fill(out[lo:hi], available[lo:hi])
    return out


def token_targets(length: np.ndarray, rank: np.ndarray, position: np.ndarray,
                  virtual: np.ndarray, num_virtual: int, sample_targets: np.ndarray) -> np.ndarray:
    """Sample targets as token targets: per virtual source, the tokens of the first n items in
    arrival order, where n is how many `select` would take for the sample target (it takes
    items while it has fewer than the target). Given these, a token-based `select` takes the
    same items as a sample-based one, as long as nothing reorders the queue (`max_age`)."""
    order = np.lexsort((rank, position, virtual))
    v = virtual[order]
    starts = np.searchsorted(v, v, side="left")
    before = np.arange(v.size) - starts                       # items ahead in the same bucket
    keep = before < sample_targets[v]
    return np.bincount(v[keep], weights=length[order][keep].astype(np.float64),
                       minlength=num_virtual)
