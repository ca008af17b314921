"""Bad data through the whole Loader: on_error="raise" names the source, shard and record;
on_error="skip" counts what it skipped and delivers everything else exactly once; nothing hangs.

Every case puts the bad shard next to good shards of the same source and next to a second,
clean source, so the mixture, the end of the epoch and the other sources are exercised too.
"""
from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
import zstandard

import streamload as sl
from corpus import base_ids, write_jsonl_source, write_token_source
from distributed import run_ranks
from streamload.formats import write_jsonl, write_token_shard

pytestmark = pytest.mark.timeout(60)

TEXTS = [f"document number {i} " * 3 for i in range(300)]


def run(root: Path, **options):
    """One epoch over root/web (where the bad data is) and root/clean: (ids, stats)."""
    options.setdefault("micro_batch_tokens", 256)
    options.setdefault("micro_batches", 2)
    options.setdefault("chunk_bytes", 128)   # many ranges per shard: errors arrive mid-stream
    with sl.Loader([sl.Source(str(root / "web"), weight=0.6),
                    sl.Source(str(root / "clean"), weight=0.4)], epochs=1, **options) as loader:
        ids = [i for batch in loader for mb in batch.micro_batches for i in mb.sample_ids]
        return ids, loader.stats()


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path


@pytest.fixture
def good(root) -> set[str]:
    """Two good shards in root/web and a clean second source; returns their sample ids."""
    ids = write_jsonl_source(root, "web", shards=2, per_shard=25, compression="gz", seed=1)
    ids |= write_jsonl_source(root, "clean", shards=2, per_shard=25, compression="zst", seed=2)
    return ids


def assert_once(ids: list[str]) -> None:
    assert len(ids) == len(set(ids)), "a sample was delivered twice"


def jsonl_bytes(texts) -> bytes:
    return b"".join(b'{"text": "%s"}\n' % t.encode() for t in texts)


def records_of(ids: list[str], shard: str) -> list[int]:
    return sorted(int(i.rsplit("/", 1)[1]) for i in base_ids(ids) if i.startswith(f"web/{shard}/"))


# --- corrupt compressed streams -----------------------------------------------------------------

def corrupt(data: bytes, at: float) -> bytes:
    """Overwrite 8 bytes a fraction `at` into the stream."""
    out = bytearray(data)
    i = int(len(out) * at)
    out[i:i + 8] = b"\xa5" * 8
    return bytes(out)


COMPRESSED = {
    # name: (file name, corrupt bytes, what the error says). The corruption points are fixed, so
    # each case is deterministic: deflate finds a bad back-reference a third of the way in, and
    # zstd finds a corrupt block halfway.
    "gzip": ("part-bad.jsonl.gz", corrupt(gzip.compress(jsonl_bytes(TEXTS), mtime=0), 0.3),
             "corrupt gzip data"),
    "zstd": ("part-bad.jsonl.zst",
             corrupt(zstandard.ZstdCompressor(write_checksum=True).compress(jsonl_bytes(TEXTS)),
                     0.5),
             "corrupt zstd data"),
    "zstd-not-a-frame": ("part-bad.jsonl.zst", b"\x00\x01\x02\x03" + jsonl_bytes(TEXTS[:5]),
                         "corrupt zstd data"),
}


@pytest.mark.parametrize("case", sorted(COMPRESSED))
def test_corrupt_compressed_shard_raises_naming_source_and_shard(root, good, case):
    name, data, reason = COMPRESSED[case]
    (root / "web" / name).write_bytes(data)
    with pytest.raises(sl.DataError, match=rf"source 'web', shard '{name}': {reason}") as caught:
        run(root)
    assert (caught.value.source, caught.value.shard, caught.value.record) == ("web", name, None)


@pytest.mark.parametrize("case", sorted(COMPRESSED))
def test_corrupt_compressed_shard_is_skipped_and_counted(root, good, case):
    name, data, reason = COMPRESSED[case]
    (root / "web" / name).write_bytes(data)
    ids, stats = run(root, on_error="skip")
    assert_once(ids)
    web = stats["sources"]["web"]
    assert web["skipped_shards"] == 1 and web["skipped_records"] == 0, web
    assert len(web["skip_reasons"]) == 1
    assert web["skip_reasons"][0].startswith(f"web/{name}: {reason}: "), web["skip_reasons"]
    # Records decoded before the corruption showed were delivered (a prefix of the shard);
    # the rest of the shard is what the skipped shard stands for.
    bad = records_of(ids, name)
    assert bad == list(range(len(bad)))
    assert len(bad) == {"gzip": 63, "zstd": 0, "zstd-not-a-frame": 0}[case]
    assert set(base_ids(ids)) - {f"web/{name}/{r}" for r in bad} == good


