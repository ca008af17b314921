"""Cost-aware planning through the whole loader on real gloo ranks: lower imbalance than naive,
with every sample still delivered exactly once."""
from __future__ import annotations

import pytest

from corpus import base_ids, write_jsonl_source
from distributed import run_ranks

pytestmark = pytest.mark.timeout(180)


def imbalance_job(rank, world, root, planners):
    import numpy as np
    import streamload as sl
    out = {}
    for planner in planners:
        with sl.Loader([sl.Source(f"{root}/short", weight=0.6), sl.Source(f"{root}/long", weight=0.4)],
                       micro_batch_tokens=4096, micro_batches=4, epochs=1, planner=planner,
                       cost_a=1 / 512, cost_b=1.0) as loader:
            ids, imbalance = [], []
            for batch in loader:
                ids += [i for mb in batch.micro_batches for i in mb.sample_ids]
                imbalance.append(batch.imbalance)
            # The last steps of an epoch hold what is left: compare full steps only.
            out[planner] = (ids, float(np.mean(imbalance[: max(1, len(imbalance) - 3)])))
    return out


@pytest.fixture
def skewed(tmp_path):
    # Mostly short documents plus a long-tailed source with documents near the row capacity.
    ids = write_jsonl_source(tmp_path, "short", shards=4, per_shard=300, median=120, sigma=0.8, seed=1)
    ids |= write_jsonl_source(tmp_path, "long", shards=4, per_shard=40, median=1800, sigma=0.9, seed=2)
    return tmp_path, ids


@pytest.mark.parametrize("world", [2, 4])
def test_balanced_beats_naive_on_a_skewed_corpus(skewed, world):
    root, expected = skewed
    results = run_ranks(imbalance_job, world, str(root), ["naive", "balanced"])
    by_planner = results[0]
    for planner in ("naive", "balanced"):
        ids = [i for r in results for i in r[planner][0]]
        assert len(ids) == len(set(ids)) and set(base_ids(ids)) == expected, planner
    naive, balanced = by_planner["naive"][1], by_planner["balanced"][1]
    assert balanced < naive, (naive, balanced)
    assert balanced < 1.05, balanced
