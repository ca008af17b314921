"""One request for back-to-back ranges (`pipeline/fetch.py`): fewer requests, the same items."""
from __future__ import annotations

from collections import deque

import streamload as sl
from streamload.pipeline.fetch import split_run, take_run

from corpus import base_ids, write_jsonl_source


def test_take_run_takes_back_to_back_ranges_up_to_the_limit():
    ranges = deque([(0, 10), (10, 20), (20, 25), (40, 50), (50, 60)])
    assert take_run(ranges, 2) == [(0, 10), (10, 20)]
    assert take_run(ranges, 8) == [(20, 25)]              # a gap ends a run
    assert take_run(ranges, 0) == [(40, 50)]              # at least one range
    assert take_run(ranges, 8) == [(50, 60)] and not ranges


def test_split_run_cuts_the_read_back_into_its_ranges():
    run = [(100, 104), (104, 110), (110, 112)]
    assert split_run(b"abcdefghijkl", run) == [b"abcd", b"efghij", b"kl"]
    # A read that ended early (the object is shorter): the last ranges come back short or empty.
    assert split_run(b"abcdefg", run) == [b"abcd", b"efg", b""]
    assert split_run(b"xyz", [(7, 10)]) == [b"xyz"]


def _epoch(path, **options):
    with sl.Loader([sl.Source(str(path), name="web")], micro_batch_tokens=2048, micro_batches=2,
                   epochs=1, chunk_bytes=4096, **options) as loader:
        ids = [i for b in loader for mb in b.micro_batches for i in mb.sample_ids]
        stats = loader.stats()["sources"]["web"]
    return ids, stats


def test_runs_read_fewer_requests_and_deliver_the_same_samples(tmp_path):
    expected = write_jsonl_source(tmp_path, "web", shards=3, per_shard=80, median=300, seed=7)
    single, one = _epoch(tmp_path / "web", range_readahead=1, max_range_readahead=1)
    runs, many = _epoch(tmp_path / "web", range_readahead=4, max_range_readahead=4,
                        memory_budget=256 << 20)
    assert set(base_ids(single)) == set(base_ids(runs)) == expected
    assert len(runs) == len(set(runs)) and runs == single    # same batches, same order
    assert many["bytes_fetched"] == one["bytes_fetched"]
    # Every range its own request with a readahead of 1; up to 4 ranges per request with 4.
    assert many["requests"] < one["requests"] / 2, (many["requests"], one["requests"])
