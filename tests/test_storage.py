"""Storage: real moto S3 server through real aiobotocore, real files, fsspec's memory filesystem.
Mocks only inject faults that a healthy server cannot produce (503s, short bodies, hangs)."""
from __future__ import annotations

import asyncio
import errno
import mmap
import socket
import time
import uuid
from types import SimpleNamespace

import fsspec
import pytest
from botocore.exceptions import ClientError

from streamload.errors import ConfigError, StorageError
from streamload.storage import (
    ObjectInfo,
    ObjectStore,
    RetryPolicy,
    StoreCounters,
    open_store,
    relative_name,
)
from streamload.storage.buffers import MAPPED_BYTES, mapped_buffer
from streamload.storage.fs import FsspecStore, LocalStore
from streamload.storage.listing import glob_regex
from streamload.storage.retry import with_retries
from streamload.storage.s3 import S3Store

# Quick retries so that fault tests take milliseconds.
# Short backoffs; a request timeout far above a request on a loaded machine (two injected faults
# leave the third attempt no retry, so an attempt cut by the timeout would fail the test).
FAST = RetryPolicy(max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.005,
                   request_timeout_s=60.0)

# One tree, written to every backend: the parity test checks they select the same shards.
TREE = {
    "web/a.jsonl": b"a" * 10,
    "web/a.jsonl.bak": b"old",
    "web/b.jsonl": b"b" * 20,
    "web/sub/c.jsonl": b"c" * 30,
    "web/sub/deep/d.jsonl": b"d" * 40,
    "web/sub/notes.txt": b"n" * 5,
    "webfoo/e.jsonl": b"e" * 50,
    "logs/2024-01/x.log": b"x" * 6,
    "logs/2024-02/y.log": b"y" * 7,
}
DATA = bytes(range(256)) * 4  # 1 KiB where every offset has a checkable value


def _names(root: str, infos: list[ObjectInfo]) -> list[str]:
    return [relative_name(root, info.uri) for info in infos]


@pytest.fixture(scope="module")
def tree_bucket(s3_server):
    """A bucket holding TREE (plus a console "folder" marker), shared by the read-only tests."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1")
    bucket = f"tree-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=bucket)
    for key, body in TREE.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)
    client.put_object(Bucket=bucket, Key="web/empty/", Body=b"")
    return bucket


@pytest.fixture
async def tree(tree_bucket, storage_options):
    """(S3Store, bucket name) over the shared TREE bucket."""
    async with S3Store(storage_options, retry=FAST) as store:
        yield store, tree_bucket


@pytest.fixture
async def s3(s3_bucket, storage_options):
    """(S3Store with FAST retries, boto3 client, fresh bucket) over the moto server."""
    client, bucket = s3_bucket
    async with S3Store(storage_options, retry=FAST) as store:
        yield store, client, bucket


@pytest.fixture
def local_tree(tmp_path):
    for key, body in TREE.items():
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(body)
    return tmp_path


@pytest.fixture
def memory_root():
    """A fresh directory in fsspec's (process-global) memory filesystem, holding TREE."""
    fs = fsspec.filesystem("memory")
    root = f"/t-{uuid.uuid4().hex[:12]}"
    for key, body in TREE.items():
        fs.pipe(f"{root}/{key}", body)
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


# --- S3 listing ---------------------------------------------------------------------------------

async def test_s3_list_directory_is_recursive_and_skips_markers(tree):
    store, bucket = tree
    expected = [ObjectInfo(f"s3://{bucket}/{key}", len(TREE[key])) for key in sorted(TREE)
                if key.startswith("web/")]
    assert len(expected) == 6
    assert await store.list(f"s3://{bucket}/web") == expected
    assert await store.list(f"s3://{bucket}/web/") == expected


async def test_s3_list_exact_key_returns_only_that_object(tree):
    store, bucket = tree
    uri = f"s3://{bucket}/web/a.jsonl"  # "web/a.jsonl.bak" exists too
    assert await store.list(uri) == [ObjectInfo(uri, 10)]
    assert _names(uri, await store.list(uri)) == ["a.jsonl"]


async def test_s3_list_falls_back_to_a_raw_key_prefix(tree):
    store, bucket = tree
    root = f"s3://{bucket}/logs/2024-"
    assert _names(root, await store.list(root)) == ["2024-01/x.log", "2024-02/y.log"]


