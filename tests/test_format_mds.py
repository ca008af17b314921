"""MosaicML MDS shards: written with mosaicml-streaming's `MDSWriter` (raw and compressed, with
sub-directory streams), read through the public Loader over local files and the moto S3 server,
and every delivered document compared with what mosaicml-streaming's `StreamingDataset` reads.
Also: exact resume, ranged reads, the index cache, bad input, document lengths.

mosaicml-streaming is installed without its dependencies (it requires torch, torchvision,
transformers and cloud SDKs): `import streaming` runs the package's `__init__`, which imports
torchvision, so `reference()` loads its writer and reader modules under a bare package object
instead (their own imports: numpy, torch, PIL, zstd, brotli, python-snappy, xxhash, catalogue,
tqdm).
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import shutil
import sys
import types
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import streamload as sl
from corpus import upload_dir
from formatcheck import (FileStore, Skips, assert_matches, info, loader, problems, read_columns,
                         read_shard, run, texts)
from resumecheck import stop_and_resume
from streamload.errors import DataError
from streamload.formats import RawRecord, format_for
from streamload.formats.catalog import catalog
from streamload.formats.mds import MdsFormat
from streamload.formats.mds.layouts import Decoder

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- the reference library


def reference():
    """(MDSWriter, StreamingDataset) of mosaicml-streaming; skips when it is not installed."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("mosaicml-streaming is not installed")
        if importlib.util.find_spec("torchvision") is None:
            package = types.ModuleType("streaming")   # its __init__ would import torchvision
            package.__path__ = list(spec.submodule_search_locations)
            package.__spec__ = spec
            sys.modules["streaming"] = package
    writer = importlib.import_module("streaming.base.format.mds.writer")
    dataset = importlib.import_module("streaming.base.dataset")
    return writer.MDSWriter, dataset.StreamingDataset


def write(out: Path, columns: dict, samples: list[dict], *, compression=None,
          size_limit=2048) -> Path:
    """The reference writer: MDSWriter, several shards (small size_limit)."""
    MDSWriter, _ = reference()
    out.parent.mkdir(parents=True, exist_ok=True)
    with MDSWriter(out=str(out), columns=columns, compression=compression,
                   size_limit=size_limit) as writer:
        for sample in samples:
            writer.write(sample)
    return out


def text_samples(n: int, seed: int, tag: str = "") -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"text": t, "id": i, "emb": rng.random(int(rng.integers(1, 9))).astype(np.float32),
             "blob": rng.bytes(int(rng.integers(0, 50)))}
            for i, t in enumerate(texts(n, seed, tag))]


TEXT_COLUMNS = {"text": "str", "id": "int", "emb": "ndarray:float32", "blob": "bytes"}


def token_samples(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(1, 120))
        out.append({
            "ids": rng.integers(0, 50_000, length).astype(np.int32),     # ndarray:int32
            "fixed": rng.integers(0, 60_000, 16).astype(np.uint16),      # ndarray:uint16:16
            "any": rng.integers(0, 2**31 - 1, length).astype(          # ndarray (dtype per
                [np.int64, np.uint8, np.uint32][i % 3]),                   # sample)
            "wide": rng.integers(0, 300, (1, length)).astype(np.int16),  # 2-D, one row
            "text": f"doc {i}",
        })
    return out


TOKEN_COLUMNS = {"ids": "ndarray:int32", "fixed": "ndarray:uint16:16", "any": "ndarray",
                 "wide": "ndarray:int16", "text": "str"}


def primary_files(directory: Path) -> list[tuple[str, int]]:
    """(file name read, samples) of each shard of a directory's index, in index order: the raw
    file when it exists, else the compressed one."""
    out = []
    for entry in json.loads((directory / "index.json").read_text())["shards"]:
        raw, zipped = entry["raw_data"]["basename"], (entry["zip_data"] or {}).get("basename")
        out.append((raw if (directory / raw).exists() else zipped, entry["samples"]))
    return out


