"""Parallel topology on real gloo groups: TP peers get identical batches, CP ranks get parts
that reassemble into their DP rank's rows, pipeline stages get their fields, and balancing,
exactly-once and resumption work over the DP ranks."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

import streamload as sl
from corpus import write_jsonl_source, write_token_source
from distributed import run_ranks
from streamload.collective.topology import Parallel, Topology

pytestmark = pytest.mark.timeout(240)

C, M = 512, 2


def make_corpus(root):
    ids = write_jsonl_source(root, "web", shards=3, per_shard=40, median=150, seed=1)
    ids |= write_token_source(root, "code", shards=1, per_shard=30, median=400, seed=2)
    ids |= write_jsonl_source(root, "long", shards=1, per_shard=8, median=1500, seed=3)
    return ids


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One corpus for the module, and the DP-only runs the layouts are compared with (each
    computed once)."""
    root = tmp_path_factory.mktemp("topology")
    ids = make_corpus(root)
    runs = {}

    def flat(name):
        if name not in runs:
            if name == "flat":
                runs[name] = run_ranks(epoch_job, 2, str(root), None)
            elif name == "flat_pp2":   # plans as a pp = 2 job does (pipeline_stages from pp)
                runs[name] = run_ranks(epoch_job, 2, str(root),
                                       {"options": {"pipeline_stages": 2}})
            else:
                runs[name] = run_ranks(reference_job, 2, str(root))
        return runs[name]
    return root, ids, flat


def loader_for(root, **kw):
    kw.setdefault("micro_batch_tokens", C)
    kw.setdefault("micro_batches", M)
    kw.setdefault("epochs", 1)
    kw.setdefault("chunk_bytes", 4096)
    kw.setdefault("seed", 3)
    return sl.Loader([sl.Source(str(root / "web"), weight=0.5), sl.Source(str(root / "code"), weight=0.3),
                      sl.Source(str(root / "long"), weight=0.2)], **kw)


def digest(tensor) -> str | None:
    return None if tensor is None else hashlib.sha256(tensor.numpy().tobytes()).hexdigest()[:16]


def record(batch) -> list[dict]:
    return [{"ids": mb.sample_ids, "tokens": digest(mb.tokens), "positions": digest(mb.position_ids),
             "labels": digest(getattr(mb, "labels", None)), "cu": digest(mb.cu_seqlens),
             "tokens_list": None if mb.tokens is None else mb.tokens.tolist(),
             "cu_list": None if mb.cu_seqlens is None else mb.cu_seqlens.tolist(),
             "labels_list": None if getattr(mb, "labels", None) is None else mb.labels.tolist(),
             "max_seqlen": mb.max_seqlen} for mb in batch.micro_batches]


def epoch_job(rank, world, root, layout, stop_after=None, state=None):
    import torch.distributed as dist
    from pathlib import Path
    kwargs = {}
    if layout == "mesh":
        from torch.distributed.device_mesh import init_device_mesh
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    elif isinstance(layout, dict) and "options" in layout:   # DP only, with loader options
        kwargs.update(layout["options"])
    elif layout is not None:
        kwargs["parallel"] = Parallel(**layout)
    with loader_for(Path(root), **kwargs) as loader:
        if state is not None:
            loader.load_state_dict(state)
        steps, costs = [], []
        for batch in loader:
            steps.append(record(batch))
            costs.append(batch.rank_cost.tolist())
            if stop_after is not None and len(steps) == stop_after:
                break
        topology = loader.topology
        out = {"steps": steps, "costs": costs, "dp_rank": loader.rank, "dp": loader.world_size,
               "state": loader.state_dict() if stop_after is not None else None}
    if topology is not None:
        out.update(tp_rank=topology.tp_rank, cp_rank=topology.cp_rank, pp_rank=topology.pp_rank)
    dist.barrier()
    return out


def delivered_ids(results) -> list[str]:
    """Every sample id the DP ranks of one (TP, CP, PP) coordinate received (base ids)."""
    return [i.split(":")[0] for r in results for step in r["steps"] for mb in step
            for i in mb["ids"]]


