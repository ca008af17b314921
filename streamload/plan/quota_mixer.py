"""Per-step quotas from a Mixture, with carried deficits: the realized mix tracks the target
over every window of steps, deterministically, instead of drifting like independent draws.

The driver is `QuotaMixer`. It is a pure, deterministic state machine: every rank can run it on
the gathered summaries and get the same answer, so the schedule changes at step boundaries
identically everywhere. Each step:

    mixer = QuotaMixer.from_sources(mixture, sources)          # once
    quota = mixer.quota(candidates, step_tokens, step)           # every step
    assignment = planner.assign_quota(quota, step)
    mixer.update(quota, assignment.take)                        # every step
    mixer.new_epoch()                                           # at an epoch boundary
    mixer.outcome(has_data, exhausted)                          # "continue" | "end_epoch" | "stop"
    state = mixer.to_state(); mixer.load_state(state)           # resumption

`quota.candidates` are the same items in the same order as `candidates`, with `source`
renumbered to virtual sources (length buckets, see `length_buckets.py`), so `assignment.take` indexes
both. `quota.targets` are in the mixture's unit (tokens, or samples with `counts=quota.counts`
for `select`); `quota.token_targets` are the same targets in tokens, for planners that count
tokens only.

How a step's targets are made (unit U = tokens, or samples when `by="samples"`):
- p_s: the schedule's weights at this step (or at the tokens consumed so far), over the
  sources that have data, normalized.
- T: the step's size in U: `step_tokens`, or for samples `step_tokens` divided by the mean item
  length the mix would give (from the windows).
- target_s = max(p_s * T + carry_s, 0), made feasible against the windows (`length_buckets.py`).
After the step, with N the realized total and r_s the realized part of source s:
    carry_s += p_s * N - r_s        (clipped to one step's worth, T)
so carry_s is exactly the cumulative shortfall of source s against its share of what was
delivered. A quota q with fraction f carries its deficit the same way, floored at 0 (a floor
that the data exceeds owes nothing back).

Exactness. Over any window of steps [a, b) the realized units of source s differ from its
target share of the window's units by carry_s(a) - carry_s(b), so
    |realized share - target share| <= 2 * max|carry| / N_window.
`select` ends each (virtual) source at most one item over its target, so after any step, with
no window short and nothing clipped, -n_s*l - D < carry_s < p_s*V*l + D, whatever came before
(l: the longest item, 1 for samples; n_s: buckets of source s, V: all buckets, 1 and S without
quotas; D: units selected but not placed by packing). Shortfalls (a window with less than a
source's target) and clipping are outside the bound; `benchmarks/mixing.py` measures all of it.
The proof is in docs/mixing.md.

When a source runs out (`renormalize`), the others go on in proportion to their weights, and
its carry is handed to them in proportion to their shares, so their carries again add up to 0
and their mutual proportions stay exact.

"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import msgspec
import numpy as np

from ..errors import ConfigError
from .mix_spec import Mixture, Schedule
from .length_buckets import Buckets, bucket_targets, token_targets, water_fill
from .types import Candidates

CARRY_CLIP_STEPS = 1.0   # carries are clipped to this many steps' worth of units


class MixtureState(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a QuotaMixer needs to resume exactly: the schedule's position (step, tokens)
    and the carried deficits. Plain data; encodes with msgspec (JSON, msgpack)."""
    sources: tuple[str, ...]
    step: int = 0                        # steps consumed (the next step's index)
    tokens: tuple[int, ...] = ()         # per source, tokens consumed since the start
    samples: tuple[int, ...] = ()        # per source, samples consumed since the start
    carry: tuple[float, ...] = ()        # per source, in the mixture's unit
    quota_carry: tuple[float, ...] = ()  # per quota, in the mixture's unit (deficits, >= 0)