def reference_samples(root: Path, scratch: Path) -> dict[str, dict]:
    """"shard path relative to root/sample index" -> sample, read by StreamingDataset over a
    copy of each directory that has an index.json (it decompresses into its directory)."""
    _, StreamingDataset = reference()
    out = {}
    for index in sorted(root.rglob("index.json")):
        directory = index.parent
        copy = scratch / uuid.uuid4().hex
        shutil.copytree(directory, copy)
        dataset = StreamingDataset(local=str(copy), shuffle=False, batch_size=1)
        files = primary_files(directory)
        assert dataset.num_samples == sum(n for _, n in files)
        at = 0
        for name, n in files:
            rel = (directory / name).relative_to(root).as_posix()
            for k in range(n):
                out[f"{rel}/{k}"] = dataset[at + k]
            at += n
        del dataset
    return out


def expected_docs(root: Path, scratch: Path, source: str, field: str = "text",
                  tokens: bool = False) -> dict[str, np.ndarray]:
    """sample id -> the tokens the loader should deliver, from the reference reader."""
    out = {}
    for key, sample in reference_samples(root, scratch).items():
        value = sample[field]
        out[f"{source}/{key}"] = (np.asarray(value).reshape(-1).astype(np.int64) if tokens else
                                  np.frombuffer(value.encode("utf-8"), np.uint8).astype(np.int64))
    return out


def shards_of(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith("shard."))


# ---------------------------------------------------------------- detection


@pytest.mark.parametrize("uri, expected", [
    ("/d/shard.00000.mds", True),
    ("s3://b/ds/train/shard.00012.mds.zstd", True),
    ("/d/shard.00001.mds.gz", True),
    ("/d/shard.00001.mds.bz2", True),
    ("/d/index.json", False),                    # the companion
    ("/d/shard.00000.mds.tmp", False),
    ("/d/shard.00000.json", False),              # MDS's sibling formats: not these
    ("/d/shard.00000.csv.meta", False),
    ("/d/part.mds", False),
    ("/d/shard..mds", False),
])
def test_detection(uri, expected):
    assert MdsFormat().matches(uri) is expected
    fmt = format_for(uri)
    assert isinstance(fmt, MdsFormat) is expected
    assert (format_for(uri, format_name="mds") is not None) is expected


def test_fields():
    assert (MdsFormat().field, MdsFormat().tokens) == ("text", False)
    assert MdsFormat("body", None, True).field == "body"
    fmt = MdsFormat(None, "input_ids", True)
    assert (fmt.field, fmt.tokens) == ("input_ids", True)
    with pytest.raises(ValueError):
        MdsFormat("", None, False)


# ---------------------------------------------------------------- round trips, format level


@pytest.mark.parametrize("compression", [None, "zstd", "zstd:7", "gz", "bz2"])
async def test_text_records_match_the_reference(tmp_path, compression):
    root = write(tmp_path / "ds", TEXT_COLUMNS, text_samples(60, 1), compression=compression)
    expected = reference_samples(root, tmp_path / "ref")
    shards = shards_of(root)
    assert len(shards) > 3
    assert all(p.name.endswith(".mds") is (compression is None) for p in shards)
    got = {}
    for chunk_bytes in (1, 100, 1 << 20):
        fmt = MdsFormat()   # a fresh index cache each time
        got = {f"{p.name}/{r.index}": r.payload for p in shards
               for r in await read_shard(fmt, p, chunk_bytes=chunk_bytes)}
        assert got == {k: s["text"] for k, s in expected.items()}
    assert all(type(v) is str for v in got.values())


@pytest.mark.parametrize("field", ["ids", "fixed", "any", "wide"])
@pytest.mark.parametrize("compression", [None, "zstd"])
async def test_token_records_match_the_reference(tmp_path, field, compression):
    root = write(tmp_path / "tok", TOKEN_COLUMNS, token_samples(40, 2), compression=compression)
    expected = reference_samples(root, tmp_path / "ref")
    fmt = MdsFormat(None, field, True)
    got = {}
    for p in shards_of(root):
        for r in await read_shard(fmt, p, chunk_bytes=333):
            assert r.payload.ndim == 1 and r.payload.dtype.kind in "iu"
            got[f"{p.name}/{r.index}"] = r.payload
    assert got.keys() == expected.keys()
    for key, sample in expected.items():
        np.testing.assert_array_equal(got[key], np.asarray(sample[field]).reshape(-1), key)


def same_records(columns: list[RawRecord], records: list[RawRecord]) -> None:
    assert [r.index for r in columns] == [r.index for r in records]
    for c, r in zip(columns, records):
        if isinstance(r.payload, str):
            assert c.payload == r.payload
        else:
            np.testing.assert_array_equal(c.payload.astype(np.int64), r.payload.astype(np.int64))