def test_layouts_follow_megatron_and_reject_mismatches():
    t = Topology.from_parallel(Parallel(tp=2, cp=2, pp=2), world=16, rank=13)
    # rank = ((pp * DP + dp) * CP + cp) * TP + tp: 13 = ((1*2 + 1)*2 + 0)*2 + 1
    assert (t.dp, t.pp_rank, t.dp_rank, t.cp_rank, t.tp_rank) == (2, 1, 1, 0, 1)
    assert t.dp_groups[t.group_index] == (9, 13)
    assert len(t.dp_groups) == 8 and sorted(sum(t.dp_groups, ())) == list(range(16))
    with pytest.raises(sl.ConfigError, match="does not divide the world size 6") as info:
        Topology.from_parallel(Parallel(tp=4), world=6, rank=0)
    assert info.value.key == "parallel"
    with pytest.raises(sl.ConfigError, match="tp: must be an integer >= 1"):
        Parallel(tp=0)

    class FakeMesh:   # DeviceMesh's interface, as Topology.from_mesh reads it
        def __init__(self, shape, names):
            import torch
            self.mesh = torch.arange(int(np.prod(shape))).reshape(shape)
            self.mesh_dim_names, self.ndim = names, len(shape)

    t = Topology.from_mesh(FakeMesh((2, 2, 2), ("dp_replicate", "dp_shard", "tp")), rank=5)
    assert (t.dp, t.dp_rank, t.tp_rank) == (4, 2, 1)
    with pytest.raises(sl.ConfigError, match=r"unknown dimension name\(s\) \['ep'\]"):
        Topology.from_mesh(FakeMesh((2, 4), ("dp", "ep")), rank=0)


@pytest.mark.parametrize("delivery", ["broadcast", "replicate"])
def test_dp2_tp2_pp2_peers_and_stages(corpus, delivery):
    root, ids, flat_run = corpus
    results = run_ranks(epoch_job, 8, str(root), {"tp": 2, "pp": 2, "delivery": delivery})
    by_coord = {(r["pp_rank"], r["dp_rank"], r["tp_rank"]): r for r in results}
    assert {r["dp"] for r in results} == {2}
    assert len({len(r["steps"]) for r in results}) == 1          # every rank, every step
    for (pp, dp, tp), r in by_coord.items():
        peer = by_coord[(pp, dp, 1 - tp)]
        assert r["steps"] == peer["steps"]                        # TP peers: identical
        other_stage = by_coord[(1 - pp, dp, tp)]
        for mine, theirs in zip(r["steps"], other_stage["steps"]):
            for a, b in zip(mine, theirs):
                assert a["ids"] == b["ids"] and a["cu"] == b["cu"]   # the same step, split
                if pp == 0:    # first stage: tokens and positions, no labels
                    assert a["tokens"] is not None and a["positions"] is not None
                    assert a["labels"] is None
                else:          # last stage: labels (and the loss mask), no tokens
                    assert a["tokens"] is None and a["positions"] is None
                    # The labels are the first stage's next tokens within each document.
                    tokens, labels = np.asarray(b["tokens_list"]), np.asarray(a["labels_list"])
                    ends = np.asarray(a["cu_list"][1:], dtype=np.int64) - 1   # [] if empty
                    expected = np.append(tokens[1:], -100)[:tokens.size]   # an empty row: []
                    expected[ends] = -100
                    assert np.array_equal(labels, expected)
    # Exactly once over the DP ranks of one coordinate; the mix balanced over DP ranks only.
    first = [by_coord[(0, dp, 0)] for dp in range(2)]
    delivered = delivered_ids(first)
    assert sorted(set(delivered)) == sorted(ids)
    pieces = [i for r in first for step in r["steps"] for mb in step for i in mb["ids"]]
    assert len(pieces) == len(set(pieces))
    assert all(len(c) == 2 for c in first[0]["costs"])             # one cost per DP rank
    flat = flat_run("flat_pp2")   # the same job, DP only, planned for 2 pipeline stages
    for dp in range(2):   # every rank's view is its DP rank's step, whatever the delivery
        assert [[mb["ids"] for mb in step] for step in flat[dp]["steps"]] == \
            [[mb["ids"] for mb in step] for step in by_coord[(0, dp, 0)]["steps"]]
        assert [[mb["tokens"] for mb in step] for step in flat[dp]["steps"]] == \
            [[mb["tokens"] for mb in step] for step in by_coord[(0, dp, 0)]["steps"]]


