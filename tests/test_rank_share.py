"""A rank's share of the job (`job.RankShare`, what a rank other than 0 keeps under gather)
against the whole job model: the same sources read, the same starting buffers, the same shards
in its fetchers' layouts, this epoch and later ones, fresh and resumed (at the same and at
another world size, in a later epoch), with readers chosen by hand and automatically. No
process group: the job model driven over synthetic lengths as in test_job.py."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from streamload.config import LoaderConfig, Source
from streamload.job import JobModel, RankShare, data_options, layout_feed, step_windows
from streamload.plan.windows import ItemQueue, Windows
from streamload.state import (OneRank, dealt_again_holding, decode_state, encode_state,
                             layout_from_progress, redeals)

from test_job import C, shard_blocks

pytestmark = pytest.mark.core


def make_sources(S: int, seed: int) -> list[Source]:
    """S sources of different weights; every fourth endless, every third with one reader by
    hand, the rest with readers chosen automatically."""
    rng = np.random.default_rng(seed)
    return [Source(f"/x/s{s}/", weight=float(rng.uniform(0.2, 2.0)), name=f"s{s}",
                   on_exhausted="restart" if s % 4 == 3 else "renormalize",
                   readers=1 if s % 3 == 1 else None) for s in range(S)]


def make_docs(S: int, ranks: int, seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng([seed, S, ranks])
    return [[np.maximum(rng.lognormal(np.log(60), 0.7, int(rng.integers(4, 12))), 1)
             .astype(np.int64) for _ in range(int(rng.integers(1, max(2, ranks))))]
            for _ in range(S)]


def config(epochs: int) -> LoaderConfig:
    return LoaderConfig(micro_batch_tokens=C, micro_batches=1, seed=5, epochs=epochs,
                        planner="naive")


def names(docs) -> list[list[str]]:
    return [[f"{s}-{k}" for k in range(len(d))] for s, d in enumerate(docs)]


def full_job(sources, docs, ranks: int, epochs: int, state=None) -> JobModel:
    cfg = config(epochs)
    job = JobModel.build(cfg, sources, None, ranks, data=data_options(cfg, sources, None))
    job.listed(names(docs))
    if state is not None:
        job.load(state)
    job.start()
    return job


def share(sources, docs, ranks: int, rank: int, epochs: int, state=None) -> RankShare:
    cfg = config(epochs)
    mine = RankShare.build(cfg, sources, None, ranks, rank,
                           data=data_options(cfg, sources, None))
    mine.listed(names(docs))
    if state is not None:
        mine.load(state)
    mine.start()
    return mine


def blocks_for(docs):
    return [shard_blocks(d) for d in docs]   # C = 128 there too


def windows_for(job: JobModel, blocks) -> Windows:
    return Windows([[ItemQueue(layout_feed(
        job.layout_for(s, job.epoch).stream(r) if job.endless(s)
        else job.layout_for(s, job.epoch).rank_units(r), blocks[s],
        job.resume_ages[s] if job.resumed() else None))
        for s in range(len(blocks))] for r in range(job.world)])


def saved_after(job: JobModel, blocks, epoch: int, steps: int):
    """Drive `job` into `epoch`, then `steps` steps into it: the state then (decoded)."""
    windows, taken = windows_for(job, blocks), 0
    while job.epoch < epoch or taken < steps:
        step, _, plan = step_windows(job, windows)
        if step.outcome == "end_epoch":
            assert not job.end_epoch()
            windows = windows_for(job, blocks)
            continue
        assert plan is not None
        taken += job.epoch == epoch
    return decode_state(encode_state(job.state(job.snapshot())))


def units(layout, rank: int, endless: bool, count: int = 40) -> list:
    stream = layout.stream(rank) if endless else iter(layout.rank_units(rank))
    return list(itertools.islice(stream, count))


def assert_same_share(job: JobModel, docs, ranks_to_check, state=None) -> None:
    S = len(job.sources)
    for rank in ranks_to_check:
        mine = share(job.sources, docs, job.world, rank, job.stepper.epochs, state)
        assert mine.epoch == job.epoch and mine.step == job.step
        assert mine.budgets(rank) == job.budgets(rank), rank
        assert mine.state(None) == job.state(None)
        for s in range(S):
            reads = job.reads_source(rank, s)
            assert mine.reads_source(rank, s) == reads
            assert mine.units_on(s, rank) == job.units_on(s, rank)
            if not reads:
                with pytest.raises(ValueError, match="does not read"):
                    mine.layout_for(s, job.epoch)
                assert not mine.resume_ages[s]
                continue
            assert mine.resume_ages[s] == job.resume_ages[s]
            for epoch in (job.epoch, job.epoch + 1):
                kept = mine.layout_for(s, epoch)
                assert isinstance(kept.base, OneRank)   # not every rank's deal
                assert units(kept, rank, job.endless(s)) == \
                    units(job.layout_for(s, epoch), rank, job.endless(s)), (rank, s, epoch)
        if job.world > 1:
            with pytest.raises(ValueError, match="keeps its own share"):
                mine.budgets((rank + 1) % job.world)


@pytest.mark.parametrize("S,ranks", [(3, 1), (3, 2), (5, 3), (8, 8), (12, 16), (30, 64)])
def test_fresh_share_equals_the_job_model(S, ranks):
    sources = make_sources(S, S + ranks)
    docs = make_docs(S, ranks, 1)
    job = full_job(sources, docs, ranks, 3)
    assert_same_share(job, docs, sorted({0, 1 % ranks, ranks // 2, ranks - 1}))


@pytest.mark.parametrize("S,saved_at,resumed_at,epoch", [
    (3, 2, 2, 0), (5, 4, 4, 1), (5, 4, 3, 0), (6, 3, 5, 1), (8, 8, 6, 1), (8, 2, 8, 0)])
def test_resumed_share_equals_the_job_model(S, saved_at, resumed_at, epoch):
    """Saved mid-epoch (the first or the second) at one world size, loaded at the same or
    another: every rank's share equals the job model's (same holding when the deal is kept,
    dealt again when not)."""
    sources = make_sources(S, 7 * S + saved_at)
    docs = make_docs(S, max(saved_at, resumed_at), 2)
    job = full_job(sources, docs, saved_at, 3)
    state = saved_after(job, blocks_for(docs), epoch, 2)
    assert state.epoch == epoch and state.sources
    resumed = full_job(sources, docs, resumed_at, 3, state)
    assert resumed.resumed()
    assert_same_share(resumed, docs, range(resumed_at), state)


def test_a_state_saved_before_the_first_step_starts_fresh():
    sources = make_sources(4, 0)
    docs = make_docs(4, 4, 3)
    job = full_job(sources, docs, 4, 2)
    state = decode_state(encode_state(job.state(None)))
    assert_same_share(full_job(sources, docs, 3, 2, state), docs, range(3), state)


@pytest.mark.parametrize("saved_at", [2, 4, 7])
def test_holding_of_a_deal_dealt_again_without_dealing(saved_at):
    """`dealt_again_holding` equals the dealt layout's `holding_mask` for every finite source
    of a state saved mid-epoch, at other world sizes, first readers and reader counts (every
    rank reading included: its pooled units go by rank, its shards by reader)."""
    sources = make_sources(6, saved_at)
    docs = make_docs(6, saved_at, 4)
    state = saved_after(full_job(sources, docs, saved_at, 2), blocks_for(docs), 0, 3)
    checked = 0
    for s, progress in enumerate(state.sources):
        if sources[s].on_exhausted == "restart":
            continue
        for world, rotation, readers in itertools.product((1, 2, 3, 5, 9), (0, 1, 4), (0, 1, 2, 9)):
            rotation %= world
            if not redeals(progress, world, rotation, readers):
                continue
            kwargs = dict(seed=5, epoch=state.epoch, source_index=s, world=world,
                          rotation=rotation, readers=readers)
            np.testing.assert_array_equal(dealt_again_holding(progress, **kwargs),
                                          layout_from_progress(progress, **kwargs).holding_mask())
            checked += 1
    assert checked > 40
