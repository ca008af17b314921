"""control_plane="gather" (the default) on real gloo groups: the head windows go to rank 0 only,
which steps the job model alone and sends each rank its own part of the plan. The batches and
every rank's states are the all-gather path's (ranks other than 0 get theirs from rank 0:
`state_relay`), and the failure protocol holds."""
from __future__ import annotations

import hashlib
import os

import pytest

from corpus import base_ids, write_jsonl_source, write_token_source
from distributed import run_ranks

from streamload.collective.topology import Parallel, Topology

pytestmark = pytest.mark.timeout(240)

STATE_EVERY = 3


def job(rank, world, root, control_plane, state_every, epochs=1, parallel=None):
    """One epoch: per step, a digest of this rank's ids and tokens, and its state_dict() (or
    the error it raised). `parallel`: a TP/CP/PP layout (`Parallel`'s fields)."""
    import streamload as sl
    from streamload.collective.topology import Parallel
    out = []
    with sl.Loader([sl.Source(os.path.join(root, "web"), weight=0.6),
                    sl.Source(os.path.join(root, "code"), weight=0.4),
                    sl.Source(os.path.join(root, "long"), weight=0.2, on_exhausted="restart")],
                   micro_batch_tokens=512, micro_batches=2, epochs=epochs, seed=4,
                   planner="balanced", control_plane=control_plane,
                   state_every=state_every,
                   parallel=None if parallel is None else Parallel(**parallel)) as loader:
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
                        [float(c) for c in batch.rank_cost], batch.exchanged_tokens,
                        batch.costs.to_array().tolist(),
                        (batch.imbalance, batch.step_time, batch.pipeline_efficiency)))
        stats = loader.stats()
    return out, stats["steps"], stats.get("control_plane", {}).get("path")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("control")
    ids = write_jsonl_source(root, "web", shards=5, per_shard=60, median=200, seed=1)
    ids |= write_token_source(root, "code", shards=1, per_shard=80, median=400, seed=2)
    write_jsonl_source(root, "long", shards=2, per_shard=20, median=1500, seed=3)
    return root, ids


@pytest.mark.parametrize("world,state_every", [(2, None), (3, STATE_EVERY)])
def test_gather_delivers_the_all_gather_batches_and_states(corpus, world, state_every):
    """Every rank's state_dict() after every step is the all-gather path's: asked of rank 0
    on the next round (and sent by rank 0 with its own), or sent unasked every state_every."""
    root, expected = corpus
    reference = run_ranks(job, world, str(root), "all_gather", None)
    gathered = run_ranks(job, world, str(root), "gather", state_every)
    for rank in range(world):
        ref_steps, got_steps = reference[rank][0], gathered[rank][0]
        assert [s[:2] for s in got_steps] == [s[:2] for s in ref_steps]   # the same batches
        # the same job-wide totals and figures on every rank
        assert [s[5:] for s in got_steps] == [s[5:] for s in ref_steps]
        # every rank's costs on rank 0; on another, its own alone (its reply does not grow with R)
        own = [s[4] if rank == 0 else s[4][rank:rank + 1] for s in ref_steps]
        assert [s[4] for s in got_steps] == own
        for (step, _, _, state, *_), (_, _, _, ref_state, *_) in zip(got_steps, ref_steps):
            assert state == ref_state, f"rank {rank} step {step}: another state"
    ids = [i for r in gathered for s in r[0] for i in s[2]]
    finite = [i for i in ids if not i.startswith("long/")]
    assert len(finite) == len(set(finite)) and set(base_ids(finite)) == expected


@pytest.mark.parametrize("world,parallel,node_size", [(4, {"tp": 2}, None),
                                                      (6, {"cp": 2}, None),
                                                      (8, {"tp": 2}, 4)])
