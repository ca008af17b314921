"""control_plane="gather" on real gloo groups: the head windows go to rank 0 only, which steps
the job model alone and sends each rank its own part of the plan. The batches and the states
are the all-gather path's, the failure protocol holds, and ranks other than 0 have the state at
multiples of `state_every` (and say so otherwise)."""
from __future__ import annotations

import hashlib
import os

import pytest

from corpus import base_ids, write_jsonl_source, write_token_source
from distributed import run_ranks

pytestmark = pytest.mark.timeout(240)

STATE_EVERY = 3


def job(rank, world, root, control_plane, state_every, epochs=1):
    """One epoch: per step, a digest of this rank's ids and tokens, and its state_dict() (or
    the error it raised)."""
    import streamload as sl
    out = []
    with sl.Loader([sl.Source(os.path.join(root, "web"), weight=0.6),
                    sl.Source(os.path.join(root, "code"), weight=0.4),
                    sl.Source(os.path.join(root, "long"), weight=0.2, on_exhausted="restart")],
                   micro_batch_tokens=512, micro_batches=2, epochs=epochs, seed=4,
                   planner="balanced", control_plane=control_plane,
                   state_every=state_every) as loader:
        for batch in loader:
            digest = hashlib.sha256()
            ids = []
            for mb in batch.micro_batches:
                ids += mb.sample_ids
                digest.update("|".join(mb.sample_ids).encode())
                digest.update(mb.tokens.numpy().tobytes())
            try:
                state = loader.state_dict()["streamload"]
            except sl.UsageError as exc:
                state = f"UsageError: {exc}"
            out.append((batch.step, digest.hexdigest(), ids, state,
                        [float(c) for c in batch.rank_cost], batch.exchanged_tokens))
        stats = loader.stats()
    return out, stats["steps"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("control")
    ids = write_jsonl_source(root, "web", shards=5, per_shard=60, median=200, seed=1)
    ids |= write_token_source(root, "code", shards=1, per_shard=80, median=400, seed=2)
    write_jsonl_source(root, "long", shards=2, per_shard=20, median=1500, seed=3)
    return root, ids


@pytest.mark.parametrize("world", [2, 3])
def test_gather_delivers_the_all_gather_batches_and_states(corpus, world):
    root, expected = corpus
    reference = run_ranks(job, world, str(root), "all_gather", None)
    gathered = run_ranks(job, world, str(root), "gather", STATE_EVERY)
    for rank in range(world):
        ref_steps, got_steps = reference[rank][0], gathered[rank][0]
        assert [s[:2] for s in got_steps] == [s[:2] for s in ref_steps]   # the same batches
        assert [s[4:] for s in got_steps] == [s[4:] for s in ref_steps]   # the same totals
        for (step, _, _, state, *_), (_, _, _, ref_state, *_) in zip(got_steps, ref_steps):
            if rank == 0 or (step + 1) % STATE_EVERY == 0:
                assert state == ref_state, f"rank {rank} step {step}: another state"
            else:
                assert state.startswith("UsageError") and "state_every" in state
    ids = [i for r in gathered for s in r[0] for i in s[2]]
    finite = [i for i in ids if not i.startswith("long/")]
    assert len(finite) == len(set(finite)) and set(base_ids(finite)) == expected


@pytest.mark.parametrize("world", [1, 2])
def test_gather_turns_epochs_as_all_gather_does(corpus, world):
    """Two epochs (the turn: markers dropped, buffers resized by rank 0's word), and one rank
    (the gather path without a process group)."""
    root, _ = corpus
    reference = run_ranks(job, world, str(root), "all_gather", None, 2) if world > 1 else \
        [job(0, 1, str(root), "all_gather", None, 2)]
    gathered = run_ranks(job, world, str(root), "gather", 1, 2) if world > 1 else \
        [job(0, 1, str(root), "gather", 1, 2)]
    for ref, got in zip(reference, gathered):
        assert [s[:2] + s[3:4] for s in got[0]] == [s[:2] + s[3:4] for s in ref[0]]
        assert {s[0] for s in got[0]} == set(range(len(got[0]))) and got[1] == ref[1]


def failing_job(rank, world, root):
    import streamload as sl
    with sl.Loader([sl.Source(os.path.join(root, f"rank{rank}"))], micro_batch_tokens=256,
                   micro_batches=1, epochs=1, collective_timeout_s=30,
                   control_plane="gather") as loader:
        try:
            for _ in loader:
                pass
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "finished"


@pytest.mark.parametrize("world", [2, 3])
def test_a_failing_rank_stops_every_rank_through_rank_0(tmp_path, world):
    from streamload.formats import write_jsonl
    for rank in range(world):
        (tmp_path / f"rank{rank}").mkdir()
        for shard in ("s0", "s1", "s2", "s3"):   # the same names on every rank; the last
            # rank's copy is broken (4 shards: every rank reads one)
            if rank == world - 1:
                write_jsonl(tmp_path / f"rank{rank}" / f"{shard}.jsonl", ["ok"] * 10,
                            text_field="body")
            else:
                write_jsonl(tmp_path / f"rank{rank}" / f"{shard}.jsonl", ["ok"] * 50)
    results = run_ranks(failing_job, world, str(tmp_path), timeout=90)
    bad = world - 1
    assert results[bad].startswith("DataError") and "record 0" in results[bad], results[bad]
    for rank in range(bad):
        assert f"rank {bad} failed" in results[rank], results[rank]


def resume_job(rank, world, root, stop, state):
    """control_plane="gather": up to `stop` batches (None: the epoch) from `state`; this rank's
    ids, and rank 0's state at the stop."""
    import streamload as sl
    ids = []
    with sl.Loader([sl.Source(os.path.join(root, "web"), weight=0.6),
                    sl.Source(os.path.join(root, "code"), weight=0.4)],
                   micro_batch_tokens=512, micro_batches=2, epochs=1, seed=4,
                   control_plane="gather") as loader:
        if state is not None:
            loader.load_state_dict(state)
        for k, batch in enumerate(loader):
            ids += [i for mb in batch.micro_batches for i in mb.sample_ids]
            if stop is not None and k + 1 >= stop:
                break
        saved = loader.state_dict() if rank == 0 else None
    return ids, saved


def test_gather_resumes_at_another_world_size_exactly_once(corpus):
    root, expected = corpus
    first = run_ranks(resume_job, 2, str(root), 6, None)
    state = first[0][1]
    second = run_ranks(resume_job, 3, str(root), None, state)
    ids = [i for r in first for i in r[0]] + [i for r in second for i in r[0]]
    assert len(ids) == len(set(ids)), "delivered twice"
    assert set(base_ids(ids)) == expected
