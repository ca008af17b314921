"""Mixing: the Mixture spec, schedules, length quotas, exactness bounds, exhaustion and state.

The step loop is simulated the way the runtime runs it, without processes: FIFO windows per
(rank, source) topped up from seeded length streams, `QuotaMixer.quota` -> `select` -> a
capacity check -> `QuotaMixer.update`.
"""
from __future__ import annotations

import msgspec
import numpy as np

import streamload as sl
import pytest

from streamload.config import Source
from streamload.errors import ConfigError
from streamload.plan.cost import CostModel
from streamload.plan.quota_mixer import MixtureState, QuotaMixer
from streamload.plan.mix_spec import LengthQuota, MixPoint, Mixture, Schedule
from streamload.plan.planner import Planner
from streamload.plan.length_buckets import Buckets, water_fill
from streamload.plan.select import select
from streamload.plan.types import Candidates, Geometry

pytestmark = pytest.mark.core

GEOMETRY = Geometry(ranks=2, micro_batches=4, capacity=2048)
T = GEOMETRY.step_tokens            # 16384 tokens a step
C = GEOMETRY.capacity


# ------------------------------------------------------------------------- simulated step loop
class Sim:
    """Windows of every (rank, source), about two steps deep; lengths from per-source streams.
    `medians[s]` sets a source's lengths (lognormal, split at C); `budgets[s]` (tokens) makes a
    source run out."""

    def __init__(self, medians, shares, seed=0, budgets=None, depth_steps=2.0):
        self.S, self.R = len(medians), GEOMETRY.ranks
        self.medians = medians
        self.rngs = [np.random.default_rng([seed, s]) for s in range(self.S)]
        self.left = list(budgets) if budgets is not None else [np.inf] * self.S
        self.depth = depth_steps * np.asarray(shares) * T / self.R + C
        self.items = [[[] for _ in range(self.R)] for _ in range(self.S)]    # [s][r] lengths
        self.ages = [[[] for _ in range(self.R)] for _ in range(self.S)]
        self.refill()

    def _draw(self, s):
        doc = int(max(8, round(self.rngs[s].lognormal(np.log(self.medians[s]), 1.0))))
        return [C] * (doc // C) + ([doc % C] if doc % C else [])

    def refill(self):
        for s in range(self.S):
            for r in range(self.R):
                while sum(self.items[s][r]) < self.depth[s] and self.left[s] > 0:
                    pieces = self._draw(s)
                    self.items[s][r] += pieces
                    self.ages[s][r] += [0] * len(pieces)
                    self.left[s] -= sum(pieces)

    def exhausted(self):
        return np.array([self.left[s] <= 0 for s in range(self.S)])

    def candidates(self) -> Candidates:
        windows = [[np.array(self.items[s][r], dtype=np.int64) for s in range(self.S)]
                   for r in range(self.R)]
        ages = [[np.array(self.ages[s][r], dtype=np.int32) for s in range(self.S)]
                for r in range(self.R)]
        return Candidates.from_windows(windows, ages)

    def commit(self, c: Candidates, take: np.ndarray):
        taken = np.zeros(len(c), dtype=bool)
        taken[take] = True
        for s in range(self.S):
            for r in range(self.R):
                mask = (c.source == s) & (c.rank == r)
                keep = ~taken[mask]
                self.items[s][r] = [x for x, k in zip(self.items[s][r], keep) if k]
                self.ages[s][r] = [a + 1 for a, k in zip(self.ages[s][r], keep) if k]
        self.refill()


def capacity_check(lengths: np.ndarray) -> np.ndarray:
    """First fit into the step's rows, in selection order; the mask of items that fit."""
    room = [C] * GEOMETRY.rows
    fits = np.zeros(lengths.size, dtype=bool)
    for i, length in enumerate(lengths.tolist()):
        for r in range(len(room)):
            if room[r] >= length:
                room[r] -= length
                fits[i] = True
                break
    return fits


def run(mixer: QuotaMixer, sim: Sim, steps: int, *, fit=True, start=0):
    """Returns per-step realized units [steps, S], shares [steps, S], carries, quota records."""
    realized, shares, carries, quotas = [], [], [], []
    for step in range(start, start + steps):
        c = sim.candidates()
        if len(c) == 0:
            break
        q = mixer.quota(c, T, step)
        selected = select(q.candidates, q.targets, counts=q.counts)
        take = selected[capacity_check(c.length[selected])] if fit else selected
        units = mixer.update(q, take)
        realized.append(units)
        shares.append(q.shares)
        carries.append(mixer.carry.copy())
        quotas.append((q, take, c))
        sim.commit(c, take)
    return np.array(realized), np.array(shares), np.array(carries), quotas


def window_dev(realized, shares, K):
    """Max over sliding K-step windows and sources of |realized share - target share|, and the
    smallest window total."""
    totals = realized.sum(axis=1)
    cr = np.vstack([np.zeros(realized.shape[1]), np.cumsum(realized, axis=0)])
    ct = np.vstack([np.zeros(realized.shape[1]), np.cumsum(shares * totals[:, None], axis=0)])
    cn = np.concatenate([[0.0], np.cumsum(totals)])
    n = cn[K:] - cn[:-K]
    dev = np.abs((cr[K:] - cr[:-K]) - (ct[K:] - ct[:-K])) / n[:, None]
    return float(dev.max()), float(n.min())


NAMES = ["web", "code", "books"]
MEDIANS = [300, 600, 1500]
WEIGHTS = [0.5, 0.3, 0.2]


def make(mixture=None, names=NAMES, weights=WEIGHTS, **kw) -> QuotaMixer:
    return QuotaMixer(mixture or Mixture(), names, weights, capacity=C, **kw)


# ------------------------------------------------------------------------------- exactness
def test_carry_bound_when_everything_selected_fits():
    """With every selected item placed, after any step -l < carry_s < p_s * S * l (l: the
    longest item), whatever happened before."""
    mixer = make()
    sim = Sim(MEDIANS, mixer.max_shares())
    realized, shares, carries, _ = run(mixer, sim, 150, fit=False)
    l, S = C, 3
    assert (carries > -l).all()
    assert (carries < shares * S * l).all()
    for K in (1, 10, 50):
        dev, n_min = window_dev(realized, shares, K)
        assert dev <= 2 * np.abs(carries).max() / n_min + 1e-12
        assert dev < 2 * S * l / n_min


def test_realized_mix_within_stated_bound_with_capacity_check():
    mixer = make()
    sim = Sim(MEDIANS, mixer.max_shares(), seed=3)
    realized, shares, carries, _ = run(mixer, sim, 200)
    bound_carry = np.abs(carries).max()
    for K in (1, 10, 100):
        dev, n_min = window_dev(realized, shares, K)
        assert dev <= 2 * bound_carry / n_min + 1e-12, K
    assert window_dev(realized, shares, 100)[0] < 0.005
    assert realized.sum(axis=1).mean() > 0.95 * T       # steps stay full


def test_by_samples():
    mixer = make(Mixture(by="samples", weights={"web": 0.2, "code": 0.3, "books": 0.5}))
    sim = Sim(MEDIANS, [0.1, 0.3, 0.7])
    realized, shares, carries, records = run(mixer, sim, 150)
    assert np.allclose(shares[0], [0.2, 0.3, 0.5])
    assert (np.abs(carries) <= 3 + 2 * GEOMETRY.rows).all()   # S items + what did not fit
    dev, n_min = window_dev(realized, shares, 50)
    assert dev <= 2 * np.abs(carries).max() / n_min + 1e-12
    assert dev < 0.02
    q, take, c = records[-1]
    assert q.counts is not None and (q.counts == 1).all()
    assert mixer.samples.sum() > 0 and mixer.tokens.sum() > mixer.samples.sum()


def test_sample_token_targets_pick_the_same_items_as_counts():
    mixer = make(Mixture(by="samples"))
    sim = Sim(MEDIANS, [0.4, 0.4, 0.4])
    c = sim.candidates()
    q = mixer.quota(c, T, 0)
    by_counts = select(q.candidates, q.targets, counts=q.counts)
    by_tokens = select(q.candidates, q.token_targets)
    assert sorted(by_counts.tolist()) == sorted(by_tokens.tolist())


def test_by_samples_stays_exact_when_overdue_items_jump_the_queue():
    """Overdue (long) items move to the front of their source's queue; token targets derived
    from arrival order then buy fewer samples. Selecting by counts keeps the count, and
    `Planner.assign_quota` selects by counts for a mixture by samples."""
    mixer = make(Mixture(by="samples", weights={"web": 0.5, "code": 0.5, "books": 0.0}))
    rng = np.random.default_rng(3)
    lengths = [[rng.integers(20, 60, 300), rng.integers(20, 60, 300), np.zeros(0, np.int64)]
               for _ in range(GEOMETRY.ranks)]
    ages = [[np.zeros(300, np.int32), np.zeros(300, np.int32), np.zeros(0, np.int32)]
            for _ in range(GEOMETRY.ranks)]
    for r in range(GEOMETRY.ranks):   # web: long overdue items at the back of each window
        lengths[r][0][-3:] = 1500
        ages[r][0][-3:] = 8
    c = Candidates.from_windows(lengths, ages)
    q = mixer.quota(c, T, 0)

    def counts(selected):
        return [int((c.source[selected] == s).sum()) for s in (0, 1)]
    web, code = counts(select(q.candidates, q.targets, max_age=8, counts=q.counts))
    assert abs(web - code) <= 1, (web, code)
    web, code = counts(select(q.candidates, q.token_targets, max_age=8))
    assert code - web > 10, (web, code)      # what planning by tokens would do
    planner = Planner(GEOMETRY, CostModel(1e-9, 1e-6), method="naive", max_age=8)
    web, code = counts(planner.assign_quota(q, 0).take)
    assert abs(web - code) <= 2, (web, code)   # + what did not fit the rows


# ---------------------------------------------------------------------------------- schedules
def test_schedule_linear_and_step_interpolation():
    at, table = np.array([10.0, 20.0]), np.array([[1.0, 0.0], [0.0, 1.0]])
    linear, step = Schedule(at, table, "linear"), Schedule(at, table, "step")
    assert linear(0).tolist() == [1.0, 0.0]                   # before the first point
    assert linear(15).tolist() == [0.5, 0.5]
    assert linear(25).tolist() == [0.0, 1.0]                  # after the last point
    assert step(19.99).tolist() == [1.0, 0.0]
    assert step(20).tolist() == [0.0, 1.0]


def test_linear_curriculum_by_steps_is_followed():
    mixture = Mixture(schedule=[MixPoint(at=0, weights={"web": 0.8, "code": 0.2, "books": 0.0}),
                                MixPoint(at=100, weights={"web": 0.2, "code": 0.2, "books": 0.6})])
    mixer = make(mixture)
    sim = Sim(MEDIANS, mixer.max_shares())
    realized, shares, carries, _ = run(mixer, sim, 150)
    assert np.allclose(shares[0], [0.8, 0.2, 0.0])
    assert np.allclose(shares[50], [0.5, 0.2, 0.3])
    assert np.allclose(shares[120], [0.2, 0.2, 0.6])
    assert realized[0, 2] == 0                                 # books sits the first step out
    for K in (1, 10, 50):
        dev, n_min = window_dev(realized, shares, K)
        assert dev <= 2 * np.abs(carries).max() / n_min + 1e-12


def test_annealing_stages_by_tokens_switch_at_the_step_boundary():
    switch = 40 * T
    mixture = Mixture(schedule_unit="tokens", interpolate="step", schedule=[
        MixPoint(at=0, weights={"web": 0.6, "code": 0.4, "books": 0.0}),
        MixPoint(at=switch, weights={"web": 0.1, "code": 0.2, "books": 0.7})])
    mixer = make(mixture)
    sim = Sim(MEDIANS, mixer.max_shares())
    consumed = []
    realized, shares = [], []
    for step in range(80):
        consumed.append(int(mixer.tokens.sum()))
        r, sh, _, rec = run(mixer, sim, 1, start=step)
        realized.append(r[0]); shares.append(sh[0])
    shares = np.array(shares)
    first = next(i for i, t in enumerate(consumed) if t >= switch)
    assert np.allclose(shares[:first], [0.6, 0.4, 0.0])
    assert np.allclose(shares[first:], [0.1, 0.2, 0.7])
    # Stage 2 on its own is exact too: windows inside it.
    dev, _ = window_dev(np.array(realized)[first + 5:], shares[first + 5:], 20)
    assert dev < 0.02


def test_schedule_is_a_function_of_step_and_tokens_only():
    """Two mixers (two ranks) fed the same summaries agree on every step."""
    mixture = Mixture(schedule=[MixPoint(at=0, weights={"web": 1, "code": 1, "books": 0}),
                                MixPoint(at=30, weights={"web": 0, "code": 1, "books": 1})])
    a, b = make(mixture), make(mixture)
    sim = Sim(MEDIANS, a.max_shares())
    for step in range(40):
        c = sim.candidates()
        qa, qb = a.quota(c, T, step), b.quota(c, T, step)
        assert np.array_equal(qa.targets, qb.targets)
        take = select(qa.candidates, qa.targets)
        a.update(qa, take)
        b.update(qb, take)
        sim.commit(c, take)


# ------------------------------------------------------------------------------ exhaustion
def test_exhaustion_renormalizes_exactly():
    """books runs out; web and code go on in proportion 5:3, exactly within the bound."""
    mixer = make()
    sim = Sim(MEDIANS, mixer.max_shares(), budgets=[np.inf, np.inf, 30 * 0.2 * T])
    realized, shares, carries, _ = run(mixer, sim, 120)
    gone = int(np.argmax(shares[:, 2] == 0))
    assert 20 < gone < 60
    assert np.allclose(shares[gone:], [0.625, 0.375, 0.0])
    assert (carries[gone:, 2] == 0).all()
    # After the hand-over the remaining carries add up to ~0 (no bias toward either).
    assert abs(carries[gone:, :2].sum(axis=1)).max() < 1e-6 * T
    for K in (1, 10, 50):
        dev, n_min = window_dev(realized, shares, K)     # windows across the moment too
        assert dev <= 2 * np.abs(carries).max() / n_min + 1e-12
    after = realized[gone + 1:].sum(axis=0)
    assert after[0] / after[:2].sum() == pytest.approx(0.625, abs=0.005)


def test_outcome_per_policy():
    names = ["a", "b", "c"]
    m = make(Mixture(), names, [1, 1, 1], on_exhausted=["renormalize", "stop", "restart"])
    has = np.array([True, True, True])
    none = np.array([False, False, False])
    assert m.outcome(has, none) == "continue"
    # a ran out: renormalize, go on
    assert m.outcome(np.array([False, True, True]), np.array([True, False, False])) == "continue"
    # b (stop) exhausted but its window still holds items: go on until they are delivered
    assert m.outcome(has, np.array([False, True, False])) == "continue"
    assert m.outcome(np.array([True, False, True]), np.array([False, True, False])) == "stop"
    # per-rank flags: exhausted only when every rank says so
    assert m.outcome(np.array([True, False, True]),
                     np.array([[False, True, False], [False, False, False]])) == "continue"
    # the epoch ends when every non-restart source ran out
    m2 = make(Mixture(), names, [1, 1, 1], on_exhausted=["renormalize", "renormalize", "restart"])
    assert m2.outcome(np.array([False, False, True]), np.array([True, True, False])) == "end_epoch"
    m3 = make(Mixture(), names, [1, 1, 1], on_exhausted=["restart"] * 3)
    assert m3.outcome(has, none) == "continue"
    assert m3.outcome(none, np.array([True, True, True])) == "end_epoch"
    with pytest.raises(ConfigError, match="on_exhausted") as info:   # validated once, by Source
        sl.Source("/data/web", on_exhausted="later")
    assert info.value.key == "on_exhausted"


def test_zero_weight_sources_still_drain_when_nothing_else_is_left():
    mixer = make(Mixture(weights={"web": 1.0, "code": 0.0, "books": 0.0}))
    sim = Sim(MEDIANS, [0.5, 0.5, 0.5], budgets=[0, np.inf, np.inf])
    realized, shares, _, _ = run(mixer, sim, 3)
    assert np.allclose(shares[0], [0.0, 0.5, 0.5])
    assert realized.sum(axis=1).min() > 0.9 * T


def test_a_source_weight_of_zero_is_a_mixture_weight_of_zero():
    """One rule: Source(weight=0) sits out while others have data, then drains, step for step
    as a Mixture's weight 0 does."""
    by_sources = QuotaMixer.from_sources(None, [Source("/d/web/", weight=1.0),
                                                Source("/d/code/", weight=0),
                                                Source("/d/books/", weight=0.0)])
    by_mixture = make(Mixture(weights={"web": 1.0, "code": 0.0, "books": 0.0}))
    runs = []
    for mixer in (by_sources, by_mixture):
        sim = Sim(MEDIANS, [0.5, 0.5, 0.5], budgets=[6 * T, np.inf, np.inf])
        runs.append(run(mixer, sim, 12)[:2])
    (realized, shares), (realized_m, shares_m) = runs
    assert np.array_equal(realized, realized_m) and np.array_equal(shares, shares_m)
    assert np.allclose(shares[0], [1.0, 0.0, 0.0]) and realized[0, 1:].sum() == 0
    assert np.allclose(shares[-1], [0.0, 0.5, 0.5])      # web ran out: the zeros drain


@pytest.mark.parametrize("weights", [[0, 0], [0.0, 0]])
def test_every_source_weight_zero_is_rejected_naming_the_sources(weights):
    sources = [Source("/d/web/", weight=weights[0]), Source("/d/code/", weight=weights[1])]
    with pytest.raises(ConfigError) as info:
        QuotaMixer.from_sources(None, sources)
    assert info.value.key == "sources"
    assert str(info.value).startswith("sources: every source's weight is 0; at least one must "
                                      "be positive")
    QuotaMixer.from_sources(Mixture(weights={"web": 1, "code": 0}), sources)   # overridden


def test_new_epoch_forgets_deficits_but_keeps_the_schedule_position():
    mixer = make()
    sim = Sim(MEDIANS, mixer.max_shares())
    run(mixer, sim, 5)
    assert np.abs(mixer.carry).sum() > 0
    mixer.new_epoch()
    assert not mixer.carry.any() and mixer.step == 5 and mixer.tokens.sum() > 0


# ------------------------------------------------------------------------------ length quotas
def long_share(records, quota_index=0):
    out = []
    for q, take, c in records:
        bucket = q.virtual_quota[q.candidates.source[take]]
        out.append((c.length[take][bucket == quota_index].sum(), c.length[take].sum()))
    return np.array(out, dtype=np.float64)


def test_per_source_length_quota_is_met_every_step():
    """books: 50% of the mix, and at least 30% of every step's tokens from books items >= 1024
    (about 70% of books tokens are; a window of 10 steps holds the floor within its bound)."""
    mixture = Mixture(weights={"web": 0.3, "code": 0.2, "books": 0.5},
                      quotas=[LengthQuota(source="books", min_length=1024, fraction=0.3)])
    mixer = make(mixture)
    sim = Sim(MEDIANS, mixer.max_shares(), seed=1)
    realized, shares, carries, records = run(mixer, sim, 150)
    parts = long_share(records)
    assert (parts[:, 0] / parts[:, 1]).min() >= 0.3 - C / T     # every step, within one item
    # Source weights stay exact with the quota in place.
    dev, n_min = window_dev(realized, shares, 10)
    assert dev <= 2 * np.abs(carries).max() / n_min + 1e-12
    # Only books items count.
    q, take, c = records[0]
    counted = q.virtual_quota[q.candidates.source[take]] == 0
    assert (c.source[take][counted] == 2).all() and (c.length[take][counted] >= 1024).all()


def test_global_length_quota_pulls_long_items_forward():
    """At least 25% of tokens from items >= 1536 of any source: arrival order alone gives less
    in many steps; the quota lifts every step to the floor (one item of slack)."""
    quota = LengthQuota(min_length=1536, fraction=0.25)
    plain, floor = make(), make(Mixture(quotas=[quota]))
    _, _, _, records_plain = run(plain, Sim(MEDIANS, plain.max_shares(), seed=2), 100)
    _, _, _, records = run(floor, Sim(MEDIANS, floor.max_shares(), seed=2), 100)
    def share(recs):
        return np.array([c.length[t][c.length[t] >= 1536].sum() / c.length[t].sum()
                         for _, t, c in recs])
    assert share(records_plain).min() < 0.25 - C / T        # the floor is not free
    assert share(records).min() >= 0.25 - C / T
    assert floor.quota_carry.max() <= C


def test_quota_below_what_the_data_holds_does_not_hold_it_back():
    """A small floor must not keep long items waiting: they flow at their natural share, as
    without the quota, and wait no longer."""
    quota = LengthQuota(source="books", min_length=1024, fraction=0.01)
    results = []
    for mixture in (Mixture(), Mixture(quotas=[quota])):
        mixer = make(mixture)
        _, _, _, records = run(mixer, Sim(MEDIANS, mixer.max_shares(), seed=4), 100)
        long_tokens = sum(c.length[t][(c.source[t] == 2) & (c.length[t] >= 1024)].sum()
                          for _, t, c in records)
        total = sum(c.length[t].sum() for _, t, c in records)
        age = np.mean([np.average(c.age[t], weights=c.length[t]) for _, t, c in records[10:]])
        results.append((long_tokens / total, age))
    (plain_share, plain_age), (share, age) = results
    assert share > 0.1 and share == pytest.approx(plain_share, rel=0.05)
    assert age <= plain_age + 1.0


def test_quota_on_a_source_that_runs_out_is_dropped():
    mixture = Mixture(quotas=[LengthQuota(source="books", min_length=1024, fraction=0.1)])
    mixer = make(mixture)
    sim = Sim(MEDIANS, mixer.max_shares(), budgets=[np.inf, np.inf, 20 * 0.2 * T])
    realized, shares, carries, records = run(mixer, sim, 60)
    q = records[-1][0]
    assert not q.active[2] and q.quota_fractions[0] == 0
    assert mixer.quota_carry[0] == 0
    assert realized[-10:].sum(axis=1).min() > 0.9 * T          # the others fill the steps


def test_relabelled_candidates_keep_items_and_order():
    mixer = make(Mixture(quotas=[LengthQuota(min_length=1024, max_length=2048, fraction=0.1),
                                 LengthQuota(source="web", min_length=2048, fraction=0.05)]))
    c = Sim(MEDIANS, [0.5] * 3).candidates()
    q = mixer.quota(c, T, 0)
    v = q.candidates
    assert np.array_equal(v.length, c.length) and np.array_equal(v.rank, c.rank)
    assert np.array_equal(q.virtual_source[v.source], c.source)
    assert v.num_sources == len(q.targets) == 3 + 3 + 1
    long_web = (c.source == 0) & (c.length >= 2048)
    assert (q.virtual_quota[v.source[long_web]] == 1).all()
    mid = (c.length >= 1024) & (c.length < 2048)
    assert (q.virtual_quota[v.source[mid]] == 0).all()
    assert (q.virtual_quota[v.source[~mid & ~long_web]] == -1).all()
    # Source targets are kept: buckets add up to their source's target.
    per_source = np.bincount(q.virtual_source, weights=q.targets, minlength=3)
    assert np.allclose(per_source, q.source_targets)


def test_planner_takes_relabelled_candidates():
    mixer = make(Mixture(quotas=[LengthQuota(min_length=1024, fraction=0.2)]))
    sim = Sim(MEDIANS, mixer.max_shares())
    for method in ("naive", "balanced", "lookahead"):
        planner = Planner(GEOMETRY, CostModel(a=1 / 4096), method=method)
        c = sim.candidates()
        q = mixer.quota(c, T, 0)
        a = planner.assign(q.candidates, q.token_targets, 0)
        assert len(a) > 0 and c.length[a.take].sum() <= T


# --------------------------------------------------------------------------------- helpers
def test_water_fill_keeps_the_total_and_caps():
    out = water_fill([50, 30, 20], [10, 100, 100])
    assert out.tolist()[0] == 10 and out.sum() == pytest.approx(100)
    assert out[1] / out[2] == pytest.approx(1.5)
    assert water_fill([5, 5], [1, 2]).tolist() == [1, 2]      # not enough anywhere
    assert water_fill([4, 0, 0], [1, 3, 3]).tolist() == [1, 1.5, 1.5]


def test_buckets_layout():
    b = Buckets.build(2, [(-1, 100, np.inf), (1, 10, 100)])
    assert b.virtual_source.tolist() == [0, 0, 1, 1, 1]
    assert b.virtual_quota.tolist() == [-1, 0, -1, 0, 1]
    got = b.classify(np.array([0, 0, 1, 1, 1]), np.array([5, 150, 5, 50, 150]))
    assert got.tolist() == [0, 1, 2, 4, 3]


def test_select_counts_makes_targets_sample_counts():
    c = Candidates.from_windows([[np.array([100, 200, 300, 400]), np.array([50, 50])]])
    got = select(c, np.array([2.0, 1.0]), counts=np.ones(len(c)))
    assert sorted(got.tolist()) == [0, 1, 4]
    assert sorted(select(c, np.array([250.0, 60.0])).tolist()) == [0, 1, 4, 5]   # tokens


def test_max_shares_over_the_schedule():
    mixture = Mixture(schedule=[MixPoint(at=0, weights={"a": 1, "b": 0}),
                                MixPoint(at=10, weights={"a": 1, "b": 3})])
    assert mixture.max_shares(["a", "b"], [1, 1]).tolist() == [1.0, 0.75]


def test_from_sources():
    sources = [Source("s3://b/web/", weight=2.0), Source("/data/code/", weight=1.0)]
    m = QuotaMixer.from_sources(None, sources)
    assert m.names == ["web", "code"] and m.weights.tolist() == [2.0, 1.0]


# ------------------------------------------------------------------------------------- state
def test_state_round_trip_resumes_exactly():
    mixture = Mixture(schedule_unit="tokens", schedule=[
        MixPoint(at=0, weights={"web": 1, "code": 1, "books": 0}),
        MixPoint(at=50 * T, weights={"web": 0, "code": 1, "books": 1})],
        quotas=[LengthQuota(min_length=1024, fraction=0.2)])
    a = make(mixture)
    sim = Sim(MEDIANS, a.max_shares())
    run(a, sim, 30)
    blob = msgspec.json.encode(a.to_state())
    state = msgspec.json.decode(blob, type=MixtureState)
    assert state.step == 30 and sum(state.tokens) > 0 and len(state.quota_carry) == 1
    b = make(mixture)
    b.load_state(state)
    for step in range(30, 60):
        c = sim.candidates()
        qa, qb = a.quota(c, T, step), b.quota(c, T, step)
        assert np.array_equal(qa.targets, qb.targets) and np.array_equal(qa.shares, qb.shares)
        take = select(qa.candidates, qa.targets)
        a.update(qa, take)
        b.update(qb, take)
        sim.commit(c, take)
    assert a.to_state() == b.to_state()


def test_load_state_checks_sources():
    state = make().to_state()
    with pytest.raises(ConfigError, match="saved for sources"):
        make(Mixture(), ["web", "code", "math"], WEIGHTS).load_state(state)
    edited = make(Mixture(quotas=[LengthQuota(min_length=1024, fraction=0.1)]))
    edited.load_state(state)                      # a quota added: its deficit starts at 0
    assert edited.quota_carry.tolist() == [0.0]


# -------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, match", [
    (dict(by="bytes"), r"mixture\.by: must be 'tokens' or 'samples'"),
    (dict(schedule_unit="epochs"), r"mixture\.schedule_unit"),
    (dict(interpolate="cubic"), r"mixture\.interpolate"),
    (dict(weights={"web": -1.0}), r"mixture\.weights\.web: must be a finite number >= 0"),
    (dict(weights={"web": float("nan")}), r"mixture\.weights\.web"),
    (dict(schedule=[MixPoint(at=5, weights={"a": 1}), MixPoint(at=5, weights={"a": 2})]),
     r"mixture\.schedule\[1\]\.at: points must be in increasing order"),
    (dict(schedule=[{"at": 0, "weights": {"a": 1}, "bogus": 1}]),
     r"mixture\.schedule\[0\]: unknown key\(s\) bogus"),
    (dict(schedule=[{"at": -1, "weights": {"a": 1}}]), r"mixture\.schedule\[0\]\.at"),
    (dict(weights={"a": 1.0}, schedule=[MixPoint(at=0, weights={"a": 1})]),
     r"mixture\.weights: give either weights or a schedule"),
    (dict(quotas=[LengthQuota(min_length=100, fraction=0.1),
                  LengthQuota(source="a", min_length=50, max_length=150, fraction=0.1)]),
     r"mixture\.quotas\[1\]: .* overlaps quotas\[0\]"),
    (dict(quotas=[LengthQuota(min_length=100, fraction=0.7),
                  LengthQuota(max_length=100, fraction=0.6)]),
     r"mixture\.quotas: fractions add up to 1\.3"),
    (dict(quotas=[{"fraction": 2.0}]), r"mixture\.quotas\[0\]\.fraction: must be a number in"),
])
def test_mixture_rejects(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Mixture(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(fraction=0), r"LengthQuota\.fraction"),
    (dict(fraction=0.1, min_length=0), r"LengthQuota\.min_length"),
    (dict(fraction=0.1, min_length=10, max_length=10), r"LengthQuota\.max_length: must be .* > min_length"),
    (dict(fraction=0.1, source=""), r"LengthQuota\.source"),
])
def test_length_quota_rejects(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LengthQuota(**kwargs)


@pytest.mark.parametrize("mixture, match", [
    (Mixture(weights={"web": 1, "code": 1, "math": 1}), r"mixture\.weights\.math: unknown source"),
    (Mixture(weights={"web": 1, "code": 1}), r"mixture\.weights: missing source\(s\) books"),
    (Mixture(schedule=[MixPoint(at=0, weights={"web": 1, "code": 1, "books": 1}),
                       MixPoint(at=9, weights={"web": 1, "code": 1})]),
     r"mixture\.schedule\[1\]\.weights: missing source\(s\) books"),
    (Mixture(schedule=[MixPoint(at=0, weights={"web": 0, "code": 0, "books": 0})]),
     r"mixture\.schedule\[0\]\.weights: every source's weight is 0"),
    (Mixture(quotas=[LengthQuota(source="math", fraction=0.1)]),
     r"mixture\.quotas\[0\]\.source: unknown source 'math'"),
    (Mixture(quotas=[LengthQuota(min_length=4096, fraction=0.1)]),
     r"mixture\.quotas\[0\]\.min_length: 4096 is more than micro_batch_tokens \(2048\)"),
    (Mixture(quotas=[LengthQuota(source="books", min_length=1000, fraction=0.3)]),
     r"mixture\.quotas\[0\]\.fraction: 0\.3 of every step from source 'books', but its share is only 0\.2"),
])
def test_mixture_check_against_sources(mixture, match):
    with pytest.raises(ConfigError, match=match):
        make(mixture)


def test_bucket_targets_without_quotas_cap_each_source_as_water_fill_does():
    """No quotas: each source's target capped at what it holds, as `water_fill` of its one
    bucket gives it (the per-source loop `bucket_targets` skips then), bit for bit."""
    from streamload.plan.length_buckets import bucket_targets
    rng = np.random.default_rng(7)
    buckets = Buckets.build(5, [])
    for _ in range(200):
        targets = rng.choice([0.0, -0.0, 1.5, 1e6], 5) * rng.random(5)
        available = rng.choice([0.0, 3.0, 1e5, 1e7], 5) * rng.random(5)
        out = bucket_targets(buckets, targets, available, np.zeros(0))
        expect = np.concatenate([water_fill(targets[s:s + 1] - 0.0, available[s:s + 1])
                                 for s in range(5)])
        assert out.tobytes() == expect.tobytes()


def test_the_quota_passes_the_candidates_layout_on_without_length_buckets():
    """`QuotaMixer.quota` relabels the candidates by virtual source. Without length buckets
    the labels are the sources themselves, and what the candidates know of their layout
    (`Candidates.known_windows`, as `from_windows` and the decoded summaries know it) reaches
    the planner with them; with buckets the labels change, and the layout is found again."""
    from streamload.plan.types import Candidates
    rng = np.random.default_rng(0)
    windows = [[rng.integers(100, 3000, int(rng.integers(1, 20))) for _ in NAMES]
               for _ in range(3)]
    c = Candidates.from_windows(windows)
    relabelled = make().quota(c, 4 * C, 0).candidates
    assert np.array_equal(relabelled.source, c.source)
    for name in ("window_bounds", "_source_bounds", "dense_positions"):
        assert name in vars(relabelled)
    searched = Candidates(c.length, c.source, c.rank, c.position, c.age, c.extra_cost,
                          c.num_sources, c.num_ranks)
    assert np.array_equal(relabelled.window_bounds, searched.window_bounds)
    bucketed = make(Mixture(quotas=[LengthQuota(min_length=1536, fraction=0.25)])) \
        .quota(Candidates.from_windows(windows), 4 * C, 0).candidates
    assert "window_bounds" not in vars(bucketed)
    assert bucketed.num_sources > len(NAMES)
