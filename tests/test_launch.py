"""Refuse the wrong world: a process that the environment calls one of several ranks (torchrun's
RANK, LOCAL_RANK, WORLD_SIZE) must not build a one-rank Loader and read the whole data set."""
from __future__ import annotations

import textwrap

import pytest

import streamload as sl
from corpus import write_jsonl_source
from distributed import torchrun
from streamload.collective.launch import launched_ranks, members_per_node


@pytest.mark.parametrize("environ, several", [
    ({}, False),
    ({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}, False),   # torchrun, one process
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, True),
    ({"RANK": "3"}, True),
    ({"LOCAL_RANK": "1"}, True),
    ({"WORLD_SIZE": "many"}, False),                                  # not a launcher's value
])
def test_launched_ranks_reads_the_launchers_variables(environ, several):
    assert bool(launched_ranks(environ)) is several


@pytest.mark.core
@pytest.mark.parametrize("ranks, local, expected", [
    (range(8), "4", 4),                  # two nodes of four
    (range(8), "8", None),               # one node
    (range(6), "4", None),               # uneven nodes
    (range(8), None, None),              # not known
    ([0, 2, 4, 6], "4", 2),              # a DP group under TP 2: two members per node
    ([0, 2, 4, 6], "2", None),           # one member per node
    ([0, 4, 8, 12, 16, 20], "8", 2),     # TP 4, three nodes
    ([1, 3, 5, 7], "4", 2),              # another coordinate's DP group
])
def test_members_per_node_from_local_world_size(ranks, local, expected):
    environ = {} if local is None else {"LOCAL_WORLD_SIZE": local}
    assert members_per_node(list(ranks), environ) == expected


def test_a_loader_under_a_launcher_without_a_process_group_is_refused(tmp_path, monkeypatch):
    write_jsonl_source(tmp_path, "web", shards=2, per_shard=10, seed=1)
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(sl.UsageError) as info:
        sl.Loader([sl.Source(str(tmp_path / "web"))], micro_batch_tokens=1024)
    message = str(info.value)
    assert "RANK=1" in message and "WORLD_SIZE=2" in message
    assert "torch.distributed.init_process_group(" in message and "before building the Loader" \
        in message
    monkeypatch.setenv("WORLD_SIZE", "1")   # one process under torchrun: nothing to refuse
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with sl.Loader([sl.Source(str(tmp_path / "web"))], micro_batch_tokens=1024) as loader:
        assert (loader.rank, loader.world_size) == (0, 1)


@pytest.mark.timeout(240)
def test_torchrun_without_init_process_group_fails_on_every_rank(tmp_path):
    """The issue's run, under a real `torchrun --nproc-per-node 2`: every rank stops with the
    UsageError (exit status not 0), and no rank reads anything."""
    write_jsonl_source(tmp_path, "web", shards=2, per_shard=10, seed=1)
    script = tmp_path / "no_init.py"
    # Each rank records its refusal in a file and waits for the other's before it exits: when
    # one worker exits non-zero, torchrun tears the others down, and on a loaded machine the
    # slower rank was killed before it got as far as printing.
    script.write_text(textwrap.dedent("""
        import os, sys, time
        import streamload as sl
        out = sys.argv[2]
        try:
            sl.Loader([sl.Source(sys.argv[1])], micro_batch_tokens=1024)
        except sl.UsageError as exc:
            with open(os.path.join(out, f"refused-{os.environ['RANK']}"), "w") as f:
                f.write(str(exc))
            deadline = time.monotonic() + 120
            while len([n for n in os.listdir(out) if n.startswith("refused-")]) < 2 \\
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.exit(3)
        print("built a loader", flush=True)
    """))
    out = tmp_path / "out"
    out.mkdir()
    proc = torchrun(script, tmp_path / "web", out, timeout=200)
    assert proc.returncode != 0, proc.stdout + proc.stderr[-3000:]
    assert "built a loader" not in proc.stdout
    refusals = {p.name: p.read_text() for p in out.iterdir()}
    assert sorted(refusals) == ["refused-0", "refused-1"], proc.stdout + proc.stderr[-3000:]
    assert "RANK=0" in refusals["refused-0"] and "RANK=1" in refusals["refused-1"]
    assert all("init_process_group" in text for text in refusals.values())