@pytest.mark.parametrize("field", ["ids", "fixed", "any", "wide", "text"])
@pytest.mark.parametrize("compression", [None, "zstd"])
async def test_columns_are_the_records(tmp_path, monkeypatch, field, compression):
    """A range's samples as columns: the same records as `decode`; the ids of a well-formed
    range in one buffer (int32, or a view of uint8 / uint16), read without a RawRecord per
    sample; a range whose samples' dtypes or shapes differ ("any": a dtype per sample,
    "wide": 2-D arrays) is read sample by sample."""
    root = write(tmp_path / "tok", TOKEN_COLUMNS, token_samples(40, 2), compression=compression)
    fmt = MdsFormat(None, field, True) if field != "text" else MdsFormat()
    for p in shards_of(root):
        for chunk_bytes in (333, 1 << 20):
            same_records(await read_columns(fmt, p, chunk_bytes=chunk_bytes),
                         await read_shard(fmt, p, chunk_bytes=chunk_bytes))
    if field in ("ids", "fixed", "text"):
        def per_sample(*args):
            raise AssertionError("read sample by sample")
        monkeypatch.setattr(Decoder, "records", per_sample)
        stream = await fmt.open(FileStore(), info(shards_of(root)[0]),
                                problems=problems(shards_of(root)[0].name), chunk_bytes=1 << 20)
        (start, end), = stream.ranges() if compression is None else [(0, None)]
        data = shards_of(root)[0].read_bytes()[start:end]
        records = stream.decode_columns(data)
        assert len(records) > 0
        if field != "text":
            assert records.tokens.dtype == {"ids": np.int32, "fixed": np.uint16}[field]


@pytest.mark.parametrize("encoding", ["ndarray:uint16", "ndarray"])
async def test_columns_read_each_samples_shape_width(tmp_path, monkeypatch, encoding):
    """MDSWriter stores a 1-D array's length in the fewest bytes that hold it (1, 2 or 4 here):
    a range mixing them is read as columns, ids and lengths as `decode` reads them; so is a
    column whose samples each name their dtype ("ndarray"), all the same one here."""
    rng = np.random.default_rng(5)
    samples = [{"ids": rng.integers(0, 60_000, n).astype(np.uint16)}
               for n in (3, 300, 255, 256, 70_000, 1)]
    root = write(tmp_path / "w", {"ids": encoding}, samples, size_limit=None)
    (path,) = shards_of(root)
    fmt = MdsFormat(None, "ids", True)
    records = await read_shard(fmt, path, chunk_bytes=1 << 20)
    monkeypatch.setattr(Decoder, "records", lambda *args: pytest.fail("read sample by sample"))
    columns = await read_columns(fmt, path, chunk_bytes=1 << 20)
    same_records(columns, records)
    assert [r.payload.size for r in columns] == [s["ids"].size for s in samples]


async def test_bad_columns_are_reported_as_records_are(tmp_path):
    """A range with a bad sample in it, as columns: the same records kept and the same skips
    as `decode` (each bad sample named), and the same first error with on_error="raise"."""
    arrays = [{"ids": np.array([1, 2], np.int32)}, {"ids": np.array([5, -1, 2], np.int32)},
              {"ids": np.array([7], np.int32)}]
    texts_ = [{"text": t} for t in ("alpha", "beta", "gamma")]
    cases = [("ids", arrays, {"ids": "ndarray:int32"}, "record 1: negative token id")]
    for field, samples, columns, message in cases + [("text", texts_, {"text": "str"}, None)]:
        root = write(tmp_path / field, columns, samples, size_limit=None)
        (path,) = shards_of(root)
        if message is None:   # sample 1's text: not UTF-8
            data = bytearray(path.read_bytes())
            at = data.rindex(b"beta")
            data[at:at + 2] = b"\xff\xfe"
            path.write_bytes(bytes(data))
            message = "record 1: invalid UTF-8 in column 'text'"
        fmt = MdsFormat(None, field, True) if field != "text" else MdsFormat()
        with pytest.raises(DataError, match=message):
            await read_columns(fmt, path, chunk_bytes=1 << 20)
        skips, column_skips = Skips(), Skips()
        same_records(await read_columns(fmt, path, chunk_bytes=1 << 20, skips=column_skips),
                     await read_shard(fmt, path, skips=skips))
        assert column_skips.calls == skips.calls and [i for i, _ in skips.calls] == [1]