async def test_s3_list_whole_bucket(tree):
    store, bucket = tree
    assert _names(f"s3://{bucket}", await store.list(f"s3://{bucket}")) == sorted(TREE)
    assert len(await store.list(f"s3://{bucket}/")) == len(TREE)


GLOB_CASES = [
    ("web/*.jsonl", ["a.jsonl", "b.jsonl"]),
    ("web/**/*.jsonl", ["a.jsonl", "b.jsonl", "sub/c.jsonl", "sub/deep/d.jsonl"]),
    ("web/*/*.jsonl", ["sub/c.jsonl"]),
    ("web/[ab].jsonl", ["a.jsonl", "b.jsonl"]),
    ("web/[!a].jsonl", ["b.jsonl"]),
    ("web/?.jsonl*", ["a.jsonl", "a.jsonl.bak", "b.jsonl"]),
    ("web*/*.jsonl", ["web/a.jsonl", "web/b.jsonl", "webfoo/e.jsonl"]),
]


async def test_s3_list_glob(tree):
    store, bucket = tree
    for pattern, expected in GLOB_CASES:
        root = f"s3://{bucket}/{pattern}"
        assert _names(root, await store.list(root)) == expected, pattern


async def test_s3_list_paginates(tree):
    store, bucket = tree
    store.list_page_size = 2  # force several list_objects_v2 pages
    infos = await store.list(f"s3://{bucket}/web/")  # 7 keys with the marker: 4 pages
    assert len(infos) == 6
    assert store.counters.requests == 4


async def test_s3_missing_bucket_error_names_bucket_and_uri(storage_options):
    async with S3Store(storage_options, retry=FAST) as store:
        uri = "s3://no-such-bucket-here/web/"
        with pytest.raises(StorageError, match=r"bucket 'no-such-bucket-here' does not exist") as e:
            await store.list(uri)
        assert uri in str(e.value) and e.value.uri == uri
        with pytest.raises(StorageError, match="no-such-bucket-here"):
            await store.read_range("s3://no-such-bucket-here/a.jsonl", 0, 10)
        assert store.counters.retries == 0


async def test_s3_no_match_error_names_uri(tree):
    store, bucket = tree
    for suffix in ("nothing/", "nothing", "web/*.parquet"):
        uri = f"s3://{bucket}/{suffix}"
        with pytest.raises(StorageError, match="no objects match") as e:
            await store.list(uri)
        assert uri in str(e.value) and e.value.uri == uri


# --- S3 reads ----------------------------------------------------------------------------------

async def test_s3_read_range_returns_exact_bytes(s3):
    store, client, bucket = s3
    client.put_object(Bucket=bucket, Key="obj.bin", Body=DATA)
    for start, end, expected in [
        (0, 1024, DATA),
        (0, 1, DATA[:1]),
        (100, 300, DATA[100:300]),
        (1000, 2000, DATA[1000:]),   # past the end: short, like a file
        (1024, 1030, b""),           # at the end
        (5, 5, b""),
    ]:
        before = store.counters.bytes_read
        assert await store.read_range(f"s3://{bucket}/obj.bin", start, end) == expected
        assert store.counters.bytes_read - before == len(expected)
    assert store.counters.retries == 0


def test_mapped_buffer_is_a_mapping_from_its_threshold():
    small, large = mapped_buffer(MAPPED_BYTES - 1), mapped_buffer(MAPPED_BYTES)
    assert isinstance(small, bytearray) and len(small) == MAPPED_BYTES - 1
    assert isinstance(large, mmap.mmap) and len(large) == MAPPED_BYTES
    assert large.find(b"\x01") == -1 and not any(small)   # zeros, both