@dataclass(frozen=True)
class StepQuota:
    """One step's answer from `QuotaMixer.quota`."""
    step: int
    candidates: Candidates         # the same items; source = virtual source id
    targets: np.ndarray            # float64 [V], in the mixture's unit, feasible
    token_targets: np.ndarray      # float64 [V], the same in tokens
    counts: Optional[np.ndarray]   # per candidate, for select(counts=); None when by tokens
    virtual_source: np.ndarray     # int32 [V]: real source of each virtual source
    virtual_quota: np.ndarray      # int32 [V]: quota of each bucket, -1 for the rest
    shares: np.ndarray             # float64 [S]: p_s, the scheduled shares this step
    active: np.ndarray             # bool [S]: sources with data in their windows
    source_targets: np.ndarray     # float64 [S], in the unit, after redistribution
    quota_fractions: np.ndarray    # float64 [Q]: each quota's effective fraction this step
    total: float                   # T, the step's size in the unit


def balanced_clip(carry: np.ndarray, shares: np.ndarray, active: np.ndarray,
                  clip: float) -> np.ndarray:
    """`carry` clipped to [-clip, clip] without changing its sum over the `active` sources.

    A carry moves share between sources; it must never grow or shrink the step, whose size is
    the shares' sum times T. So the active sources' carries add up to 0, as they do before any
    clip (Σ(p_s·N - r_s) = 0). A plain per-source clip broke that when one side saturated: a
    source whose window ran short for a while sat at +clip while the others kept going down,
    and once it left, the others' summed target was T minus that drift for the rest of the
    epoch (a step shrank to a quarter of its size this way). Here the clipped amount is handed
    back to the sources with a share, in proportion to it: a shift of λ·p_s, with λ found by
    bisection (Σ clip(c - λ·p) is monotone in λ)."""
    out = np.where(active, np.clip(carry, -clip, clip), 0.0)
    free = active & (shares > 0)
    want = float(carry[active].sum()) - float(out[active & ~free].sum())
    if not free.any() or abs(float(out[free].sum()) - want) <= 1e-9 * clip:
        return out
    c, p = carry[free], shares[free]
    want = float(np.clip(want, -clip * c.size, clip * c.size))   # reachable inside the box
    lo = float(((c - clip) / p).min())   # every carry at +clip
    hi = float(((c + clip) / p).max())   # every carry at -clip
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if np.clip(c - mid * p, -clip, clip).sum() > want:
            lo = mid
        else:
            hi = mid
    out[free] = np.clip(c - 0.5 * (lo + hi) * p, -clip, clip)
    return out


