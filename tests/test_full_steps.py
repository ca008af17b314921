"""Full steps over a whole epoch (design invariant 8): on a skewed mix with a one-shard source
and a source of long documents that outlives the others, every planner fills its steps, the
epoch takes about total tokens / (R·M·C) steps, and every sample still arrives exactly once.
Fill is deterministic for a seed, so these are not timing tests."""
from __future__ import annotations

import math

import numpy as np
import pytest

import streamload as sl
from corpus import base_ids, write_jsonl_source
from distributed import run_ranks
from streamload.plan.mixing import QuotaMixer, balanced_clip
from streamload.plan.types import Candidates

pytestmark = pytest.mark.timeout(240)

C, M = 1024, 2
PLANNERS = ("naive", "balanced", "lookahead")


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """Sizes ten times apart, lengths from a few tokens to 16 rows, fewer shards than ranks
    for `chat`, and `books` (long documents) holding far more than its weight consumes."""
    root = tmp_path_factory.mktemp("skewed")
    ids = write_jsonl_source(root, "web", shards=5, per_shard=120, median=300, sigma=1.2, seed=1)
    ids |= write_jsonl_source(root, "code", shards=3, per_shard=60, median=500, sigma=1.3, seed=2)
    ids |= write_jsonl_source(root, "chat", shards=1, per_shard=80, median=60, sigma=1.0, seed=3)
    ids |= write_jsonl_source(root, "books", shards=3, per_shard=30, median=5000, sigma=0.6,
                              seed=4)
    return root, ids


def sources(root):
    return [sl.Source(f"{root}/web", weight=0.4), sl.Source(f"{root}/code", weight=0.3),
            sl.Source(f"{root}/chat", weight=0.15), sl.Source(f"{root}/books", weight=0.15)]


def epoch_job(rank, world, root, planners):
    out = {}
    for planner in planners:
        with sl.Loader(sources(root), micro_batch_tokens=C, micro_batches=M, epochs=1,
                       planner=planner, seed=3) as loader:
            ids, tokens = [], []
            for batch in loader:
                ids += [i for mb in batch.micro_batches for i in mb.sample_ids]
                tokens.append(sum(mb.num_tokens for mb in batch.micro_batches))
            out[planner] = (ids, tokens, loader.stats()["tokens_per_step"])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_planner_fills_its_steps_on_gloo_ranks(skewed, world):
    root, expected = skewed
    results = run_ranks(epoch_job, world, str(root), PLANNERS, timeout=200)
    for planner in PLANNERS:
        ids = [i for r in results for i in r[planner][0]]
        assert len(ids) == len(set(ids)) and set(base_ids(ids)) == expected, planner
        per_rank = [r[planner][1] for r in results]
        assert len({len(t) for t in per_rank}) == 1, planner   # the same steps on every rank
        step_tokens = np.sum(per_rank, axis=0)
        total, steps = int(step_tokens.sum()), len(step_tokens)
        ideal = math.ceil(total / (world * M * C))
        fill = total / (steps * world * M * C)
        assert fill >= 0.95, (planner, fill, steps, ideal)
        assert steps <= 1.05 * ideal, (planner, steps, ideal)
        # stats() reports the job's tokens per step, the same on every rank.
        reported = results[0][planner][2]
        assert reported["fill"] == pytest.approx(fill)
        assert reported["p50"] <= world * M * C and reported["p1"] <= reported["p50"]


def test_balanced_takes_no_more_steps_than_naive_at_one_rank(skewed):
    """At R = 1 there is nothing to balance: a slot left empty only lengthens the epoch."""
    root, _ = skewed
    steps = {}
    for planner in ("naive", "balanced"):
        with sl.Loader(sources(root), micro_batch_tokens=C, micro_batches=M, epochs=1,
                       planner=planner, seed=3) as loader:
            steps[planner] = sum(1 for _ in loader)
    assert steps["balanced"] <= steps["naive"], steps


def test_carries_keep_summing_to_zero_while_sources_run_short_and_leave():
    """A carry moves share between sources and never resizes the step: the active sources'
    carries add up to 0 after every update, with windows that run short (so carries saturate
    at the clip) and sources that leave, and every step's targets add up to the step."""
    rng = np.random.default_rng(0)
    names = ["a", "b", "c", "d"]
    mixer = QuotaMixer(sl.Mixture(), names, [0.4, 0.3, 0.2, 0.1])
    T = 8192
    left = np.array([10**9, 10**9, 40 * T, 60 * T], dtype=np.float64)
    for step in range(400):
        windows = []
        for s in range(4):
            # Source b's window holds a tenth of its share for 100 steps: its carry saturates.
            supply = 0.03 * T if (s == 1 and step < 100) else 3 * T
            n = 0 if left[s] <= 0 else int(max(1, min(supply, left[s]) // 512))
            windows.append(rng.integers(1, 1024, n))
        c = Candidates.from_windows([windows])
        quota = mixer.plan(c, T, step)
        if quota.active.any() and c.length.sum() >= 2 * T:
            assert quota.source_targets.sum() >= T - 1e-6, step
        # Take each source's target in arrival order (what select does, without the planner).
        take, at = [], 0
        for s, w in enumerate(windows):
            before = np.cumsum(w) - w
            take += list(at + np.flatnonzero(before < quota.source_targets[s]))
            at += w.size
        units = mixer.update(quota, np.array(take, dtype=np.int64))
        left -= units
        assert abs(mixer.carry[quota.active].sum()) <= 1e-6 * T, (step, mixer.carry)
        assert np.all(np.abs(mixer.carry) <= T * (1 + 1e-9))


def test_balanced_clip_keeps_the_sum_and_the_bound():
    carry = np.array([12000.0, -5000.0, -4000.0, -3000.0, 700.0])
    shares = np.array([0.3, 0.3, 0.2, 0.2, 0.0])
    active = np.array([True, True, True, True, False])
    out = balanced_clip(carry, shares, active, 8192.0)
    assert out[:4].sum() == pytest.approx(carry[:4].sum(), abs=1e-6)
    assert np.all(np.abs(out) <= 8192.0) and out[4] == 0.0
    assert out[0] == pytest.approx(8192.0)