# A body of 2 MAPPED_BYTES and a bit, and reads of it: whole, inside, small, past its end.
BIG = bytes(range(256)) * (2 * MAPPED_BYTES // 256) + b"tail"
READS_OF_BIG = [(0, len(BIG)), (3, len(BIG) - 5), (100, 300),
                (len(BIG) - 10, len(BIG) + 100), (MAPPED_BYTES, len(BIG) + 1)]


async def test_s3_read_range_into_a_buffer(s3):
    """With `buffer`, the body's pieces are written into `buffer(length)` as they arrive and
    that buffer comes back: the same bytes as without, the same counts."""
    store, client, bucket = s3
    client.put_object(Bucket=bucket, Key="big.bin", Body=BIG)
    uri = f"s3://{bucket}/big.bin"
    for start, end in READS_OF_BIG:
        got = await store.read_range(uri, start, end, buffer=mapped_buffer)
        assert bytes(got) == BIG[start:end] == await store.read_range(uri, start, end)
        assert isinstance(got, mmap.mmap if end - start >= MAPPED_BYTES else bytearray)
    assert await store.read_range(uri, len(BIG), len(BIG) + 6, buffer=mapped_buffer) == b""
    assert store.counters.bytes_read == 2 * sum(len(BIG[a:b]) for a, b in READS_OF_BIG)
    assert store.counters.retries == 0


async def test_s3_short_body_into_a_buffer_is_retried(s3, monkeypatch):
    """A body that ends before its Content-Range says (a dropped connection) is retried on the
    buffer path too, and the retry's bytes are the ones returned."""
    store, client, bucket = s3
    client.put_object(Bucket=bucket, Key="big.bin", Body=BIG)
    aio_client = await store._get_client()
    real_get, faults = aio_client.get_object, ["short"]

    class ShortContent:   # aiohttp's StreamReader, the body's last 3 bytes lost
        def __init__(self, data: bytes):
            self.pieces = [data[:1000], data[1000:-3]]

        async def readchunk(self):
            return (self.pieces.pop(0) if self.pieces else b"", False)

    class ShortBody:
        def __init__(self, data: bytes):
            self.raw_stream = SimpleNamespace(content=ShortContent(data))

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc_info):
            return None

    async def faulty_get(**kwargs):
        resp = await real_get(**kwargs)
        if faults:
            faults.pop()
            async with resp["Body"] as body:
                resp["Body"] = ShortBody(await body.read())
        return resp

    monkeypatch.setattr(aio_client, "get_object", faulty_get)
    got = await store.read_range(f"s3://{bucket}/big.bin", 7, len(BIG), buffer=mapped_buffer)
    assert bytes(got) == BIG[7:] and store.counters.retries == 1


async def test_s3_read_counts_requests_and_latency(s3):
    store, client, bucket = s3
    client.put_object(Bucket=bucket, Key="obj.bin", Body=DATA)
    for offset in range(0, 1024, 256):
        await store.read_range(f"s3://{bucket}/obj.bin", offset, offset + 256)
    assert store.counters.requests == 4
    assert store.counters.bytes_read == 1024
    assert len(store.counters.latencies_s) == 4 and min(store.counters.latencies_s) > 0


async def test_s3_missing_key_is_final_not_retried(s3):
    store, _, bucket = s3
    uri = f"s3://{bucket}/missing.jsonl"
    with pytest.raises(StorageError, match="no such object") as e:
        await store.read_range(uri, 0, 10)
    assert e.value.uri == uri and uri in str(e.value)
    assert store.counters.retries == 0 and store.counters.requests == 1


async def test_s3_bad_range_is_rejected(s3):
    store, _, bucket = s3
    with pytest.raises(ValueError, match="bad byte range"):
        await store.read_range(f"s3://{bucket}/x", 10, 5)


async def test_s3_endpoint_and_region_come_from_environment(s3_bucket, monkeypatch):
    client, bucket = s3_bucket
    client.put_object(Bucket=bucket, Key="k", Body=b"hello")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    async with S3Store(retry=FAST) as store:  # AWS_ENDPOINT_URL is set by the s3_server fixture
        assert await store.read_range(f"s3://{bucket}/k", 1, 4) == b"ell"
        assert store._client.meta.region_name == "us-east-1"