# --- invalid JSON lines and text that is not UTF-8 ------------------------------------------------

BAD_LINES = {
    3: b'{"text": "unterminated',
    7: b'{"text": 42}',
    8: b'["text", "an array"]',
    11: b'{"body": "no text field"}',
    15: b'{"text": "caf\xe9 in latin-1"}',
    16: b'\xff\xfe{"text": "utf-16 mark"}',
    19: b'{"text": "trailing"} junk',
}


def mixed_shard(path: Path) -> set[int]:
    """20 lines, the BAD_LINES among them; returns the good line numbers."""
    lines = [BAD_LINES.get(i, b'{"text": "line %d is fine"}' % i) for i in range(20)]
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return set(range(20)) - set(BAD_LINES)


@pytest.mark.parametrize("name", ["mixed.jsonl", "mixed.jsonl.gz"])
def test_invalid_records_raise_naming_source_shard_and_record(root, good, name):
    mixed_shard(root / "web" / name)
    with pytest.raises(sl.DataError,
                       match=rf"source 'web', shard '{name}', record 3 \(line 4\): invalid JSON"):
        run(root)


@pytest.mark.parametrize("line,reason", [
    (7, "field 'text' is not a string"),
    (8, "line is not a JSON object"),
    (11, "missing field 'text'; fields present: 'body'"),
    (15, "invalid UTF-8"),
    (16, "invalid JSON"),
    (19, "invalid JSON"),
])
def test_each_kind_of_bad_record_names_its_record(root, good, line, reason):
    data = b'{"text": "fine"}\n' * line + BAD_LINES[line] + b'\n{"text": "after"}\n'
    (root / "web" / "one.jsonl").write_bytes(data)
    with pytest.raises(sl.DataError,
                       match=rf"shard 'one.jsonl', record {line} \(line {line + 1}\): {reason}"
                       ) as caught:
        run(root)
    assert caught.value.record == line and caught.value.line == line + 1
    assert str(caught.value).endswith('To skip bad records and count them in stats(), set '
                                      'on_error="skip".')


@pytest.mark.parametrize("name", ["mixed.jsonl", "mixed.jsonl.gz"])
def test_invalid_records_are_skipped_counted_and_the_rest_delivered_once(root, good, name):
    kept = mixed_shard(root / "web" / name)
    ids, stats = run(root, on_error="skip")
    assert_once(ids)
    assert records_of(ids, name) == sorted(kept)
    assert set(base_ids(ids)) == good | {f"web/{name}/{r}" for r in kept}
    web = stats["sources"]["web"]
    assert web["skipped_records"] == len(BAD_LINES) and web["skipped_shards"] == 0
    reasons = web["skip_reasons"]   # the most recent ones (a bounded list)
    assert f"web/{name}/19: invalid JSON" in reasons[-1]
    assert any(r.startswith(f"web/{name}/15: invalid UTF-8") for r in reasons), reasons


def test_a_whole_shard_in_latin1_is_skipped_record_by_record(root, good):
    texts = ["naïve café", "plain ascii", "señor"]
    (root / "web" / "latin1.jsonl").write_bytes(
        b"".join(b'{"text": "%s"}\n' % t.encode("latin-1") for t in texts))
    with pytest.raises(sl.DataError,
                       match=r"shard 'latin1.jsonl', record 0 \(line 1\): invalid UTF-8"):
        run(root)
    ids, stats = run(root, on_error="skip")
    assert records_of(ids, "latin1.jsonl") == [1]
    assert stats["sources"]["web"]["skipped_records"] == 2


# --- empty shards and zero-length documents -------------------------------------------------------