def test_gather_under_broadcast_delivery(corpus, world, parallel, node_size):
    """delivery="broadcast" (TP/CP/PP): the default gathers over the DP ranks' leaders, which
    send their ranks each step with its state (rank 0 sends every leader each step's state
    with the step's reply). Every rank's batches and states are the all-gather path's. With
    nodes of 4 ranks (TP 2): two DP ranks per node, through one leader per node."""
    root, expected = corpus
    env = {} if node_size is None else {"LOCAL_WORLD_SIZE": str(node_size)}
    reference = run_ranks(job, world, str(root), "all_gather", None, 1, parallel, env=env)
    gathered = run_ranks(job, world, str(root), "auto", None, 1, parallel, env=env)
    dp = world // 2
    leaders = [r for r in range(world) if gathered[r][2] is not None]
    assert len(leaders) == dp   # one Runtime per DP rank; the others follow
    assert {gathered[r][2] for r in leaders} == {"gather" if node_size is None
                                                 else "node_gather"}
    assert {reference[r][2] for r in leaders} == {"all_gather"}
    for rank in range(world):
        ref_steps, got_steps = reference[rank][0], gathered[rank][0]
        assert len(got_steps) == len(ref_steps) > 3
        d = Topology.from_parallel(Parallel(**parallel), world, rank).dp_rank
        for got, ref in zip(got_steps, ref_steps):
            assert got[:3] == ref[:3] and got[5:] == ref[5:], f"rank {rank} step {got[0]}"
            # every DP rank's costs on DP rank 0's ranks; on another, its own alone
            assert got[4] == (ref[4] if d == 0 else ref[4][d:d + 1]), f"rank {rank}"
            assert got[3] == ref[3], f"rank {rank} step {got[0]}: another state"
    assert len({str(s[3]) for r in gathered for s in r[0][-1:]}) == 1   # one state everywhere
    ids = [i for r in leaders for s in gathered[r][0] for i in s[2]]
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
                   micro_batches=1, epochs=1, collective_timeout_s=30) as loader:   # gather
        try:
            for _ in loader:
                pass
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "finished"


@pytest.mark.parametrize("world,node_size", [(2, None), (3, None), (4, 2)])
def test_a_failing_rank_stops_every_rank_through_rank_0(tmp_path, monkeypatch, world, node_size):
    """The default control plane (gather; at 4 ranks as two nodes, through their leaders): the
    rank whose data is bad raises its own error, every other rank one naming it."""
    from streamload.formats import write_jsonl
    if node_size is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(node_size))
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


def asking_job(rank, world, root, control_plane, ask_at, stop=None):
    """One epoch (or up to batch `stop`), state_dict() only where `ask_at` says (rank ->
    steps; not rank 0's own), then after the last batch, and after close(): {when: state}."""
    import streamload as sl
    out = {}
    loader = sl.Loader([sl.Source(os.path.join(root, "web"), weight=0.6),
                        sl.Source(os.path.join(root, "code"), weight=0.4)],
                       micro_batch_tokens=512, micro_batches=2, epochs=1, seed=4,
                       control_plane=control_plane, collective_timeout_s=60)
    for batch in loader:
        if batch.step in ask_at.get(rank, ()):
            out[batch.step] = loader.state_dict()["streamload"]
        if batch.step == stop:
            break
    if stop is None:
        out["end"] = loader.state_dict()["streamload"]
    loader.close()
    out["closed"] = loader.state_dict()["streamload"]
    return out


def test_a_rank_asks_alone_and_after_the_run_ended(corpus):
    """Rank 1 asks at steps where rank 0 does not (its request rides on its next round), every
    rank asks after the last batch and after close() (rank 0's last reply carried the states
    of the steps still kept): the all-gather path's states."""
    root, _ = corpus
    ask_at = {1: [0, 3, 4], 2: [5]}
    reference = run_ranks(asking_job, 3, str(root), "all_gather", ask_at)
    got = run_ranks(asking_job, 3, str(root), "gather", ask_at)
    assert got == reference
    assert {r["end"] for r in got} == {reference[0]["end"]}
    assert sorted(k for k in got[1] if isinstance(k, int)) == [0, 3, 4]