def test_columns_reject_a_shape_past_the_column_as_records_do():
    """A sample whose 8-byte shape says 2**62 + 1 int32 ids: 4 times that wraps past 2**64 to
    the 4 bytes stored, so the columns' size check must bound the count first; the sample is
    reported and left out, as `records` does (the columns path kept it, 2**62 + 1 ids long)."""
    from streamload.formats.mds.layouts import Layout
    layout = Layout("ids", True, 1, 0, 0, 0, None, "int32", None)
    column = bytes([1 << 2 | 3]) + (2**62 + 1).to_bytes(8, "little") + b"\x07\0\0\0"
    buf = len(column).to_bytes(4, "little") + column
    good = bytes([1 << 2 | 0, 1]) + b"\x05\0\0\0"   # one id, its shape in 1 byte
    buf += len(good).to_bytes(4, "little") + good
    starts, ends = np.array([0, 4 + len(column)]), np.array([4 + len(column), len(buf)])
    by_records, by_columns = Skips(shard_name="s.mds"), Skips(shard_name="s.mds")
    records = Decoder(layout, by_records).records(buf, starts, ends, 0)
    columns = Decoder(layout, by_columns).columns(buf, starts, ends, 0).to_list()
    same_records(columns, records)
    assert [r.index for r in columns] == [1] and columns[0].payload.tolist() == [5]
    assert by_columns.calls == by_records.calls and by_records.calls[0][0] == 0
    assert "corrupt ndarray" in by_records.calls[0][1]


async def test_empty_shard_and_custom_text_field(tmp_path):
    # A first sample larger than size_limit makes MDSWriter flush an empty shard 0 first.
    samples = [{"body": "y" * 200, "n": 1}] + [{"body": f"b{i}", "n": i} for i in range(5)]
    root = write(tmp_path / "ds", {"body": "str", "n": "int"}, samples, size_limit=100)
    first = json.loads((root / "index.json").read_text())["shards"][0]
    assert first["samples"] == 0
    fmt = MdsFormat("body", None, True)
    got = [r.payload for p in shards_of(root) for r in await read_shard(fmt, p)]
    assert got == [s["body"] for s in samples]


# ---------------------------------------------------------------- ranged reads


async def test_raw_shards_are_read_by_range(tmp_path):
    samples = [{"text": t, "pad": "z" * 500} for t in texts(200, 3)]
    root = write(tmp_path / "ds", {"text": "str", "pad": "str"}, samples, size_limit=1 << 20)
    (path,) = shards_of(root)
    size = path.stat().st_size
    header = 4 * (200 + 2)
    store = FileStore()
    stream = await MdsFormat().open(store, info(path), problems=problems(path.name),
                                    chunk_bytes=8192)
    assert store.reads_of(path) == [(0, header)]         # open: the count and offsets only
    ranges = stream.ranges()
    assert len(ranges) > 10
    assert all(b - a <= 8192 for a, b in ranges)
    assert all(a1 == b0 for (_, b0), (a1, _) in zip(ranges, ranges[1:]))
    assert ranges[-1][1] == size and ranges[0][0] > header   # the JSON config is skipped
    # a few documents' lengths read a small part of the shard
    store = FileStore()
    lengths, _ = await MdsFormat().document_lengths(store, info(path),
                                                    problems=problems(path.name), limit=5,
                                                    chunk_bytes=4096)
    assert lengths.tolist() == [len(s["text"].encode()) for s in samples[:5]]
    assert sum(b - a for a, b in store.reads_of(path)) < size / 10


async def test_compressed_shards_are_read_whole(tmp_path):
    root = write(tmp_path / "ds", TEXT_COLUMNS, text_samples(30, 4), compression="zstd")
    path = shards_of(root)[1]
    store = FileStore()
    stream = await MdsFormat().open(store, info(path), problems=problems(path.name), chunk_bytes=10)
    assert store.reads_of(path) == []
    assert stream.ranges() == [(0, path.stat().st_size)]