async def test_s3_concurrency_bound_is_honoured(s3_bucket, storage_options, monkeypatch):
    client, bucket = s3_bucket
    client.put_object(Bucket=bucket, Key="obj.bin", Body=DATA)
    limited = S3Store(storage_options, max_concurrency=3)
    aio_client = await limited._get_client()
    real_get, in_flight, peak = aio_client.get_object, 0, 0

    async def counting_get(**kwargs):  # observes the real call; injects nothing
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(0.01)  # hold the slot long enough for others to pile up
            return await real_get(**kwargs)
        finally:
            in_flight -= 1

    monkeypatch.setattr(aio_client, "get_object", counting_get)
    try:
        uri = f"s3://{bucket}/obj.bin"
        chunks = await asyncio.gather(*(limited.read_range(uri, i * 64, i * 64 + 64)
                                        for i in range(16)))
    finally:
        await limited.aclose()
    assert b"".join(chunks) == DATA
    assert peak == 3


# --- S3 faults and retries ----------------------------------------------------------------------

def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "injected"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


async def _inject(store: S3Store, monkeypatch, failures: list):
    """Make get_object fail with each item of `failures` in turn (an exception to raise, or
    "short" to return a body missing its last bytes, or "hang"), then behave normally."""
    aio_client = await store._get_client()
    real_get = aio_client.get_object

    class ShortBody:
        def __init__(self, data: bytes):
            self.data = data

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc_info):
            return None

        async def read(self):
            return self.data

    async def faulty_get(**kwargs):
        if failures:
            fault = failures.pop(0)
            if fault == "hang":
                await asyncio.Event().wait()
            if isinstance(fault, BaseException):
                raise fault
            resp = await real_get(**kwargs)
            async with resp["Body"] as body:
                resp["Body"] = ShortBody((await body.read())[:-3])
            return resp
        return await real_get(**kwargs)

    monkeypatch.setattr(aio_client, "get_object", faulty_get)


@pytest.mark.parametrize("fault", [
    _client_error("SlowDown", 503),
    _client_error("InternalError", 500),
    _client_error("TooManyRequests", 429),
    _client_error("ServiceUnavailable", 503),
    ConnectionResetError("peer reset"),
    "short",
])
async def test_s3_transient_faults_are_retried(s3, monkeypatch, fault):
    store, client, bucket = s3
    client.put_object(Bucket=bucket, Key="obj.bin", Body=DATA)
    await _inject(store, monkeypatch, [fault, fault])
    assert await store.read_range(f"s3://{bucket}/obj.bin", 10, 500) == DATA[10:500]
    assert store.counters.retries == 2
    assert store.counters.bytes_read == 490


async def test_s3_hung_request_times_out_and_is_retried(s3_bucket, storage_options, monkeypatch):
    """A request that never answers is cut at request_timeout_s and retried. The timeout is
    ten times what a first request (connection included) takes here, so that the real retry
    fits in it on a loaded machine too; and should one still not, it is retried in turn."""
    client, bucket = s3_bucket
    client.put_object(Bucket=bucket, Key="obj.bin", Body=DATA)
    uri = f"s3://{bucket}/obj.bin"
    async with S3Store(storage_options, retry=FAST) as probe:
        started = time.perf_counter()
        assert await probe.read_range(uri, 0, 4) == DATA[:4]
        timeout = max(0.2, 10 * (time.perf_counter() - started))
    policy = RetryPolicy(max_attempts=6, initial_backoff_s=0.001, request_timeout_s=timeout)
    async with S3Store(storage_options, retry=policy) as store:
        faults = ["hang"]
        await _inject(store, monkeypatch, faults)
        started = time.perf_counter()
        assert await store.read_range(uri, 0, 4) == DATA[:4]
        assert faults == [], "the first attempt did not hang"
        assert store.counters.retries >= 1                    # the hung attempt was retried
        assert time.perf_counter() - started >= timeout       # ... once its timeout ran out


async def test_s3_exhausted_retries_name_the_object(s3, monkeypatch):
    store, client, bucket = s3
    client.put_object(Bucket=bucket, Key="obj.bin", Body=DATA)
    await _inject(store, monkeypatch, [_client_error("SlowDown", 503)] * 10)
    uri = f"s3://{bucket}/obj.bin"
    with pytest.raises(StorageError, match="gave up after 3 attempts") as e:
        await store.read_range(uri, 0, 10)
    assert e.value.uri == uri and str(e.value).startswith(uri)
    assert "SlowDown" in str(e.value)
    assert store.counters.retries == 2


