"""Sources read where it pays (issue 22, item 4; `plan/readers.py`): a source's shards are dealt
over its readers only, a rank that is not one runs no fetcher or buffer for it, and its items
reach the other ranks through the exchange. The choice is pure; the job model delivers every
item exactly once with readers, also across a resume at another world size; on real gloo
ranks, the loader does too, with the mix on target and no fetcher where a source is not read."""
from __future__ import annotations

import os

import numpy as np
import pytest

from corpus import base_ids, write_jsonl_source, write_token_source
from distributed import run_ranks
from streamload.config import Source
from streamload.errors import ConfigError
from streamload.job import step_windows
from streamload.plan.readers import READER_LOAD, choose_readers, reader_mask, reader_offsets
from streamload.state import (deal, deal_epoch, deal_readers, fresh_layout,
                              shard_permutation)

import test_job as model   # the job model driven over `plan.windows` queues, no process group


# -- the choice, pure ------------------------------------------------------------------------------
@pytest.mark.core
def test_automatic_readers_follow_share_cost_and_shards():
    shares = [0.5, 0.3, 0.15, 0.05]
    got = choose_readers(shares, [64, 64, 64, 64], 16)
    # k = ceil(share * R / READER_LOAD): a reader supplies at most half a rank's step
    assert got.tolist() == [16, 10, 5, 2]
    assert READER_LOAD == 0.5
    # never more than the shards, never fewer than one
    assert choose_readers(shares, [3, 64, 1, 64], 16).tolist() == [3, 10, 1, 2]
    assert choose_readers([1.0, 1e-9], [8, 8], 4).tolist() == [4, 1]
    # a costlier source (to decode, to tokenize) gets more readers
    assert choose_readers(shares, [64] * 4, 16, read_cost=[1, 1, 1, 4]).tolist() == [16, 10, 5, 7]
    # by hand: kept, clamped to the ranks and the shards
    assert choose_readers(shares, [64, 64, 2, 64], 16,
                          requested=[1, None, 5, 40]).tolist() == [1, 10, 2, 16]
    # weights of any scale
    assert (choose_readers([5, 3, 1.5, 0.5], [64] * 4, 16) == got).all()


@pytest.mark.core
def test_thirty_sources_on_sixteen_ranks_read_a_third_of_the_sources_at_most():
    rng = np.random.default_rng(0)
    weights = rng.lognormal(0, 1.0, 30)
    readers = choose_readers(weights, rng.integers(2, 40, 30), 16)
    mask = reader_mask(readers, reader_offsets(readers, 16), 16)
    assert (mask.sum(axis=0) == readers).all()          # each source: its count of readers
    per_rank = mask.sum(axis=1)
    assert per_rank.max() <= 10                          # a third of the 30 sources
    assert per_rank.max() - per_rank.min() <= 1          # spread evenly (the rotation)


@pytest.mark.core
def test_reader_sets_and_the_deal():
    readers = np.array([16, 3, 3, 16, 1])
    offsets = reader_offsets(readers, 16)
    assert offsets.tolist() == [0, 1, 4, 7, 8]           # full sources advance it by one
    mask = reader_mask(readers, offsets, 16)
    assert np.flatnonzero(mask[:, 1]).tolist() == [1, 2, 3]
    assert np.flatnonzero(mask[:, 4]).tolist() == [8]
    # every rank reading: the deal before readers existed, for finite and endless passes
    order = shard_permutation(11, 0, 2, 3)
    for rank in range(4):
        for shift in (0, 1, 5):
            assert (deal_readers(order, 4, rank, 1, shift, 0)
                    == deal(order, 4, rank, shift - 1)).all()
    # three readers of seven ranks from rank 5: only they are dealt, every shard once
    dealt = deal_epoch(11, seed=0, epoch=0, source_index=2, world=7, endless=False,
                       rotation=5, readers=3)
    assert [q for q in range(7) if dealt[q].size] == [0, 5, 6]
    assert sorted(np.concatenate(dealt).tolist()) == list(range(11))


@pytest.mark.core
@pytest.mark.parametrize("world,rotation,readers,endless", [
    (7, 5, 3, False), (7, 5, 3, True), (4, 1, 0, True), (9, 0, 9, False), (12, 11, 5, False)])