async def test_the_index_is_read_once_per_directory_by_the_catalog(tmp_path):
    """The source's catalog reads each directory's index when it lists the source, and keeps
    it for the directory's shards. The format, shared by every Loader, keeps nothing: another
    catalog reads it again."""
    root = write(tmp_path / "ds", TEXT_COLUMNS, text_samples(60, 5))
    for _ in range(2):
        store = FileStore()
        found = await catalog(sl.Source(str(root)), store)
        assert len(found.shards) == len(shards_of(root)) > 1
        assert len(store.lists) == 2   # at listing: the source, then the index's directory
        assert len(store.reads_of(root / "index.json")) == 1
        await asyncio.gather(*(read_shard(s.format, Path(s.info.uri), store=store)
                               for s in found.shards))
        assert len(store.lists) == 2   # the source, then the index's directory
        assert len(store.reads_of(root / "index.json")) == 1
    assert set(vars(found.shards[0].format.format)) == {"tokens", "field"}
    # a directory rewritten after the listing (other shard sizes) is noticed, its index read again
    shutil.rmtree(root)
    write(root, {"text": "str"}, [{"text": t.upper() * 2} for t in texts(40, 6)])
    fmt = found.shards[0].format
    got = [r.payload for p in shards_of(root) for r in await read_shard(fmt, p, store=store)]
    assert got == [t.upper() * 2 for t in texts(40, 6)]
    assert len(store.reads_of(root / "index.json")) == 1 + len(shards_of(root))


# ---------------------------------------------------------------- the loader


def make_streams(root: Path) -> Path:
    """MDS streams in sub-directories, each with its index.json: raw, zstd, and a zstd stream
    whose shards StreamingDataset decompressed beside the compressed files (its cache)."""
    write(root / "web", TEXT_COLUMNS, text_samples(50, 10, "w"))
    write(root / "books", TEXT_COLUMNS, text_samples(40, 11, "b"), compression="zstd")
    cache = write(root / "cache", TEXT_COLUMNS, text_samples(30, 12, "c"), compression="zstd",
                  size_limit=1024)
    _, StreamingDataset = reference()
    dataset = StreamingDataset(local=str(cache), shuffle=False, batch_size=1)
    for k in range(0, dataset.num_samples, 3):   # decompresses some of the shards
        dataset[k]
    del dataset
    names = [p.name for p in shards_of(cache)]
    assert any(n.endswith(".mds") for n in names) and any(n.endswith(".zstd") for n in names)
    return root


def test_loader_text_local(tmp_path):
    root = make_streams(tmp_path / "corpus")
    expected = expected_docs(root, tmp_path / "ref", "corpus")
    docs, stats = run([sl.Source(str(root))])
    assert_matches(docs, expected)
    assert stats["sources"]["corpus"]["skipped_records"] == 0
    assert stats["sources"]["corpus"]["skipped_shards"] == 0
    # one stream, named as a format
    docs, _ = run([sl.Source(str(root / "books"), format="mds")])
    assert_matches(docs, expected_docs(root / "books", tmp_path / "ref", "books"))


@pytest.mark.parametrize("field", ["ids", "fixed", "any"])
def test_loader_tokens_local(tmp_path, field):
    root = write(tmp_path / "tok", TOKEN_COLUMNS, token_samples(60, 7), compression="zstd",
                 size_limit=4096)
    docs, _ = run([sl.Source(str(root), tokens_field=field)])
    assert_matches(docs, expected_docs(root, tmp_path / "ref", "tok", field, tokens=True))


def test_loader_over_s3(tmp_path, s3_bucket, storage_options):
    client, bucket = s3_bucket
    root = make_streams(tmp_path / "corpus")
    upload_dir(client, bucket, root, "corpus")
    docs, stats = run([sl.Source(f"s3://{bucket}/corpus/", storage_options=storage_options)])
    assert_matches(docs, expected_docs(root, tmp_path / "ref", "corpus"))
    assert stats["sources"]["corpus"]["skipped_shards"] == 0
    tok = write(tmp_path / "tok", TOKEN_COLUMNS, token_samples(40, 8), size_limit=4096)
    upload_dir(client, bucket, tok, "tok")
    docs, _ = run([sl.Source(f"s3://{bucket}/tok/", tokens_field="ids",
                             storage_options=storage_options)])
    assert_matches(docs, expected_docs(tok, tmp_path / "ref", "tok", "ids", tokens=True))


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("stop", [1, 5, 10])
def test_exact_resume(tmp_path, stop):
    root = make_streams(tmp_path / "corpus")

    def make():
        return loader([sl.Source(str(root))], micro_batch_tokens=1024, micro_batches=1,
                      chunk_bytes=512)

    run = stop_and_resume(make, stop)
    assert len(run.full) > stop + 2
    assert run.head + run.tail == run.full
    ids = [i for step in run.head + run.tail for mb in step for i in mb[0]]
    expected = expected_docs(root, tmp_path / "ref", "corpus")
    assert Counter(ids) == Counter(list(expected))   # exactly once