async def test_s3_access_denied_is_final(s3, monkeypatch):
    store, client, bucket = s3
    await _inject(store, monkeypatch, [_client_error("AccessDenied", 403)])
    uri = f"s3://{bucket}/obj.bin"
    with pytest.raises(StorageError, match="access denied") as e:
        await store.read_range(uri, 0, 10)
    assert uri in str(e.value) and store.counters.retries == 0


async def test_s3_unreachable_endpoint_is_retried_then_named(s3_server):
    with socket.socket() as sock:  # a loopback port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with S3Store({"endpoint_url": f"http://127.0.0.1:{port}"}, retry=FAST) as store:
        with pytest.raises(StorageError, match="gave up after 3 attempts") as e:
            await store.read_range("s3://bkt/obj.bin", 0, 10)
    assert "s3://bkt/obj.bin" in str(e.value)
    assert store.counters.retries == 2


async def test_s3_credentials_never_appear_in_errors_or_repr(s3_server):
    secret = "SECRET-" + uuid.uuid4().hex
    options = {"endpoint_url": s3_server.endpoint_url, "key": "AKIA-FAKE", "secret": secret}
    async with S3Store(options, retry=FAST) as store:
        with pytest.raises(StorageError) as e:
            await store.list("s3://no-such-bucket-here/x/")
        assert secret not in str(e.value) and secret not in repr(store)


async def test_s3_bad_options_and_uris_are_config_errors():
    with pytest.raises(ConfigError, match="endpoint"):
        S3Store({"endpoint": "http://127.0.0.1:1"})
    with pytest.raises(ConfigError, match="s3://"):
        await S3Store().list("s3:///key")


# --- local files -------------------------------------------------------------------------------

async def test_local_directory_lists_recursively_with_absolute_paths(local_tree):
    store = LocalStore()
    for root in (str(local_tree / "web"), f"file://{local_tree}/web/"):
        infos = await store.list(root)
        assert [info.uri for info in infos] == sorted(
            str(local_tree / key) for key in TREE if key.startswith("web/"))
        assert [info.size for info in infos] == [10, 3, 20, 30, 40, 5]


async def test_local_relative_path_becomes_absolute(local_tree, monkeypatch):
    monkeypatch.chdir(local_tree)
    infos = await LocalStore().list("web/a.jsonl")
    assert infos == [ObjectInfo(str(local_tree / "web/a.jsonl"), 10)]


async def test_local_missing_path_and_no_match_name_the_uri(local_tree):
    store = LocalStore()
    for uri, message in [(f"{local_tree}/nope", "no such file or directory"),
                         (f"{local_tree}/web/*.parquet", "no files match"),
                         (f"{local_tree}/nope/**/*.jsonl", "no files match")]:
        with pytest.raises(StorageError, match=message) as e:
            await store.list(uri)
        assert e.value.uri == uri and uri in str(e.value)
    (local_tree / "empty").mkdir()
    with pytest.raises(StorageError, match="holds no files"):
        await store.list(str(local_tree / "empty"))


async def test_local_read_range(local_tree):
    path = local_tree / "obj.bin"
    path.write_bytes(DATA)
    store = LocalStore()
    assert await store.read_range(str(path), 100, 300) == DATA[100:300]
    assert await store.read_range(f"file://{path}", 1000, 2000) == DATA[1000:]
    assert await store.read_range(str(path), 2000, 3000) == b""
    assert store.counters.bytes_read == 224 and store.counters.requests == 3


async def test_local_read_range_into_a_buffer(local_tree):
    """With `buffer`, the range is read into `buffer(length)` (the length the file holds) and
    that buffer comes back: the same bytes, a mapping of its own from MAPPED_BYTES on."""
    path = local_tree / "big.bin"
    path.write_bytes(BIG)
    store = LocalStore()
    for start, end in READS_OF_BIG:
        got = await store.read_range(str(path), start, end, buffer=mapped_buffer)
        assert bytes(got) == BIG[start:end]
        assert isinstance(got, mmap.mmap if end - start >= MAPPED_BYTES else bytearray)
    assert store.counters.bytes_read == sum(len(BIG[a:b]) for a, b in READS_OF_BIG)


