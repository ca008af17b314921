"""Storage faults through a real HTTP proxy in front of moto: the loader retries with backoff and a
per-request timeout, delivers the epoch exactly once, reports its retries, and names the object
when the faults outlast the retry budget."""
from __future__ import annotations

import time
from collections import Counter

import pytest

import streamload as sl
from corpus import base_ids, upload_dir, write_jsonl_source, write_token_source
from faultproxy import KINDS, FaultProxy

pytestmark = pytest.mark.timeout(100)

# Tight budget: small backoffs, and a stall costs one request_timeout_s before its retry.
POLICY = sl.RetryPolicy(max_attempts=8, initial_backoff_s=0.005, max_backoff_s=0.05,
                        request_timeout_s=1.0)


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint_url, slow_s=0.3, stall_s=60.0) as p:
        yield p


@pytest.fixture
def s3_corpus(tmp_path, s3_bucket):
    """Plain JSONL (many ranged reads at a small chunk size) and token shards, on S3."""
    client, bucket = s3_bucket
    ids = write_jsonl_source(tmp_path, "web", shards=4, per_shard=30, seed=11)
    ids |= write_token_source(tmp_path, "math", shards=2, per_shard=20, seed=12)
    for name in ("web", "math"):
        upload_dir(client, bucket, tmp_path / name, name)
    return bucket, ids


def run_epoch(bucket, endpoint_url, *, retry=POLICY, sources=("web", "math")):
    """One epoch through `endpoint_url`: (batches as lists of sample ids, stats)."""
    with sl.Loader([sl.Source(f"s3://{bucket}/{name}/") for name in sources],
                   micro_batch_tokens=1024, micro_batches=2, epochs=1, chunk_bytes=1024,
                   storage_options={"endpoint_url": endpoint_url}, retry=retry) as loader:
        batches = [[list(mb.sample_ids) for mb in batch.micro_batches] for batch in loader]
        return batches, loader.stats()


def delivered(batches) -> list[str]:
    return [i for batch in batches for ids in batch for i in ids]


def assert_exactly_once(batches, expected) -> None:
    ids = delivered(batches)
    assert len(ids) == len(set(ids)), "a sample was delivered twice"
    assert set(base_ids(ids)) == expected, "a sample was lost"


def store_stats(stats) -> dict:
    """Request counters summed over the sources (each source counts its own requests)."""
    keys = ("requests", "retries", "bytes_fetched")
    return {k: sum(src[k] for src in stats["sources"].values()) for k in keys}


def test_proxy_without_faults_is_transparent(proxy, s3_corpus, storage_options):
    bucket, expected = s3_corpus
    direct, _ = run_epoch(bucket, storage_options["endpoint_url"])
    through, stats = run_epoch(bucket, proxy.url)
    assert through == direct
    assert_exactly_once(through, expected)
    assert proxy.total_injected == 0 and proxy.object_gets > 20, proxy.object_gets
    assert store_stats(stats)["retries"] == 0


def first_range(request) -> bool:
    return (request.header("Range") or "").startswith("bytes=0-")


@pytest.mark.parametrize("kind", KINDS)
def test_each_fault_kind_is_retried_and_the_epoch_is_exactly_once(proxy, s3_corpus, kind):
    bucket, expected = s3_corpus
    if kind == "stall":
        proxy.inject(kind, every=5, limit=3)        # each one costs request_timeout_s
    elif kind == "slow_first_byte":
        proxy.inject(kind, every=4, limit=6)
    elif kind == "reset":
        # The first two sends of each object's first range: aiohttp resends a GET once by
        # itself after a reset before the response, so the second reset reaches the loader.
        proxy.inject(kind, first=2, per="range", when=first_range)
    else:
        # Every 3rd object GET, but no byte range more than twice: the faults are dense, and a
        # range's retries cannot all land on every 3rd GET (concurrent fetches retrying in step
        # once did, and spent all 8 attempts on one range).
        proxy.inject(kind, every=3, first=2, per="range")
    started = time.perf_counter()
    batches, stats = run_epoch(bucket, proxy.url)
    elapsed = time.perf_counter() - started
    assert_exactly_once(batches, expected)
    injected = proxy.injected[kind]
    assert injected >= 3, proxy.injected
    # Retries of requests that were answered without a fault, but only after the client's
    # request timeout (a loaded machine), are retries too: not counted as the faults' own.
    retries = store_stats(stats)["retries"] - proxy.unfaulted_resent()
    if kind == "slow_first_byte":
        # A slow first byte within request_timeout_s is waited for, not retried.
        assert retries == 0, stats
    elif kind == "reset":
        assert injected == 2 * 8, proxy.log     # 4 JSONL shards, 2 token + 2 offsets files
        assert 8 <= retries <= injected, (retries, proxy.injected)
    else:
        # Each failed attempt is retried once, and only those are: exact.
        assert retries == injected, (retries, proxy.injected)
    if kind == "stall":
        assert elapsed >= POLICY.request_timeout_s   # it did wait for the timeout
    assert store_stats(stats)["requests"] >= proxy.object_gets - proxy.injected["reset"]