# ---------------------------------------------------------------- bad input


def test_missing_shard_names_source_index_and_shard(tmp_path):
    root = tmp_path / "src"
    write(root, TEXT_COLUMNS, text_samples(40, 13))
    expected = expected_docs(root, tmp_path / "ref", "src")
    shards = shards_of(root)
    missing = shards[2]
    samples = dict(primary_files(root))[missing.name]
    missing.unlink()
    expected = {k: v for k, v in expected.items() if f"/{missing.name}/" not in k}
    with pytest.raises(sl.DataError) as caught:
        run([sl.Source(str(root))])
    message = str(caught.value)
    assert "source 'src'" in message and f"shard '{missing.name}'" in message
    assert str(root / "index.json") in message and "does not exist" in message
    docs, stats = run([sl.Source(str(root))], on_error="skip")
    assert_matches(docs, expected)   # every present shard's samples
    assert len(expected) == 40 - samples
    assert stats["sources"]["src"]["skipped_shards"] == 1
    (reason,) = stats["sources"]["src"]["skip_reasons"]
    assert missing.name in reason and "index.json" in reason


def test_missing_column_lists_the_columns(tmp_path):
    root = tmp_path / "src"
    write(root / "a", {"text": "str"}, [{"text": "fine"}] * 3)
    write(root / "b", {"content": "str", "id": "int"}, [{"content": "x", "id": 1}] * 4)
    with pytest.raises(sl.DataError, match=r"source 'src'.*shard 'b/shard.00000.mds'.*"
                                           r"no column 'text'.*'content' \(str\), 'id' \(int\)"):
        run([sl.Source(str(root))])
    docs, stats = run([sl.Source(str(root))], on_error="skip")
    assert sorted(i for i, _ in docs) == [f"src/a/shard.00000.mds/{r}" for r in range(3)]
    assert stats["sources"]["src"]["skipped_shards"] == 1
    assert "src/b/shard.00000.mds: no column 'text'" in \
        stats["sources"]["src"]["skip_reasons"][0]


def test_missing_column_suggests_the_field_and_not_skipping(tmp_path):
    root = tmp_path / "src"
    write(root / "b", {"content": "str", "id": "int"}, [{"content": "x", "id": 1}] * 4)
    with pytest.raises(sl.DataError) as caught:
        run([sl.Source(str(root), text_field="contents")])
    message = str(caught.value)
    assert "no column 'contents' (text_field) in the shard; its columns are 'content' (str), " \
           "'id' (int); did you mean text_field='content'?" in message, message
    assert "on_error" not in message


@pytest.mark.parametrize("columns, sample, fmt, message", [
    ({"text": "pkl"}, {"text": "a string"}, MdsFormat(), "pickled .*does not unpickle"),
    ({"ids": "pkl"}, {"ids": [1, 2]}, MdsFormat(None, "ids"), "pickled"),
    ({"text": "ndarray:int32"}, {"text": np.arange(3, dtype=np.int32)}, MdsFormat(),
     "text must be a 'str' column .*tokens_field"),
    ({"ids": "str"}, {"ids": "1 2 3"}, MdsFormat(None, "ids"), "must be an ndarray column"),
    ({"ids": "bytes"}, {"ids": b"\x01\x00"}, MdsFormat(None, "ids"), "must be an ndarray"),
    ({"ids": "ndarray:float32"}, {"ids": np.ones(3, np.float32)}, MdsFormat(None, "ids"),
     "float32 arrays, not integer token ids"),
    ({"ids": "ndarray:int32:2,3"}, {"ids": np.ones((2, 3), np.int32)}, MdsFormat(None, "ids"),
     r"shape \(2, 3\), not one sequence"),
])
async def test_unusable_columns_are_shard_errors(tmp_path, columns, sample, fmt, message):
    root = write(tmp_path / "ds", columns, [sample] * 3)
    (path,) = shards_of(root)
    with pytest.raises(DataError, match="source 'src', shard 'shard.00000.mds': .*" + message):
        await read_shard(fmt, path)
    skips = Skips()
    assert await read_shard(fmt, path, skips=skips) == []
    assert [i for i, _ in skips.calls] == [None]