async def test_local_read_errors_name_the_file(local_tree):
    store = LocalStore()
    missing = str(local_tree / "missing.bin")
    with pytest.raises(StorageError, match="no such file") as e:
        await store.read_range(missing, 0, 1)
    assert e.value.uri == missing
    with pytest.raises(StorageError, match="is a directory"):
        await store.read_range(str(local_tree / "web"), 0, 1)
    assert store.counters.retries == 0


async def test_local_transient_io_error_is_retried(local_tree, monkeypatch):
    import streamload.storage.fs as fs_module

    path = local_tree / "obj.bin"
    path.write_bytes(DATA)
    real, faults = fs_module._pread_all, [OSError(errno.EIO, "I/O error")]

    def flaky(*args):
        if faults:
            raise faults.pop()
        return real(*args)

    monkeypatch.setattr(fs_module, "_pread_all", flaky)
    store = LocalStore(retry=FAST)
    assert await store.read_range(str(path), 0, 8) == DATA[:8]
    assert store.counters.retries == 1


# --- fsspec (memory://) -------------------------------------------------------------------------

async def test_memory_list_and_read(memory_root):
    store = open_store(memory_root + "/web/")
    assert isinstance(store, FsspecStore)
    root = memory_root + "/web/"
    infos = await store.list(root)
    assert _names(root, infos) == ["a.jsonl", "a.jsonl.bak", "b.jsonl", "sub/c.jsonl",
                                   "sub/deep/d.jsonl", "sub/notes.txt"]
    assert [info.size for info in infos] == [10, 3, 20, 30, 40, 5]
    exact = await store.list(memory_root + "/web/b.jsonl")
    assert [info.size for info in exact] == [20]
    assert await store.read_range(exact[0].uri, 5, 25) == b"b" * 15
    assert store.counters.bytes_read == 15


async def test_memory_missing_and_no_match_name_the_uri(memory_root):
    store = open_store(memory_root)
    for uri in (memory_root + "/nope", memory_root + "/web/*.parquet"):
        with pytest.raises(StorageError) as e:
            await store.list(uri)
        assert e.value.uri == uri and uri in str(e.value)
    with pytest.raises(StorageError, match="no such file"):
        await store.read_range(memory_root + "/nope", 0, 1)


async def test_fsspec_transient_error_is_retried(memory_root, monkeypatch):
    store = FsspecStore("memory", retry=FAST)
    real, faults = store.fs.cat_file, [TimeoutError("slow"), OSError(errno.EAGAIN, "again")]

    def flaky(*args, **kwargs):
        if faults:
            raise faults.pop()
        return real(*args, **kwargs)

    monkeypatch.setattr(store.fs, "cat_file", flaky)
    assert await store.read_range(memory_root + "/web/a.jsonl", 0, 4) == b"aaaa"
    assert store.counters.retries == 2


# --- the same selection everywhere ---------------------------------------------------------------

PARITY_PATTERNS = ["web", "web/", "web/a.jsonl", "web/*.jsonl", "web/**/*.jsonl", "web/**",
                   "web/*/*", "*/*.jsonl", "**/*.log", "web/sub/**/d.jsonl", "web/[!a]*"]


async def test_every_store_selects_the_same_shards(tree, local_tree, memory_root):
    s3_store, bucket = tree
    for pattern in PARITY_PATTERNS:
        selections = {}
        for name, root, store in [("s3", f"s3://{bucket}", s3_store),
                                  ("local", str(local_tree), LocalStore()),
                                  ("memory", memory_root, open_store(memory_root))]:
            uri = f"{root}/{pattern}"
            selections[name] = [(relative_name(uri, i.uri), i.size) for i in await store.list(uri)]
        assert selections["s3"], pattern
        assert selections["s3"] == selections["local"] == selections["memory"], pattern


# --- helpers -----------------------------------------------------------------------------------

def test_open_store_picks_by_scheme(storage_options):
    assert isinstance(open_store("s3://bkt/web/", storage_options), S3Store)
    assert isinstance(open_store("/data/web"), LocalStore)
    assert isinstance(open_store("file:///data/web"), LocalStore)
    assert isinstance(open_store("memory://x"), FsspecStore)
    for store in (open_store("s3://bkt/"), open_store("/x"), open_store("memory://x")):
        assert isinstance(store, ObjectStore) and isinstance(store.counters, StoreCounters)
    with pytest.raises(ConfigError, match="storage_options"):
        open_store("/data/web", {"endpoint_url": "x"})