def node_job(rank, world, root, control_plane, stop):
    """One epoch; this rank's batches, its state after batch `stop`, and its control plane's
    stats at the end."""
    import streamload as sl
    steps, state = [], None
    with sl.Loader([sl.Source(os.path.join(root, "web"), weight=0.6),
                    sl.Source(os.path.join(root, "code"), weight=0.4)],
                   micro_batch_tokens=512, micro_batches=2, epochs=1, seed=4,
                   control_plane=control_plane) as loader:
        for batch in loader:
            steps.append((batch.step, [i for mb in batch.micro_batches for i in mb.sample_ids]))
            if batch.step == stop:
                state = loader.state_dict()["streamload"]
        control = loader.stats()["control_plane"]
    return steps, state, control


def test_two_nodes_gather_through_their_leaders(corpus, monkeypatch):
    """LOCAL_WORLD_SIZE=2 at 4 ranks (two nodes, as torchrun says): the summaries go through
    one leader per node (ranks 0 and 2) and the replies come back that way; the batches and
    the states are the all-gather path's, and a rank that is no leader sends and receives
    about what it would under a one-level gather (its summary, its reply)."""
    root, expected = corpus
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    reference = run_ranks(node_job, 4, str(root), "all_gather", 3)
    got = run_ranks(node_job, 4, str(root), "gather", 3)
    assert [r[:2] for r in got] == [r[:2] for r in reference]
    ids = [i for r in got for _, step_ids in r[0] for i in step_ids]
    assert len(ids) == len(set(ids)) and set(base_ids(ids)) == expected
    controls = [r[2] for r in got]
    assert [c["path"] for c in controls] == ["node_gather"] * 4, controls
    assert [c["leader"] for c in controls] == [True, False, True, False]
    assert {c["nodes"] for c in controls} == {2} and [c["node"] for c in controls] == [0, 0, 1, 1]
    assert [r[2]["path"] for r in reference] == ["all_gather"] * 4
    # A leader relays its node: it receives its member's summaries and sends its replies.
    assert controls[2]["bytes_received"] > controls[3]["bytes_received"]
    assert controls[1]["bytes_sent"] > 0 and controls[3]["bytes_sent"] > 0


def test_every_rank_has_the_state_after_closing_early(corpus):
    """Every rank breaks out at batch 3 and closes (the loop had planned further): rank 0's
    closing reply carried the states it kept, so every rank's state_dict() after close() is
    batch 3's, the all-gather path's."""
    root, _ = corpus
    reference = run_ranks(asking_job, 2, str(root), "all_gather", {}, 3)
    got = run_ranks(asking_job, 2, str(root), "gather", {}, 3)
    assert got == reference and got[0]["closed"] == got[1]["closed"]


def checkpoint_job(rank, world, root, ckpt, stop):
    """torch.distributed.checkpoint on every rank (it calls state_dict() everywhere, then runs
    collectives of its own): save after batch `stop`, or (stop None) load and run the rest.
    This rank's ids."""
    import torch.distributed.checkpoint as dcp
    import streamload as sl
    ids = []
    with sl.Loader([sl.Source(os.path.join(root, "web"), weight=0.6),
                    sl.Source(os.path.join(root, "code"), weight=0.4)],
                   micro_batch_tokens=512, micro_batches=2, epochs=1, seed=4,
                   collective_timeout_s=60) as loader:
        if stop is None:
            dcp.load({"loader": loader}, checkpoint_id=ckpt)
        for batch in loader:
            ids += [i for mb in batch.micro_batches for i in mb.sample_ids]
            if batch.step == stop:
                dcp.save({"loader": loader}, checkpoint_id=ckpt)
                break
    return ids


def test_a_distributed_checkpoint_saves_and_resumes_every_rank(corpus, tmp_path):
    """The default control plane under a two-rank torch.distributed.checkpoint save: every
    rank's state_dict() is answered (rank 0 sends its own to all) while the save's own
    collectives wait on the others, and the load resumes the epoch exactly once."""
    root, expected = corpus
    ckpt = str(tmp_path / "ckpt")
    first = run_ranks(checkpoint_job, 2, str(root), ckpt, 4, timeout=120)
    rest = run_ranks(checkpoint_job, 2, str(root), ckpt, None, timeout=120)
    ids = [i for r in first + rest for i in r]
    assert len(ids) == len(set(ids)) and set(base_ids(ids)) == expected