async def test_bad_arrays_are_record_errors(tmp_path):
    samples = [{"ids": np.array([1, 2], np.int32)}, {"ids": np.array([5, -1, 2], np.int32)},
               {"ids": np.ones(4, np.float32)}, {"ids": np.ones((2, 2), np.uint8)},
               {"ids": np.array([7], np.uint16)}]
    root = write(tmp_path / "ds", {"ids": "ndarray"}, samples, size_limit=None)
    (path,) = shards_of(root)
    fmt = MdsFormat(None, "ids")
    with pytest.raises(DataError, match="shard 'shard.00000.mds', record 1: negative token id"):
        await read_shard(fmt, path)
    skips = Skips()
    records = await read_shard(fmt, path, skips=skips)
    assert [(r.index, r.payload.tolist()) for r in records] == [(0, [1, 2]), (4, [7])]
    assert [i for i, _ in skips.calls] == [1, 2, 3]
    assert "float32 array, not integer token ids" in skips.calls[1][1]
    assert "shape (2, 2)" in skips.calls[2][1]


async def test_corrupt_samples_are_record_errors(tmp_path):
    samples = [{"text": t, "n": i} for i, t in enumerate(["alpha", "beta", "gamma", "delta"])]
    root = write(tmp_path / "ds", {"text": "str", "n": "int"}, samples, size_limit=None)
    (path,) = shards_of(root)
    data = bytearray(path.read_bytes())
    offsets = np.frombuffer(bytes(data[4:4 + 4 * 5]), "<u4")
    data[offsets[1]:offsets[1] + 4] = (999).to_bytes(4, "little")    # sample 1: a bad size
    at = int(offsets[2]) + 4 + 8                                      # sample 2's text
    data[at:at + 2] = b"\xff\xfe"                                      # not UTF-8
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="record 1: corrupt sample: it holds 16 bytes but its "
                                        "column sizes add up to 1011"):
        await read_shard(MdsFormat(), path)
    skips = Skips()
    records = await read_shard(MdsFormat(), path, skips=skips)
    assert [(r.index, r.payload) for r in records] == [(0, "alpha"), (3, "delta")]
    assert [i for i, _ in skips.calls] == [1, 2]
    assert "invalid UTF-8 in column 'text'" in skips.calls[1][1]


async def test_bad_shards_and_indexes(tmp_path):
    root = write(tmp_path / "ds", TEXT_COLUMNS, text_samples(30, 14))
    shards = shards_of(root)

    async def fails(path: Path, message: str) -> None:
        with pytest.raises(DataError, match=f"shard '{path.name}': .*{message}"):
            await read_shard(MdsFormat(), path)
        skips = Skips()
        assert await read_shard(MdsFormat(), path, skips=skips) == []
        assert [i for i, _ in skips.calls] == [None]

    # a truncated raw shard: its size differs from the index's
    path = shards[0]
    path.write_bytes(path.read_bytes()[:-3])
    await fails(path, "holds .* bytes but .*index.json says")
    # a shard the index does not name
    extra = root / "shard.00099.mds"
    shutil.copy(shards[1], extra)
    await fails(extra, "not named in .*index.json")
    # a corrupt offsets table (the size still matching the index)
    path = shards[1]
    data = bytearray(path.read_bytes())
    data[8:12] = data[4:8]
    data[4:8] = (1 << 30).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    await fails(path, "corrupt offsets table")
    # no index.json
    (root / "index.json").rename(root / "index.json.bak")
    await fails(shards[2], "no index.json next to the shard")
    # an index that is not MDS's, or of another version
    (root / "index.json").write_text("[1, 2]")
    await fails(shards[2], "not an MDS index")
    (root / "index.json").write_text('{"version": 3, "shards": []}')
    await fails(shards[2], "version 3")
    (root / "index.json").write_text("{not json")
    await fails(shards[2], "not valid JSON")


async def test_corrupt_compressed_shard(tmp_path):
    root = write(tmp_path / "ds", TEXT_COLUMNS, text_samples(30, 15), compression="zstd")
    path = shards_of(root)[1]
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF   # the frame's magic number
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"shard '{path.name}': corrupt zstd data"):
        await read_shard(MdsFormat(), path)
    skips = Skips()
    assert await read_shard(MdsFormat(), path, skips=skips) == []
    assert [i for i, _ in skips.calls] == [None]