def test_the_deal_and_the_masks_match_each_rank_on_its_own(world, rotation, readers, endless):
    """deal_epoch (all ranks at once) is deal_readers per rank; a layout's readers_mask and
    holding_mask are `reads` and `reads and has_units` per rank."""
    for epoch in (0, 3):
        order = shard_permutation(5, 2, epoch, 1)
        dealt = deal_epoch(5, seed=2, epoch=epoch, source_index=1, world=world,
                           endless=endless, rotation=rotation, readers=readers)
        shift = epoch if endless else 0
        for rank in range(world):
            expected = deal_readers(order, world, rank, rotation, shift, readers)
            assert (dealt[rank] == expected + (epoch * 5 if endless else 0)).all()
        layout = fresh_layout(5, seed=2, epoch=epoch, source_index=1, world=world,
                              endless=endless, rotation=rotation, readers=readers)
        layout.base_position[rotation] = len(layout.base[rotation])   # one reader started all
        assert layout.readers_mask().tolist() == [layout.reads(q) for q in range(world)]
        assert layout.holding_mask().tolist() == [layout.reads(q) and layout.has_units(q)
                                                  for q in range(world)]


@pytest.mark.core
def test_readers_must_be_at_least_one():
    with pytest.raises(ConfigError) as err:
        Source("/x/web/", readers=0)
    assert err.value.key == "readers"
    with pytest.raises(ConfigError) as err:
        Source("/x/web/", read_cost=0.0)
    assert err.value.key == "read_cost"


# -- the job model, no process group ---------------------------------------------------------------
SIZED = [Source("/x/web/", weight=0.5, name="web"), Source("/x/code/", weight=0.3, name="code"),
         Source("/x/long/", weight=0.2, name="long", on_exhausted="restart")]


