"""The memory budget is enforced, and concurrency adapts to a slow source."""
from __future__ import annotations

import time

import pytest

import streamload as sl
from corpus import write_jsonl_source

pytestmark = pytest.mark.timeout(90)


def test_budget_too_small_is_a_clear_error():
    with pytest.raises(sl.ConfigError, match=r"memory_budget.*source 'web'"):
        sl.Loader([sl.Source("/data/web/")], micro_batch_tokens=65536, micro_batches=8,
                  memory_budget=1 << 20)


def test_bytes_in_flight_and_buffered_stay_within_budget(tmp_path):
    write_jsonl_source(tmp_path, "a", shards=6, per_shard=400, median=2000, seed=1)
    write_jsonl_source(tmp_path, "b", shards=6, per_shard=400, median=500, compression="zst", seed=2)
    budget, chunk = 4 << 20, 64 << 10
    with sl.Loader([sl.Source(str(tmp_path / "a")), sl.Source(str(tmp_path / "b"))],
                   micro_batch_tokens=4096, micro_batches=2, epochs=1, memory_budget=budget,
                   chunk_bytes=chunk, shard_prefetch=8, range_readahead=8) as loader:
        peak_buffer, peak_total = {}, 0
        for step, _ in enumerate(loader):
            time.sleep(0.002)   # a trainer: lets the fetchers run ahead to their limits
            sources = loader.stats()["sources"]
            for name, src in sources.items():
                # Buffers are resized step by step (the memory plan): a full buffer waits for
                # room under the capacity in force, so it never holds more than that plus an
                # item (a row, at most).
                peak_buffer[name] = max(peak_buffer.get(name, 0),
                                        src["buffer_tokens"] - src["buffer_capacity_tokens"])
            peak_total = max(peak_total, sum(src["inflight_budget_bytes"]
                                             + src["buffer_capacity_tokens"] * 4
                                             for src in sources.values()))
        stats = loader.stats()["sources"]
    for name, src in stats.items():
        # The documented bound: the limit in force plus one range of the shard being drained,
        # where a range of compressed text decodes to `decoded_per_raw_byte` times its size
        # (plus the spread of that ratio between ranges).
        slack = 2 * chunk * src["decoded_per_raw_byte"]
        assert src["inflight_over_budget_peak_bytes"] <= slack, (name, src)
        assert src["inflight_bytes_peak"] > 0
        assert peak_buffer[name] <= 4096
    assert 0 < peak_total <= budget


def test_a_slow_source_gets_more_concurrency(tmp_path):
    write_jsonl_source(tmp_path, "slow", shards=16, per_shard=60, median=300, seed=3)
    write_jsonl_source(tmp_path, "fast", shards=4, per_shard=300, median=300, seed=4)

    def tokenizer(text):
        if text.startswith("slow"):
            time.sleep(0.002)
        return list(text.encode())

    # Mark the slow source's documents by rewriting them with a prefix.
    import json
    for path in (tmp_path / "slow").iterdir():
        lines = [json.loads(l) for l in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({"text": "slow " + l["text"]}) + "\n" for l in lines))

    with sl.Loader([sl.Source(str(tmp_path / "slow")), sl.Source(str(tmp_path / "fast"))],
                   memory_budget=256 << 20,
                   micro_batch_tokens=2048, micro_batches=2, epochs=1, tokenizer=tokenizer,
                   shard_prefetch=1, range_readahead=1, chunk_bytes=8192,
                   transform_workers=4) as loader:
        for _ in loader:
            pass
        stats = loader.stats()["sources"]
    assert stats["slow"]["autoscale_changes"], stats["slow"]
    assert all(set(c) == {"step", "shard_concurrency", "range_readahead"}   # labelled changes
               for c in stats["slow"]["autoscale_changes"])
    # It grew while it made steps wait (and may shrink again once its buffer sat full).
    assert max(c["shard_concurrency"] for c in stats["slow"]["autoscale_changes"]) > 1, \
        stats["slow"]
    assert stats["slow"]["step_wait_s"] > stats["fast"]["step_wait_s"]