def test_pipeline_middle_stages_get_metadata_or_nothing(corpus):
    root = corpus[0]
    for middle in ("metadata", "nothing"):
        results = run_ranks(epoch_job, 3, str(root), {"pp": 3, "pipeline_middle": middle}, 3)
        first, mid, last = sorted(results, key=lambda r: r["pp_rank"])
        assert len(first["steps"]) == len(mid["steps"]) == len(last["steps"]) == 3
        for a, b, c in zip(first["steps"], mid["steps"], last["steps"]):
            for f, m, l in zip(a, b, c):
                assert f["ids"] == m["ids"] == l["ids"]
                assert m["tokens"] is None and m["positions"] is None and m["labels"] is None
                assert (m["cu"] == f["cu"]) if middle == "metadata" else m["cu"] is None


def test_dp2_cp2_tp2_parts_reassemble_into_the_dp_rows(corpus):
    root, _, flat_run = corpus
    results = run_ranks(epoch_job, 8, str(root), {"tp": 2, "cp": 2, "delivery": "replicate"})
    # The reference: the same job at DP 2 without CP, rows of cp x C tokens.
    check_cp_parts(results, flat_run("reference"))


def reference_job(rank, world, root):
    from pathlib import Path
    with loader_for(Path(root), micro_batch_tokens=2 * C) as loader:
        return {"steps": [record(b) for b in loader]}


def check_cp_parts(results, reference):
    from streamload.plan.context_parallel import cp_reassemble
    by_coord = {(r["dp_rank"], r["cp_rank"], r["tp_rank"]): r for r in results}
    for dp in range(2):
        assert by_coord[(dp, 0, 0)]["steps"] == by_coord[(dp, 0, 1)]["steps"]   # TP peers
        parts = [by_coord[(dp, cp, 0)]["steps"] for cp in range(2)]
        rows = reference[dp]["steps"]
        assert len(parts[0]) == len(parts[1]) == len(rows)
        for step, row_step in enumerate(rows):
            for k, row in enumerate(row_step):
                mine = [parts[cp][step][k] for cp in range(2)]
                assert mine[0]["ids"] == row["ids"]
                # Each CP rank holds at most its share of the row (plus padding per document).
                cu = np.asarray(row["cu_list"])
                assert all(len(p["tokens_list"]) <= (cu[-1] + 4 * (len(cu) - 1)) / 2 for p in mine)
                rebuilt = cp_reassemble(
                    [{"tokens": np.asarray(p["tokens_list"])} for p in mine], cu, 2)
                assert np.array_equal(rebuilt["tokens"], np.asarray(row["tokens_list"]))


def test_device_mesh_dp_cp_tp(corpus):
    root, _, flat_run = corpus
    results = run_ranks(epoch_job, 8, str(root), "mesh")   # broadcast delivery (the default)
    check_cp_parts(results, flat_run("reference"))


def test_resume_at_another_dp_degree_and_tp(corpus):
    root, ids, _ = corpus
    # DP 2 x TP 2 for 5 steps, then DP 1 x TP 2 from rank 0's state.
    head = run_ranks(epoch_job, 4, str(root), {"tp": 2}, 5)
    assert len({str(r["state"]) for r in head}) == 1                # the same state everywhere
    tail = run_ranks(epoch_job, 2, str(root), {"tp": 2}, None, head[0]["state"])
    assert tail[0]["steps"] == tail[1]["steps"]
    pieces = [i for r in head if r["tp_rank"] == 0 for step in r["steps"] for mb in step
              for i in mb["ids"]]
    pieces += [i for step in tail[0]["steps"] for mb in step for i in mb["ids"]]
    assert len(pieces) == len(set(pieces))                          # nothing twice
    assert sorted({i.split(":")[0] for i in pieces}) == sorted(ids)  # nothing lost
    # TP changing with DP: DP 2 x TP 2 -> DP 4 x TP 1 (4 ranks, no topology).
    wide = run_ranks(epoch_job, 4, str(root), None, None, head[0]["state"])
    pieces = [i for r in head if r["tp_rank"] == 0 for step in r["steps"] for mb in step
              for i in mb["ids"]]
    pieces += [i for r in wide for step in r["steps"] for mb in step for i in mb["ids"]]
    assert len(pieces) == len(set(pieces))
    assert sorted({i.split(":")[0] for i in pieces}) == sorted(ids)
