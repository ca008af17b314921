"""The per-step message codecs (collective/messages.py), without a process group: what one rank
encodes, every rank decodes to the same windows and plans."""
from __future__ import annotations

import numpy as np
import pytest

from streamload import pieces
from streamload.collective.messages import (OUTCOMES, SourceWindow, decode_plan,
                                            decode_summaries, encode_plan, encode_summary,
                                            plan_size)
from streamload.collective.protocol import OK
from streamload.plan.types import Assignment, Candidates

pytestmark = pytest.mark.core


def window(lengths, *, exhausted=False, extra=None, chunks=None, shard=0, age0=0,
           visual=None):
    n = len(lengths)
    chunks = [-1] * n if chunks is None else chunks
    ids = np.array([[shard, 10 + i, c] for i, c in enumerate(chunks)], np.int64).reshape(n, 3)
    return SourceWindow(np.array(lengths, np.int64), np.arange(age0, age0 + n, dtype=np.int64),
                        ids, exhausted, None if extra is None else np.array(extra, np.float64),
                        None if visual is None else np.array(visual, np.int64).reshape(2, n))


# rank -> source -> window; each case is a job's gathered summaries for one step.
SUMMARY_CASES = {
    "one rank, one source": [[window([5, 7, 9])]],
    "empty windows": [[window([]), window([], exhausted=True)],
                      [window([], exhausted=True), window([])]],
    "two ranks, uneven": [[window([3], shard=1), window([8, 8], exhausted=True, shard=2)],
                          [window([], exhausted=True), window([1, 2, 4], shard=5, age0=3)]],
    "extra costs and pieces": [[window([4, 64], extra=[0.5, 1e-9],
                                       chunks=[-1, pieces.piece(2, 7)])],
                               [window([2], extra=[-3.25], chunks=[pieces.piece(0)])]],
    # images and patches per item: a text window among image windows has none of either
    "images": [[window([9, 3], visual=[[1, 0], [64, 0]]), window([5]),
                window([7, 7, 2], visual=[[2, 1, 0], [8, 16, 0]], exhausted=True)],
               [window([], visual=np.zeros((2, 0))), window([1, 1], shard=3),
                window([4], visual=[[3], [48]], age0=2)]],
}


@pytest.mark.parametrize("case", SUMMARY_CASES)
def test_summaries_round_trip(case):
    per_rank = SUMMARY_CASES[case]
    R, S = len(per_rank), len(per_rank[0])
    encoded = [encode_summary(windows) for windows in per_rank]
    assert all(e.dtype == np.int64 and e[0] == OK for e in encoded)   # the status word first
    decoded = decode_summaries(encoded, S)
    c = decoded.candidates
    assert (c.num_ranks, c.num_sources) == (R, S)
    # The candidates' order: by source, then rank, then position in the window.
    order = [(s, r, p) for s in range(S) for r in range(R)
             for p in range(len(per_rank[r][s].lengths))]
    assert list(zip(c.source.tolist(), c.rank.tolist(), c.position.tolist())) == order
    expect = {name: [] for name in ("length", "age", "ids", "extra", "divisible", "images",
                                    "patches")}
    for s, r, p in order:
        w = per_rank[r][s]
        expect["images"].append(0 if w.visual is None else int(w.visual[0, p]))
        expect["patches"].append(0 if w.visual is None else int(w.visual[1, p]))
        expect["length"].append(int(w.lengths[p]))
        expect["age"].append(int(w.ages[p]))
        expect["ids"].append(w.ids[p].tolist())
        expect["extra"].append(0.0 if w.extra_cost is None else float(w.extra_cost[p]))
        expect["divisible"].append(bool(w.ids[p, 2] >= 0))
    assert c.length.tolist() == expect["length"]
    assert c.age.tolist() == expect["age"]
    assert decoded.ids.reshape(-1, 3).tolist() == expect["ids"]
    assert c.extra_cost.tolist() == expect["extra"]          # float64 bits survive exactly
    assert c.divisible.tolist() == expect["divisible"]
    assert decoded.exhausted.tolist() == [[w.exhausted for w in windows] for windows in per_rank]
    if any(w.visual is not None for windows in per_rank for w in windows):
        assert c.images.tolist() == expect["images"]
        assert c.patches.tolist() == expect["patches"]
    else:
        assert c.images is None and c.patches is None
    # The window and source bounds it knows from the window sizes are the ones searched for
    # on the same columns (`Candidates.window_bounds`), and its windows are the summary's.
    searched = Candidates(c.length, c.source, c.rank, c.position, c.age, c.extra_cost, S, R)
    assert c.window_bounds.tolist() == searched.window_bounds.tolist()
    assert c.dense_positions and searched.dense_positions      # known, and scanned alike
    assert c.by_source(np.arange(S)).tolist() == searched.by_source(np.arange(S)).tolist()
    assert [(key, (w.start, w.stop)) for key, w in c.windows()] == \
        [(key, (w.start, w.stop)) for key, w in searched.windows()]
    assert [key for key, _ in c.windows()] == \
        [(s, r) for s in range(S) for r in range(R) if len(per_rank[r][s].lengths)]


PLAN_CASES = {
    "no assignment": (None, "end_epoch"),
    "empty assignment": (([], [], [], []), "continue"),
    "items": (([4, 0, 9], [1, 0, 1], [0, 1, 1], [7, 30, 2]), "continue"),
    "stop": (([2], [0], [0], [5]), "stop"),
}


@pytest.mark.parametrize("case", PLAN_CASES)
def test_plans_round_trip_within_plan_size(case):
    fields, outcome = PLAN_CASES[case]
    assignment = None
    if fields is not None:
        take, rank, row, length = (np.array(f, np.int64) for f in fields)
        assignment = Assignment(take, rank.astype(np.int32), row.astype(np.int32),
                                np.zeros(2), length)
    encoded = encode_plan(assignment, OUTCOMES.index(outcome))
    assert encoded[0] == OK
    candidates = 10
    assert len(encoded) <= plan_size(candidates)   # the broadcast buffer every rank allocates
    # A receiver decodes from a buffer of plan_size, padded past the message.
    padded = np.full(plan_size(candidates), -99, np.int64)
    padded[:len(encoded)] = encoded
    plan = decode_plan(padded)
    assert OUTCOMES[plan.outcome] == outcome
    got = [plan.take.tolist(), plan.rank.tolist(), plan.row.tolist(), plan.length.tolist()]
    assert got == ([[], [], [], []] if fields is None else [list(f) for f in fields])