# ---------------------------------------------------------------- document lengths


async def test_document_lengths(tmp_path):
    root = write(tmp_path / "ds", TEXT_COLUMNS, text_samples(50, 16), compression="zstd")
    expected = reference_samples(root, tmp_path / "ref")
    fmt = MdsFormat()
    for path in shards_of(root):
        lengths, method = await fmt.document_lengths(FileStore(), info(path),
                                                     problems=problems(path.name))
        n = sum(1 for k in expected if k.startswith(path.name + "/"))
        assert lengths.tolist() == [len(expected[f"{path.name}/{k}"]["text"].encode())
                                    for k in range(n)]
        assert method == "scan"

    tok = write(tmp_path / "tok", TOKEN_COLUMNS, token_samples(40, 17), size_limit=4096)
    expected = reference_samples(tok, tmp_path / "ref")
    for field in ("ids", "any", "wide", "fixed"):
        fmt = MdsFormat(None, field)
        for path in shards_of(tok):
            store = FileStore()
            lengths, method = await fmt.document_lengths(store, info(path),
                                                         problems=problems(path.name),
                                                         limit=None)
            n = sum(1 for k in expected if k.startswith(path.name + "/"))
            assert lengths.tolist() == [np.size(expected[f"{path.name}/{k}"][field])
                                        for k in range(n)]
            if field == "fixed":   # from the index alone: the shard is not read
                assert method == "index" and store.reads_of(path) == []
            else:
                assert method == "scan" and store.reads_of(path)
        path = shards_of(tok)[0]
        limited, _ = await fmt.document_lengths(FileStore(), info(path),
                                                problems=problems(path.name), limit=2)
        assert limited.size == 2


def test_reference_layout(tmp_path):
    """The on-disk layout this reader assumes, checked on MDSWriter's output directly."""
    samples = text_samples(7, 18)
    root = write(tmp_path / "ds", TEXT_COLUMNS, samples, size_limit=None)
    index = json.loads((root / "index.json").read_text())
    (entry,) = index["shards"]
    assert index["version"] == 2 and entry["format"] == "mds" and entry["samples"] == 7
    assert entry["column_names"] == sorted(TEXT_COLUMNS)
    assert entry["column_sizes"] == [None, None, 8, None]   # blob, emb, id (int64), text
    data = (root / entry["raw_data"]["basename"]).read_bytes()
    assert len(data) == entry["raw_data"]["bytes"]
    assert int.from_bytes(data[:4], "little") == 7
    offsets = np.frombuffer(data, "<u4", 8, 4)
    assert offsets[-1] == len(data)
    config = json.loads(data[4 * 9:offsets[0]])
    assert config["column_encodings"] == entry["column_encodings"]
    for k, sample in enumerate(samples):
        body = data[offsets[k]:offsets[k + 1]]
        sizes = np.frombuffer(body, "<u4", 3)
        assert sizes[0] == len(sample["blob"])
        start = 12 + int(sizes[0]) + int(sizes[1]) + 8
        assert body[start:].decode() == sample["text"] and sizes[2] == len(body) - start


@pytest.mark.parametrize("field", [None, "ids", "fixed"])
async def test_document_lengths_report_a_missing_shard_once(tmp_path, field):
    root = write(tmp_path / "tok", TOKEN_COLUMNS, token_samples(40, 19), size_limit=4096)
    shards = shards_of(root)
    deleted = dict(primary_files(root))[shards[1].name]
    shards[1].unlink()
    fmt = MdsFormat(None, field) if field else MdsFormat()
    with pytest.raises(DataError, match=f"shard '{shards[1].name}': .*index.json names shard "
                                        f"'{shards[1].name}'"):
        await fmt.document_lengths(FileStore(), info(shards[0]),
                                   problems=problems(shards[0].name))
    calls, total = [], 0
    for path in shards[:1] + shards[2:]:   # each shard its own Problems, as the fetcher has it
        skips = Skips("src", path.name)
        total += ((await fmt.document_lengths(FileStore(), info(path),
                                              problems=skips)).lengths).size
        calls += skips.calls
    assert [i for i, _ in calls] == [None]
    assert total == 40 - deleted