def write_empty_shards(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    # Distinct stems: one shard in two encodings ("a.jsonl", "a.jsonl.gz") is a ConfigError.
    (directory / "empty.jsonl").write_bytes(b"")                       # 0 bytes
    (directory / "empty0.jsonl.gz").write_bytes(b"")                   # 0 bytes, no gzip member
    (directory / "empty1.jsonl.zst").write_bytes(b"")                  # 0 bytes, no zstd frame
    (directory / "empty2.jsonl.gz").write_bytes(gzip.compress(b"", mtime=0))
    (directory / "empty3.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b""))
    (directory / "blank.jsonl").write_bytes(b"\n\n  \n")               # blank lines: no records
    write_token_shard(directory / "empty", [])                         # a token shard, 0 documents


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_empty_shards_deliver_nothing_and_are_no_error(root, good, on_error):
    write_empty_shards(root / "web")
    ids, stats = run(root, on_error=on_error)
    assert_once(ids)
    assert set(base_ids(ids)) == good
    web = stats["sources"]["web"]
    assert web["shards_listed"] == 2 + 7
    assert (web["skipped_shards"], web["skipped_records"], web["empty_documents"]) == (0, 0, 0), web


def test_a_source_with_only_empty_shards_ends_its_epoch(root, good):
    write_empty_shards(root / "nothing")
    with sl.Loader([sl.Source(str(root / "clean")), sl.Source(str(root / "nothing"))],
                   micro_batch_tokens=256, micro_batches=2, epochs=1) as loader:
        ids = [i for batch in loader for mb in batch.micro_batches for i in mb.sample_ids]
        stats = loader.stats()
    assert_once(ids)
    assert {i for i in base_ids(ids)} == {i for i in good if i.startswith("clean/")}
    assert stats["sources"]["nothing"]["records"] == 0
    with sl.Loader([sl.Source(str(root / "nothing"))], micro_batch_tokens=256,
                   epochs=2) as loader:
        assert list(loader) == []


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_zero_length_documents_are_counted_not_errors(root, good, on_error):
    texts = ["first", "", "third", "", "", "sixth"]
    write_jsonl(root / "web" / "gaps.jsonl.zst", texts)
    docs = [np.arange(5), np.array([], dtype=np.int64), np.arange(3), np.array([], dtype=np.int64)]
    write_token_shard(root / "web" / "gaps", docs)
    ids, stats = run(root, on_error=on_error)
    assert_once(ids)
    expected = good | {f"web/gaps.jsonl.zst/{r}" for r in (0, 2, 5)} \
        | {f"web/gaps.tokens.npy/{r}" for r in (0, 2)}
    assert set(base_ids(ids)) == expected
    web = stats["sources"]["web"]
    assert web["empty_documents"] == 3 + 2
    assert (web["skipped_records"], web["skipped_shards"]) == (0, 0)


# --- token shards of the wrong dtype --------------------------------------------------------------

def write_raw_token_shard(stem: Path, tokens: np.ndarray, offsets: np.ndarray) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    np.save(f"{stem}.tokens.npy", tokens, allow_pickle=False)
    np.save(f"{stem}.offsets.npy", offsets, allow_pickle=False)


OFFSETS = np.array([0, 4, 10, 16], dtype=np.int64)
WRONG_DTYPES = {
    "float32": (np.arange(16, dtype=np.float32), OFFSETS, "token dtype '<f4' is not supported"),
    "float64": (np.arange(16, dtype=np.float64), OFFSETS, "token dtype '<f8' is not supported"),
    "big-endian": (np.arange(16, dtype=">u2"), OFFSETS, "token dtype '>u2' is not supported"),
    "int8": (np.arange(16, dtype=np.int8), OFFSETS, "token dtype '|i1' is not supported"),
    "int32-offsets": (np.arange(16, dtype=np.uint16), OFFSETS.astype(np.int32),
                      "offsets file 'wrong.offsets.npy' must hold little-endian int64"),
}


@pytest.mark.parametrize("case", sorted(WRONG_DTYPES))
def test_token_shard_of_wrong_dtype_raises_naming_source_and_shard(root, good, case):
    tokens, offsets, reason = WRONG_DTYPES[case]
    write_token_source(root, "web", shards=1, per_shard=10, seed=4)
    write_raw_token_shard(root / "web" / "wrong", tokens, offsets)
    with pytest.raises(sl.DataError,
                       match=rf"source 'web', shard 'wrong.tokens.npy': {reason}") as caught:
        run(root)
    assert (caught.value.source, caught.value.shard) == ("web", "wrong.tokens.npy")


@pytest.mark.parametrize("case", sorted(WRONG_DTYPES))
def test_token_shard_of_wrong_dtype_is_skipped_and_counted(root, good, case):
    tokens, offsets, reason = WRONG_DTYPES[case]
    expected = good | write_token_source(root, "web", shards=1, per_shard=10, seed=4)
    write_raw_token_shard(root / "web" / "wrong", tokens, offsets)
    ids, stats = run(root, on_error="skip")
    assert_once(ids)
    assert set(base_ids(ids)) == expected
    web = stats["sources"]["web"]
    assert (web["skipped_shards"], web["skipped_records"]) == (1, 0)
    assert web["skip_reasons"][0].startswith(f"web/wrong.tokens.npy: {reason}")


# --- token ids that batches cannot carry ----------------------------------------------------------

WIDE_IDS = {   # a valid shard whose record 1 holds an id an int32 cast would wrap
    "uint32": np.array([1, 2, 3, 4, 5, 2**31 + 5, 7, 8, 9, 10], dtype=np.uint32),
    "int64": np.array([1, 2, 3, 4, 5, 6, 7, 2**40, 9, 10], dtype=np.int64),
}


@pytest.mark.parametrize("case", sorted(WIDE_IDS))
def test_token_ids_past_int32_raise_naming_the_record(root, good, case):
    write_raw_token_shard(root / "web" / "wide", WIDE_IDS[case], np.array([0, 4, 10]))
    bad = int(WIDE_IDS[case].max())
    with pytest.raises(sl.DataError, match=rf"source 'web', shard 'wide.tokens.npy', record 1: "
                                           rf"token id {bad} is outside 0..2\*\*31-1"):
        run(root)


@pytest.mark.parametrize("case", sorted(WIDE_IDS))
def test_token_ids_past_int32_are_skipped_and_counted(root, good, case):
    write_raw_token_shard(root / "web" / "wide", WIDE_IDS[case], np.array([0, 4, 10]))
    ids, stats = run(root, on_error="skip")
    assert_once(ids)
    assert set(base_ids(ids)) == good | {"web/wide.tokens.npy/0"}
    web = stats["sources"]["web"]
    assert (web["skipped_shards"], web["skipped_records"]) == (0, 1)
    reason = f"token id {int(WIDE_IDS[case].max())} is outside 0..2**31-1, the ids batches carry"
    assert web["skip_reasons"] == [f"web/wide.tokens.npy/1: {reason}"]


def test_a_tokenizer_returning_ids_past_int32_is_named(root, good):
    def wide(text):   # a vocabulary past int32 (a cast would wrap the id to 0)
        return [len(text), 2**32]
    with pytest.raises(sl.DataError, match=r"source '(web|clean)', shard '[^']+', record \d+: "
                                           r"token id 4294967296 is outside"):
        run(root, tokenizer=wide)


# --- several ranks ------------------------------------------------------------------------------

def skip_job(rank, world, root):
    with sl.Loader([sl.Source(os.path.join(root, "web"), weight=0.6),
                    sl.Source(os.path.join(root, "clean"), weight=0.4)],
                   micro_batch_tokens=256, micro_batches=2, epochs=1, chunk_bytes=128,
                   on_error="skip") as loader:
        ids = [i for batch in loader for mb in batch.micro_batches for i in mb.sample_ids]
        web = loader.stats()["sources"]["web"]
        return ids, web["skipped_shards"], web["skipped_records"], web["empty_documents"]


def test_skips_on_one_rank_do_not_stall_the_others(root, good):
    """Whichever rank reads the bad shards skips them; every rank finishes the epoch, and the
    good samples are delivered once across ranks."""
    name, data, _ = COMPRESSED["zstd"]
    (root / "web" / name).write_bytes(data)
    kept = mixed_shard(root / "web" / "mixed.jsonl")
    write_jsonl(root / "web" / "gaps.jsonl", ["a", "", "c"])
    results = run_ranks(skip_job, 2, str(root), timeout=60)
    ids = [i for r in results for i in r[0]]
    assert_once(ids)
    assert set(base_ids(ids)) == good | {f"web/mixed.jsonl/{r}" for r in kept} \
        | {"web/gaps.jsonl/0", "web/gaps.jsonl/2"}
    assert sum(r[1] for r in results) == 1
    assert sum(r[2] for r in results) == len(BAD_LINES)
    assert sum(r[3] for r in results) == 1
