"""A real multi-node launch on one machine: two torchrun processes, as two nodes of two ranks each
(`--nnodes 2 --nproc-per-node 2 --node-rank {0,1} --rdzv-backend c10d`, the rendezvous on a free
loopback port), then a resume on one node of four ranks (`--nnodes 1 --nproc-per-node 4`).

The ranks run tests/multinode_worker.py. What is checked:
- the launcher's layout: four global ranks, two per node (LOCAL_WORLD_SIZE 2, LOCAL_RANK 0 and 1
  on each GROUP_RANK), and the loader's rank and world size are the global RANK and WORLD_SIZE:
  the loader's group spans both nodes;
- the node-level gather: on two nodes every rank's control plane went through one leader per
  node (stats()["control_plane"]["path"] == "node_gather"; ranks 0 and 2 lead), and the leader
  of node 1 sent and received more than the rank it leads (its node's summaries and replies);
  on one node of four it is the one-level gather;
- the epoch is delivered exactly once across the four ranks, with the same number of steps and
  micro-batches on every rank, and every rank holds the same state after step K;
- resumed from that state on one node of four ranks, the first K steps of the two-node run and
  the resumed run's steps together are the epoch exactly once, and (same world size, same seed)
  the resumed steps are the two-node run's steps after K, rank by rank.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from corpus import base_ids, write_jsonl_source
from distributed import TIMEOUT_SCALE, torchrun, torchrun_nodes

WORKER = Path(__file__).resolve().parent / "multinode_worker.py"
STOP = 4
LAUNCH_TIMEOUT = 40 * TIMEOUT_SCALE   # per launch, both within the test's own timeout


def corpus(root: Path) -> set[str]:
    ids = write_jsonl_source(root, "web", shards=4, per_shard=30, seed=1)
    ids |= write_jsonl_source(root, "code", shards=4, per_shard=8, median=900, seed=2)
    ids |= write_jsonl_source(root, "math", shards=2, per_shard=25, median=150, seed=3)
    return ids


def ranks(out: Path, world: int) -> list[dict]:
    records = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
    assert [r["rank"] for r in records] == list(range(world))
    assert all(r["world"] == world for r in records)
    steps = [[s["step"] for s in r["steps"]] for r in records]
    assert all(s == steps[0] for s in steps), steps   # same steps on every rank
    counts = {s["micro_batches"] for r in records for s in r["steps"]}
    assert counts == {2}, counts                       # same micro-batches on every rank
    return records


def every_id(records: list[dict], steps=slice(None)) -> list[str]:
    return [i for r in records for s in r["steps"][steps] for i in s["ids"]]


def output(results) -> str:
    return "\n".join(f"--- node {n}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-4000:]}"
                     for n, r in enumerate(results))


@pytest.mark.timeout(100)   # x STREAMLOAD_TIMEOUT_SCALE; 16-23 s measured at load 5-10
def test_two_nodes_deliver_the_epoch_once_and_one_node_of_four_resumes_it(tmp_path):
    expected = corpus(tmp_path / "corpus")

    two = tmp_path / "two-nodes"
    results = torchrun_nodes(WORKER, tmp_path / "corpus", two, "--stop-at", STOP, nodes=2,
                             nproc=2, timeout=LAUNCH_TIMEOUT)
    assert all(r.returncode == 0 for r in results), output(results)
    records = ranks(two, 4)
    env = [r["env"] for r in records]
    assert [int(e["RANK"]) for e in env] == [0, 1, 2, 3]
    assert all(e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "2" for e in env), env
    nodes = {}
    for e in env:   # two nodes ("groups"), each with local ranks 0 and 1
        nodes.setdefault(e["GROUP_RANK"], []).append(int(e["LOCAL_RANK"]))
        assert int(e["RANK"]) == 2 * int(e["GROUP_RANK"]) + int(e["LOCAL_RANK"]), e
    assert sorted(nodes) == ["0", "1"] and all(sorted(v) == [0, 1] for v in nodes.values()), env

    control = [r["control_plane"] for r in records]
    assert [c["path"] for c in control] == ["node_gather"] * 4, control
    assert [c["leader"] for c in control] == [True, False, True, False], control
    assert [c["node"] for c in control] == [0, 0, 1, 1] and {c["nodes"] for c in control} == {2}
    assert control[2]["bytes_received"] > control[3]["bytes_received"] > 0, control
    assert control[2]["bytes_sent"] > control[3]["bytes_sent"] > 0, control

    ids = every_id(records)
    assert len(ids) == len(set(ids)) and set(base_ids(ids)) == expected   # exactly once
    assert len(records[0]["steps"]) > STOP + 2, "too few steps to stop in the middle"
    assert len({r["state_sha"] for r in records}) == 1 and records[0]["state_sha"]

    one = tmp_path / "one-node"
    proc = torchrun(WORKER, tmp_path / "corpus", one, "--resume", two / "state.json", nproc=4,
                    timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    resumed = ranks(one, 4)
    assert {r["env"]["GROUP_RANK"] for r in resumed} == {"0"}
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in resumed} == {"4"}
    assert {r["control_plane"]["path"] for r in resumed} == {"gather"}   # one node: one level
    union = every_id(records, slice(None, STOP)) + every_id(resumed)
    assert len(union) == len(set(union)) and set(base_ids(union)) == expected   # exactly once
    assert [r["steps"] for r in resumed] == [r["steps"][STOP:] for r in records]