@pytest.mark.core
@pytest.mark.parametrize("ranks", [4, 8])
def test_job_model_with_readers_exactly_once_and_resumed_at_another_world(ranks, monkeypatch):
    """Readers by hand (code: 1, long: 2) and automatic (web): non-readers are offered nothing
    of the source; the epoch is delivered exactly once, also saved mid-epoch and resumed at
    R - 1 ranks (the readers chosen again for the new world)."""
    from streamload.state import decode_state, encode_state
    sources = [SIZED[0], Source("/x/code/", weight=0.3, name="code", readers=1),
               Source("/x/long/", weight=0.2, name="long", on_exhausted="restart", readers=2)]
    monkeypatch.setattr(model, "SOURCES", sources)
    docs = [[np.full(12, 30 + 7 * k) for k in range(2 * ranks)],
            [np.full(20, 60) for _ in range(3)], [np.full(6, 200) for _ in range(3)]]
    job, blocks = model.make_job(ranks, docs)
    job.start()
    assert job.readers.tolist()[1:] == [1, 2]
    windows = model.windows_for(job, blocks)
    seen_sources = np.zeros((ranks, 3), dtype=bool)
    full = []
    while True:
        _, offer, plan = step_windows(job, windows)
        seen_sources[offer.candidates.rank, offer.candidates.source] = True
        if plan is None:
            break
        full.append(np.column_stack([offer.candidates.source[plan.take],
                                     offer.ids[plan.take], plan.length]).astype(np.int64))
    assert not (seen_sources & ~job.reads).any(), "a non-reader offered a source's items"
    assert seen_sources[:, 1].sum() == 1 and seen_sources[:, 2].sum() <= 2
    model.assert_exactly_once(full, docs)

    job, blocks = model.make_job(ranks, docs)
    job.start()
    before = model.run(job, model.windows_for(job, blocks), stop_at=len(full) // 2)
    state = decode_state(encode_state(job.state(job.snapshot())))
    assert {p.readers for p in state.sources} >= {1, 2}
    resumed, blocks = model.make_job(ranks - 1, docs)
    resumed.load(state)
    resumed.start()
    for s, layout in enumerate(resumed.resumed_layouts):
        dealt = [q for q in range(ranks - 1) if layout.rank_units(q)]
        assert set(dealt) <= set(np.flatnonzero(resumed.reads[:, s]).tolist())
    after = model.run(resumed, model.windows_for(resumed, blocks))
    model.assert_exactly_once(before + after, docs)


# -- the loader on real gloo ranks -----------------------------------------------------------------
def loader_job(rank, world, root, stop, state, everywhere=False):
    """One epoch (or `stop` batches) from `state`: this rank's ids, which sources it reads and
    its buffers' capacity per source, its mix summary, and rank 0's state at the end."""
    import streamload as sl
    ids = []
    with sl.Loader([sl.Source(os.path.join(root, "web"), weight=0.55),
                    sl.Source(os.path.join(root, "code"), weight=0.2),
                    sl.Source(os.path.join(root, "small"), weight=0.1,
                              readers=world if everywhere else 1),
                    sl.Source(os.path.join(root, "tiny"), weight=0.05),
                    sl.Source(os.path.join(root, "long"), weight=0.1, on_exhausted="restart")],
                   micro_batch_tokens=512, micro_batches=2, epochs=1, seed=7) as loader:
        if state is not None:
            loader.load_state_dict(state)
        for k, batch in enumerate(loader):
            ids += [i for mb in batch.micro_batches for i in mb.sample_ids]
            if stop is not None and k + 1 >= stop:
                break
        stats = loader.stats()
        saved = loader.state_dict() if rank == 0 else None
    reads = {name: (s["reads"], s.get("buffer_capacity_tokens", 0), s["shards_started"])
             for name, s in stats["sources"].items()}
    return ids, reads, stats["mix_steps"], saved


@pytest.fixture(scope="module")
def sized_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("readers")
    # sized about as the weights ask, so every source has data for most of the epoch
    ids = write_jsonl_source(root, "web", shards=8, per_shard=100, median=150, seed=1)
    ids |= write_token_source(root, "code", shards=3, per_shard=120, median=120, seed=2)
    ids |= write_jsonl_source(root, "small", shards=2, per_shard=100, median=80, seed=3)
    ids |= write_token_source(root, "tiny", shards=1, per_shard=150, median=60, seed=4)
    write_jsonl_source(root, "long", shards=2, per_shard=20, median=300, seed=5)
    return root, ids


@pytest.mark.timeout(300)
def test_gloo_four_ranks_with_readers(sized_corpus):
    """R=4: web read by every rank, code by 2, small by 1 (by hand), tiny by 1 (its one
    shard), long (endless) by 1: exactly once, the mix on target, and a rank that does not read
    a source has no fetcher, buffer or shard of it."""
    root, expected = sized_corpus
    results = run_ranks(loader_job, 4, str(root), None, None)
    ids = [i for r in results for i in r[0]]
    finite = [i for i in ids if not i.startswith("long/")]
    assert len(finite) == len(set(finite)), "delivered twice"
    assert set(base_ids(finite)) == expected
    readers = {name: sum(r[1][name][0] for r in results) for name in results[0][1]}
    assert readers == {"web": 4, "code": 2, "small": 1, "tiny": 1, "long": 1}
    for _, reads, _, _ in results:
        for name, (read, capacity, started) in reads.items():
            if not read:
                assert capacity == 0 and started == 0, name
    for _, _, mix, _ in results:
        assert mix["deviation"] is not None and mix["deviation"] <= 0.01, mix


@pytest.mark.timeout(300)
def test_gloo_resume_from_four_ranks_to_three_with_readers(sized_corpus):
    root, expected = sized_corpus
    first = run_ranks(loader_job, 4, str(root), 5, None)
    state = first[0][3]
    second = run_ranks(loader_job, 3, str(root), None, state)
    ids = [i for r in first + second for i in r[0] if not i.startswith("long/")]
    assert len(ids) == len(set(ids)), "delivered twice"
    assert set(base_ids(ids)) == expected
    readers = {name: sum(r[1][name][0] for r in second) for name in second[0][1]}
    assert readers["small"] == 1 and readers["tiny"] == 1


@pytest.mark.core
def test_job_model_resumes_a_state_dealt_to_every_rank_into_readers(monkeypatch):
    """At the same world size, a state whose deal had every rank reading (a state saved before
    readers existed reads as such: `readers` 0) resumes into a job with fewer readers: what is
    left is dealt again over the readers, and the epoch is delivered exactly once."""
    from streamload.state import decode_state, encode_state
    ranks = 4
    everyone = [Source(s.uri, weight=s.weight, name=s.name, on_exhausted=s.on_exhausted,
                       readers=ranks) for s in SIZED]
    docs = [[np.full(12, 30 + 7 * k) for k in range(8)], [np.full(20, 60) for _ in range(4)],
            [np.full(6, 200) for _ in range(4)]]
    monkeypatch.setattr(model, "SOURCES", everyone)
    job, blocks = model.make_job(ranks, docs)
    job.start()
    before = model.run(job, model.windows_for(job, blocks), stop_at=6)
    state = decode_state(encode_state(job.state(job.snapshot())))
    assert {p.readers for p in state.sources} == {0}
    monkeypatch.setattr(model, "SOURCES", SIZED)
    resumed, blocks = model.make_job(ranks, docs)
    resumed.load(state)
    resumed.start()
    assert (resumed.readers < ranks).any() and resumed._redealt
    after = model.run(resumed, model.windows_for(resumed, blocks))
    model.assert_exactly_once(before + after, docs)