class QuotaMixer:
    """Turns a `Mixture` into per-step quotas and keeps the state that makes them exact."""

    def __init__(self, mixture: Mixture, names: Sequence[str], weights: Sequence[float], *,
                 on_exhausted: Optional[Sequence[str]] = None, capacity: Optional[int] = None):
        self.mixture = mixture
        self.names = list(names)
        mixture.check(self.names, weights, capacity=capacity)
        S = len(self.names)
        self.on_exhausted = list(on_exhausted or ["renormalize"] * S)   # validated by Source
        self.by_tokens = mixture.by == "tokens"
        self.schedule = Schedule(*mixture.weight_table(self.names, weights), mixture.interpolate)
        self.base_weights = mixture.base_weights(self.names, weights)
        self.quotas = list(mixture.quotas)
        self.buckets = Buckets.build(S, [
            (-1 if q.source is None else self.names.index(q.source), q.min_length, q.upper)
            for q in self.quotas])
        self.quota_covers = np.array(
            [[q.source is None or q.source == n for n in self.names] for q in self.quotas],
            dtype=bool).reshape(len(self.quotas), S)
        self.step = 0
        self.tokens = np.zeros(S, dtype=np.int64)
        self.samples = np.zeros(S, dtype=np.int64)
        self.carry = np.zeros(S)
        self.quota_carry = np.zeros(len(self.quotas))

    @classmethod
    def from_sources(cls, mixture: Optional[Mixture], sources, *,
                     capacity: Optional[int] = None) -> "QuotaMixer":
        """From `Source`s: names, weights and (where the Source has it) `on_exhausted`."""
        return cls(mixture or Mixture(), [s.name for s in sources], [s.weight for s in sources],
                   on_exhausted=[getattr(s, "on_exhausted", "renormalize") for s in sources],
                   capacity=capacity)

    @property
    def num_sources(self) -> int:
        return len(self.names)

    @property
    def weights(self) -> np.ndarray:
        """The base weights, e.g. for sizing buffers."""
        return self.base_weights

    def max_shares(self) -> np.ndarray:
        """The largest share each source reaches on the schedule: size windows by this."""
        return self.mixture.max_shares(self.names, self.base_weights)

    def position(self) -> float:
        """Where the schedule stands: the step, or the tokens consumed so far."""
        if self.mixture.schedule_unit == "steps":
            return float(self.step)
        return float(self.tokens.sum())

    def shares_at(self, active: np.ndarray) -> np.ndarray:
        """p_s: the schedule's weights now, over the active sources, normalized. When every
        active source has weight 0, they share equally (a step never stalls while data is left,
        the rule `select` applies to shortfalls)."""
        w = np.where(active, self.schedule(self.position()), 0.0)
        if w.sum() > 0:
            return w / w.sum()
        return active / active.sum() if active.any() else np.zeros(active.shape)

    # -- each step ---------------------------------------------------------------------------
    def quota(self, c: Candidates, step_tokens: int, step: Optional[int] = None) -> StepQuota:
        """This step's targets. `step` is the runtime's step counter (the schedule's position
        when schedule_unit="steps"); it must match the mixer's own after a resume."""
        S = self.num_sources
        if c.num_sources != S:
            raise ValueError(f"candidates have {c.num_sources} sources, the mixture {S}")
        if step is not None:
            self.step = int(step)
        b = self.buckets
        # Without length buckets every item's virtual source is its own: the same labels, and
        # what the candidates know of their layout holds for the relabelled ones (below).
        same = b.num_virtual == S and c.source.dtype == np.int32
        virtual = c.source if same else b.classify(c.source, c.length)
        units = c.length.astype(np.float64) if self.by_tokens else np.ones(len(c))
        available = np.bincount(virtual, weights=units, minlength=b.num_virtual)
        source_available = np.bincount(c.source, weights=units, minlength=S)
        active = source_available > 0
        shares = self.shares_at(active)
        self._hand_over(active, shares)

        if self.by_tokens:
            total = float(step_tokens)
        else:   # samples per step: the tokens of a step over the mean item length of the mix
            source_tokens = np.bincount(c.source, weights=c.length, minlength=S)
            mean = np.divide(source_tokens, source_available, out=np.zeros(S), where=active)
            per_sample = float((shares * mean).sum())
            total = step_tokens / per_sample if per_sample > 0 else 0.0
        targets = water_fill(np.maximum(shares * total + np.where(active, self.carry, 0.0), 0.0),
                             source_available)
        fractions = np.array([min(q.fraction, float(shares[cover].sum()))
                              for q, cover in zip(self.quotas, self.quota_covers)])
        wanted = np.maximum(fractions * total + self.quota_carry, 0.0)
        virtual_targets = bucket_targets(b, targets, available, wanted)
        if self.by_tokens:
            tokens = virtual_targets
        else:
            tokens = token_targets(c.length, c.rank, c.position, virtual, b.num_virtual,
                                   virtual_targets)
        relabelled = Candidates(c.length, virtual, c.rank, c.position, c.age, c.extra_cost,
                                b.num_virtual, c.num_ranks, c.divisible, c.images, c.patches)
        if same:
            relabelled.keep_layout(c)
        if "has_extra_cost" in vars(c):   # the same extra costs: what is known of them holds
            relabelled.__dict__["has_extra_cost"] = c.has_extra_cost
        return StepQuota(self.step, relabelled, virtual_targets, tokens,
                         None if self.by_tokens else np.ones(len(c)), b.virtual_source,
                         b.virtual_quota, shares, active, targets, fractions, total)

    def update(self, quota: StepQuota, take: np.ndarray,
               lengths: Optional[np.ndarray] = None) -> np.ndarray:
        """Feed back what the step took (indices into quota.candidates, i.e. into the
        candidates given to `plan`; `lengths`, the tokens taken of each, when the plan cut
        some). Returns the realized units per source."""
        S = self.num_sources
        take = np.asarray(take, dtype=np.int64)
        virtual = quota.candidates.source[take]
        source = quota.virtual_source[virtual]
        lengths = quota.candidates.length[take] if lengths is None else np.asarray(lengths)
        tokens = np.bincount(source, weights=lengths, minlength=S).astype(np.int64)
        samples = np.bincount(source, minlength=S).astype(np.int64)
        units = (tokens if self.by_tokens else samples).astype(np.float64)
        N = float(units.sum())
        clip = CARRY_CLIP_STEPS * max(quota.total, 1.0)
        carry = self.carry + quota.shares * N - units
        self.carry = balanced_clip(carry, quota.shares, quota.active, clip)
        if self.quotas:
            bucket = quota.virtual_quota[virtual]
            hit = bucket >= 0
            weights = lengths[hit].astype(np.float64) if self.by_tokens else None
            realized = np.bincount(bucket[hit], weights=weights, minlength=len(self.quotas))
            self.quota_carry = np.clip(self.quota_carry + quota.quota_fractions * N - realized,
                                       0.0, clip)
        self.tokens += tokens
        self.samples += samples
        self.step = quota.step + 1
        return units

    def _hand_over(self, active: np.ndarray, shares: np.ndarray) -> None:
        """A source that left (ran out) hands its carry to the active ones by share, so theirs
        add up to 0 again; quotas over sources that all left forget their deficits."""
        gone = ~active & (self.carry != 0)
        if gone.any():
            if shares.sum() > 0:
                self.carry = self.carry + self.carry[gone].sum() * shares
            self.carry[~active] = 0.0
        for q, cover in enumerate(self.quota_covers):
            if not (cover & active).any():
                self.quota_carry[q] = 0.0

    def new_epoch(self) -> None:
        """Every source starts over: deficits are forgotten, counters (the schedule) go on."""
        self.carry[:] = 0.0
        self.quota_carry[:] = 0.0

    # -- exhaustion ------------------------------------------------------------------------------
    def outcome(self, has_data: np.ndarray, exhausted: np.ndarray) -> str:
        """What the run does now, from each source's state: `has_data[s]`, the windows hold
        items of s; `exhausted[s]` (or `[rank, s]`, all ranks), s has no more this epoch.

        "stop" when a source with on_exhausted="stop" has run out; "end_epoch" when every source
        that is not "restart" has run out (every source, if all are "restart"); else
        "continue"."""
        has_data = np.asarray(has_data, dtype=bool)
        exhausted = np.asarray(exhausted, dtype=bool)
        if exhausted.ndim == 2:
            exhausted = exhausted.all(axis=0)
        gone = exhausted & ~has_data
        stops, finite = self._policies
        if (gone & stops).any():
            return "stop"
        if gone[finite].all() if finite.any() else gone.all():
            return "end_epoch"
        return "continue"

    @cached_property
    def _policies(self) -> tuple[np.ndarray, np.ndarray]:
        """`on_exhausted` (fixed) as masks: the sources that stop the run, those that end."""
        policy = np.array(self.on_exhausted)
        return policy == "stop", policy != "restart"

    # -- state -------------------------------------------------------------------------------------
    def to_state(self) -> MixtureState:
        return MixtureState(sources=tuple(self.names), step=self.step,
                            tokens=tuple(int(t) for t in self.tokens),
                            samples=tuple(int(s) for s in self.samples),
                            carry=tuple(float(c) for c in self.carry),
                            quota_carry=tuple(float(c) for c in self.quota_carry))

    def load_state(self, state: MixtureState) -> None:
        """Resume. The sources must be the same; a changed number of quotas (an edited
        mixture) starts their deficits at 0."""
        if list(state.sources) != self.names:
            raise ConfigError(f"mixture state: saved for sources {list(state.sources)}, "
                              f"but this mixture has {self.names}")
        S = self.num_sources
        for key in ("tokens", "samples", "carry"):
            if len(getattr(state, key)) != S:
                raise ConfigError(f"mixture state: {key} has {len(getattr(state, key))} entries "
                                  f"for {S} sources")
        self.step = int(state.step)
        self.tokens = np.array(state.tokens, dtype=np.int64)
        self.samples = np.array(state.samples, dtype=np.int64)
        self.carry = np.array(state.carry, dtype=np.float64)
        self.quota_carry = (np.array(state.quota_carry, dtype=np.float64)
                            if len(state.quota_carry) == len(self.quotas)
                            else np.zeros(len(self.quotas)))