@pytest.mark.parametrize("root, obj, name", [
    ("s3://b/web/", "s3://b/web/sub/part-1.jsonl", "sub/part-1.jsonl"),
    ("s3://b/web", "s3://b/web/sub/part-1.jsonl", "sub/part-1.jsonl"),
    ("s3://b/web/part-1.jsonl", "s3://b/web/part-1.jsonl", "part-1.jsonl"),
    ("s3://b/web/**/*.jsonl", "s3://b/web/x/y.jsonl", "x/y.jsonl"),
    ("s3://b/web/part-*", "s3://b/web/part-7", "part-7"),
    ("s3://b/", "s3://b/k", "k"),
    ("file:///data/web/", "/data/web/a/b", "a/b"),
    ("/data/web/*.jsonl", "/data/web/a.jsonl", "a.jsonl"),
    ("memory://d/", "memory:///d/x", "x"),
])
def test_relative_name(root, obj, name):
    assert relative_name(root, obj) == name


def test_relative_name_rejects_foreign_objects():
    with pytest.raises(ValueError, match="not under"):
        relative_name("s3://b/web/", "s3://other/web/x")


@pytest.mark.parametrize("pattern, path, matches", [
    ("a/*", "a/b", True), ("a/*", "a/b/c", False), ("a/**", "a/b/c", True),
    ("a/**/c", "a/c", True), ("a/**/c", "a/x/y/c", True), ("a/?", "a//", False),
    ("a/[!x]", "a//", False), ("a/[x", "a/[x", True), ("a.b", "aXb", False),
])
def test_glob_dialect(pattern, path, matches):
    assert bool(glob_regex(pattern).fullmatch(path)) is matches


# --- the retry helper ----------------------------------------------------------------------------

def test_backoff_grows_and_is_capped():
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, jitter=False)
    assert [policy.backoff_s(i) for i in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    jittered = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0)
    assert all(0 <= jittered.backoff_s(3) <= 0.8 for _ in range(100))


@pytest.mark.parametrize("bad", [{"max_attempts": 0}, {"initial_backoff_s": -1},
                                 {"request_timeout_s": 0}, {"max_backoff_s": float("nan")}])
def test_bad_retry_policy_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="retry"):
        RetryPolicy(**bad)


async def test_with_retries_lets_final_errors_through_untouched():
    counters, calls = StoreCounters(), []

    async def op():
        calls.append(1)
        raise KeyError("final")

    with pytest.raises(KeyError):
        await with_retries(op, policy=FAST, what="x://y", counters=counters,
                           is_retryable=lambda exc: False)
    assert len(calls) == 1 and counters.retries == 0


async def test_with_retries_times_out_each_attempt():
    counters = StoreCounters()

    async def hang():
        await asyncio.Event().wait()

    policy = RetryPolicy(max_attempts=2, initial_backoff_s=0.0, request_timeout_s=0.05)
    with pytest.raises(StorageError, match=r"x://y: gave up after 2 attempts.*within 0.05 s"):
        await with_retries(hang, policy=policy, what="x://y", counters=counters,
                           is_retryable=lambda exc: False)
    assert counters.retries == 1


@pytest.mark.parametrize("turns", range(6))
async def test_a_cancelled_request_is_never_swallowed_by_its_timeout(turns):
    """Regression: with asyncio.wait_for (Python 3.11), cancelling the caller just as the
    request completed returned the result instead; the fetch then waited for memory that a
    closing loader never frees, and close() hung. Cancel at every turn of the loop around the
    completion: the caller must always see CancelledError."""
    loop = asyncio.get_running_loop()
    response = loop.create_future()

    async def request():
        return await response

    caller = asyncio.ensure_future(with_retries(
        request, policy=RetryPolicy(), what="s3://bucket/key", counters=StoreCounters(),
        is_retryable=lambda exc: False))
    await asyncio.sleep(0)
    response.set_result(b"bytes")
    for _ in range(turns):
        await asyncio.sleep(0)
    if caller.done():   # it finished before the cancel: nothing could be swallowed
        assert caller.result() == b"bytes"
        return
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
