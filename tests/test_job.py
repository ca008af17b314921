"""The job model (streamload/job.py) on its own, with no process group and no data: lengths in
synthetic shards, head windows kept by `plan.windows` and fed from the model's own deal
(`layout_feed`), as the dry run drives it. A state saved after any step and loaded into a fresh
model (at the same or another world size) goes on to deliver every item of the epoch exactly
once, and at the same world size the very same steps as the run that was not interrupted (the
way torchdata.nodes tests its nodes' state: run, save, load, compare)."""
from __future__ import annotations

import time
import zlib

import numpy as np
import pytest

from streamload import pieces
from streamload.config import LoaderConfig, Source
from streamload.job import JobModel, data_options, layout_feed, step_windows
from streamload.plan.windows import Block, ItemQueue, Windows
from streamload.state import decode_state, encode_state

pytestmark = pytest.mark.core

C = 128


def corpus(ranks: int, seed: int = 0) -> list[list[np.ndarray]]:
    """Per source, per shard: document lengths (a few longer than C, split into pieces)."""
    rng = np.random.default_rng([seed, ranks])
    shards = (max(2, ranks // 2), max(1, ranks // 4), max(3, ranks // 8))
    medians = (40, 90, 300)
    return [[np.maximum(rng.lognormal(np.log(m), 0.8, int(rng.integers(10, 30))).astype(np.int64),
                        1) for _ in range(n)] for n, m in zip(shards, medians)]


def shard_blocks(docs: list[np.ndarray]):
    """shard id (virtual, pass-wide) -> its items, cut as the loader cuts them."""
    cut = [pieces.cut_documents(d, C, "split") for d in docs]

    def block(shard: int) -> Block:
        c = cut[shard % len(cut)]
        ids = np.stack([np.full(c.lengths.size, shard, np.int64), c.document, c.chunks()], 1)
        return Block(c.lengths, ids, c.divisible)
    return block


SOURCES = [Source("/x/web/", weight=0.5, name="web"), Source("/x/code/", weight=0.3, name="code"),
           Source("/x/long/", weight=0.2, name="long", on_exhausted="restart")]


def make_job(ranks: int, docs, planner: str = "lookahead") -> tuple[JobModel, list]:
    config = LoaderConfig(micro_batch_tokens=C, micro_batches=1, seed=3, epochs=1,
                          planner=planner)
    job = JobModel.build(config, SOURCES, None, ranks, data=data_options(config, SOURCES, None))
    job.listed([[f"{s}-{k}" for k in range(len(d))] for s, d in enumerate(docs)])
    return job, [shard_blocks(d) for d in docs]


def windows_for(job: JobModel, blocks) -> Windows:
    queues = []
    for r in range(job.world):
        row = []
        for s in range(len(SOURCES)):
            layout = job.layout_for(s, job.epoch)
            units = layout.stream(r) if job.endless(s) else layout.rank_units(r)
            ages = job.resume_ages[s] if job.resumed() else None
            row.append(ItemQueue(layout_feed(units, blocks[s], ages)))
        queues.append(row)
    return Windows(queues)


def run(job: JobModel, windows: Windows, stop_at: int | None = None):
    """Steps until the epoch ends (or `stop_at` steps have been taken): per step, the taken
    items as (source, shard, record, chunk, tokens) rows."""
    steps = []
    while stop_at is None or job.step < stop_at:
        step, offer, plan = step_windows(job, windows)
        if plan is None:
            assert step.outcome == "end_epoch"
            assert job.end_epoch()   # epochs=1
            break
        c = offer.candidates
        steps.append(np.column_stack([c.source[plan.take], offer.ids[plan.take],
                                      plan.length]).astype(np.int64))
    return steps


def covered(steps, num_sources: int):
    """(source, shard, record, piece) -> token ranges delivered; asserts none overlaps."""
    out: dict = {}
    for rows in steps:
        for source, shard, record, chunk, n in rows.tolist():
            k, offset = pieces.split(chunk) if chunk >= 0 else (-1, 0)
            out.setdefault((source, shard, record, k), []).append((offset, offset + n))
    for key, ranges in out.items():
        ranges.sort()
        for (a, b), (c, _) in zip(ranges, ranges[1:]):
            assert b <= c, f"{key}: tokens {c}..{b} delivered twice"
    return out


def assert_exactly_once(steps, docs) -> None:
    """Every item of the finite sources' epoch delivered whole, once; the endless source's
    stream without a token twice."""
    seen = covered(steps, len(docs))
    for s, per_shard in enumerate(docs):
        if SOURCES[s].on_exhausted == "restart":
            continue
        block = shard_blocks(per_shard)
        for shard in range(len(per_shard)):
            b = block(shard)
            for (_, record, chunk), n in zip(b.ids.tolist(), b.lengths.tolist()):
                k = pieces.split(chunk)[0] if chunk >= 0 else -1
                ranges = seen.pop((s, shard, record, k), None)
                assert ranges is not None, f"source {s} shard {shard} record {record}: never"
                assert sum(b - a for a, b in ranges) == n, (s, shard, record, ranges)
    assert not [k for k in seen if SOURCES[k[0]].on_exhausted != "restart"], "items not dealt"


@pytest.mark.parametrize("ranks", [1, 2, 3, 8, 64, 512])
def test_save_load_round_trip(ranks):
    """Save after a few steps, load into a fresh model: the same steps at the same world size,
    exactly once at another; the save and the load themselves take milliseconds."""
    docs = corpus(ranks)
    planner = "lookahead" if ranks <= 64 else "naive"   # the planner is not under test here
    job, blocks = make_job(ranks, docs, planner)
    job.start()
    full = run(job, windows_for(job, blocks))
    assert len(full) >= 4
    stop = len(full) // 2

    job, blocks = make_job(ranks, docs, planner)
    job.start()
    before = run(job, windows_for(job, blocks), stop_at=stop)
    started = time.perf_counter()
    saved = encode_state(job.state(job.snapshot()))
    state = decode_state(saved)
    save_load_s = time.perf_counter() - started
    assert state.step == stop
    for world in sorted({ranks, max(1, ranks // 2), ranks + 1}):
        resumed, blocks = make_job(world, docs, planner)
        started = time.perf_counter()
        resumed.load(state)
        resumed.start()
        load_s = time.perf_counter() - started
        after = run(resumed, windows_for(resumed, blocks))
        if world == ranks:
            assert len(after) == len(full) - stop
            for a, b in zip(after, full[stop:]):
                np.testing.assert_array_equal(a, b)
        assert_exactly_once(before + after, docs)
        print(f"R={ranks}->{world}: state {len(saved)} bytes, save+decode "
              f"{1e3 * save_load_s:.1f} ms, load {1e3 * load_s:.1f} ms")


def test_pending_items_are_saved_as_runs_and_decoded_exactly():
    """The pending items (most of them a shard's next records) are saved as runs and come back
    the same, in the same order; a version-5 state (items one by one) still loads, the same."""
    import msgspec
    from streamload import state as state_module

    docs = corpus(8)
    job, blocks = make_job(8, docs)
    job.start()
    run(job, windows_for(job, blocks), stop_at=3)
    state = job.state(job.snapshot())
    assert len(state.ages) > 8
    saved = msgspec.json.decode(encode_state(state))
    assert saved["version"] == state_module.STATE_VERSION == 6 and saved["pending"] == ""
    back = decode_state(msgspec.json.encode(saved))
    assert back.ages == tuple(sorted(state.ages)) and back.sources == state.sources
    runs, ages = state_module._runs(sorted(state.ages))
    assert runs.shape[0] < len(state.ages)            # some items share a run
    np.testing.assert_array_equal(state_module._items(runs, ages), np.asarray(sorted(state.ages)))

    def v5_columns(data: str, width: int) -> bytes:   # version 5: the same columns, all int64
        raw = msgspec.json.decode(msgspec.json.encode(data), type=bytes)
        table = state_module._unpack(raw, width)       # no delta undone: the stored columns
        return zlib.compress(table.T.astype("<i8").tobytes(), 9) if raw else b""

    v5 = dict(saved, version=5, pending_runs="", pending_ages="")
    for key, width in (("units", 5), ("extras", 3), ("positions", 4)):
        v5[key] = v5_columns(saved[key], width)
    v5["pending"] = zlib.compress(_v5_pending(sorted(state.ages)), 9)
    old = decode_state(msgspec.json.encode(v5))
    assert old.ages == back.ages and old.sources == back.sources and old.version == 6


def _v5_pending(rows) -> bytes:
    columns = np.asarray(rows, np.int64).T.copy()
    for k in (0, 1, 2):
        columns[k] = np.diff(columns[k], prepend=0)
    return columns.astype("<i8").tobytes()


@pytest.mark.parametrize("rows", [[], [(0, 1, 5, 0, 2)], [(0, 1, 5, 0, 2), (0, 1, 6, 0, 2),
                                                          (0, 1, 7, 3, 2), (0, 1, 8, 3, 2),
                                                          (0, 1, 9, 3, 1), (0, 2, 10, 3, 1),
                                                          (1, 2, 11, 3, 1), (1, 2, 13, 3, 1)]])
def test_runs_of_pending_items_round_trip(rows):
    from streamload.state import _items, _runs
    runs, ages = _runs(rows)
    np.testing.assert_array_equal(_items(runs, ages), np.asarray(rows, np.int64).reshape(-1, 5))
    if len(rows) == 8:   # runs break at a new chunk, shard, source or a skipped record
        assert runs[:, 3].tolist() == [1, 2, 0, 0, 0]


def test_windows_start_from_the_deal():
    """The model's deal gives every rank its shards' items, in order, and no rank another's."""
    docs = corpus(4)
    job, blocks = make_job(4, docs)
    job.start()
    windows = windows_for(job, blocks)
    huge = np.full((4, len(SOURCES)), 10 ** 9)
    huge[:, 2] = C   # the endless source has no end
    offer = windows.offer(huge)
    c = offer.candidates
    for s in range(2):   # the finite sources: each rank's window is its whole share
        layout = job.layout_for(s, 0)
        for r in range(4):
            shards = [u.shard for u in layout.rank_units(r)]
            mine = offer.ids[(c.source == s) & (c.rank == r)]
            assert sorted(set(mine[:, 0].tolist())) == sorted(shards)
        assert offer.exhausted[:, s].all()