def test_a_mix_of_faults_changes_nothing_the_trainer_sees(proxy, s3_corpus, storage_options):
    bucket, expected = s3_corpus
    clean, _ = run_epoch(bucket, storage_options["endpoint_url"])
    proxy.inject("stall", every=9, limit=2)
    # At most 2 faults per byte range from each rule: 4 < the 8 attempts, whatever the timing.
    proxy.inject([k for k in KINDS if k != "stall"], every=2, first=2, per="range")
    batches, stats = run_epoch(bucket, proxy.url)
    assert batches == clean, "faults changed the batch sequence"
    assert_exactly_once(batches, expected)
    assert set(proxy.injected) == set(KINDS), proxy.injected
    # Exact but for resets before a response, which aiohttp may have resent by itself.
    retries = store_stats(stats)["retries"] - proxy.unfaulted_resent()
    failing = proxy.failing_injected()
    assert failing - proxy.injected["reset"] <= retries <= failing, (retries, proxy.injected)


def test_first_requests_to_every_key_fail(proxy, s3_corpus):
    """Every object's first two GETs fail: a cold, throttled bucket."""
    bucket, expected = s3_corpus
    proxy.inject(["slowdown", "truncate"], first=2)
    batches, stats = run_epoch(bucket, proxy.url)
    assert_exactly_once(batches, expected)
    keys = {key for _, key, _ in proxy.log}
    assert len(keys) == 4 + 2 * 2      # every JSONL shard, every token and offsets file
    assert store_stats(stats)["retries"] - proxy.unfaulted_resent() == proxy.total_injected \
        == 2 * len(keys)


@pytest.mark.parametrize("kind,cause", [
    ("slowdown", "SlowDown"),
    ("internal_error", "InternalError"),
    ("reset", ""),
    ("truncate", ""),
    ("stall", "no response within 1 s"),
])
def test_faults_that_outlast_the_retries_name_the_object(proxy, s3_corpus, kind, cause):
    bucket, _ = s3_corpus
    key = "web/part-002.jsonl"
    proxy.inject(kind, when=lambda request: request.key == key)
    # The timeout is long enough that the other objects' requests do not run out of attempts
    # on a loaded machine, and far shorter than the proxy's stall.
    policy = sl.RetryPolicy(max_attempts=3, initial_backoff_s=0.005, max_backoff_s=0.02,
                            request_timeout_s=1.0)
    started = time.perf_counter()
    with pytest.raises(sl.StorageError, match="gave up after 3 attempts") as caught:
        run_epoch(bucket, proxy.url, retry=policy)
    assert time.perf_counter() - started < proxy.stall_s   # it did not wait out a stall
    message = str(caught.value)
    assert f"s3://{bucket}/{key}" in message, message
    assert caught.value.uri == f"s3://{bucket}/{key}"
    assert cause in message, message
    assert "testing" not in message   # the (fake) credentials never show
    # Each ranged read of that object (range_readahead of them run at once) was attempted
    # max_attempts times at most, and one of them exactly that often. aiohttp resends a GET
    # once by itself after a reset before the response.
    per_range = Counter(byte_range for _, _, byte_range in proxy.log)
    sends = 2 if kind == "reset" else 1
    assert max(per_range.values()) == 3 * sends, proxy.log
    assert {k for _, k, _ in proxy.log} == {key}


def test_retries_are_reported_for_the_source_that_had_them(proxy, s3_corpus):
    bucket, expected = s3_corpus
    proxy.inject("slowdown", first=1, when=lambda request: request.key.startswith("math/"))
    batches, stats = run_epoch(bucket, proxy.url)
    assert_exactly_once(batches, expected)
    assert proxy.injected["slowdown"] == 4   # two token files, two offsets files
    assert stats["sources"]["math"]["retries"] == 4
    assert stats["sources"]["web"]["retries"] == 0


def test_credentials_stay_out_of_errors_stats_and_state(proxy, s3_corpus):
    """Explicit keys (moto accepts any) reach S3 in signed requests only: not in the error
    after the retries run out, not in stats(), not in the saved state."""
    bucket, _ = s3_corpus
    key_id, secret = "AKIAFAULTTESTKEY0001", "fault/test/secret+do+not+leak0001"
    options = {"endpoint_url": proxy.url, "aws_access_key_id": key_id,
               "aws_secret_access_key": secret, "aws_session_token": "fault-session-token-0001"}
    proxy.inject("internal_error", when=lambda request: request.key == "web/part-003.jsonl")
    policy = sl.RetryPolicy(max_attempts=2, initial_backoff_s=0.001, request_timeout_s=1.0)
    with sl.Loader([sl.Source(f"s3://{bucket}/web/"), sl.Source(f"s3://{bucket}/math/")],
                   micro_batch_tokens=1024, micro_batches=2, epochs=1, chunk_bytes=1024,
                   storage_options=options, retry=policy) as loader:
        with pytest.raises(sl.StorageError) as caught:
            for _ in loader:
                pass
        texts = [str(caught.value), repr(caught.value), repr(loader.config),
                 repr(loader.stats()), repr(loader.state_dict())]
    assert f"s3://{bucket}/web/part-003.jsonl" in texts[0]
    # The keys were used: requests were signed with them.
    assert proxy.history, "no request went through the proxy: the signing was not tested"
    assert all(key_id in (r.header("Authorization") or "") for r in proxy.history)
    for text in texts:
        for secret_text in (key_id, secret, "fault-session-token-0001"):
            assert secret_text not in text, (secret_text, text)
