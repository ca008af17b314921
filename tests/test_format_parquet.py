"""Parquet shards: written with pyarrow (`pyarrow.parquet.write_table`, several row groups),
read through the public Loader over local files and the moto S3 server, and every delivered
document compared with what `pyarrow.parquet.read_table` reads. Also: Hugging Face layouts,
exact resume, ranged reads (only the needed column's chunks), bad input, document lengths."""
from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import formatcheck  # noqa: E402
import streamload as sl  # noqa: E402
from corpus import upload_dir  # noqa: E402
from formatcheck import (FileStore, Skips, assert_matches, info, loader, problems,  # noqa: E402
                         read_columns, run, texts)
from resumecheck import full_run, stop_and_resume  # noqa: E402
from streamload.errors import DataError  # noqa: E402
from streamload.formats import RawRecord, format_for  # noqa: E402
from streamload.formats.parquet import ParquetFormat  # noqa: E402
from streamload.tokenizer import PerDocument  # noqa: E402

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- helpers


async def read_shard(fmt, path: Path, *, skips=None, store=None) -> list[RawRecord]:
    """Read one shard as the fetcher does, its planned ranges unchecked."""
    return await formatcheck.read_shard(fmt, path, skips=skips, store=store, order=None)


def write(path: Path, columns: dict, row_group_size: int = 7, **options) -> Path:
    """The reference writer: pyarrow, several row groups."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size, **options)
    return path


def reference_docs(root: Path, source: str, field: str = "text",
                   tokens: bool = False) -> dict[str, np.ndarray]:
    """sample id -> expected tokens, from `pyarrow.parquet.read_table` of every shard."""
    out = {}
    for path in sorted(root.rglob("*.parquet")):
        if path.name.startswith(("_", ".")):
            continue
        for row, value in enumerate(pq.read_table(path).column(field).to_pylist()):
            if value is None:
                continue
            expected = (np.asarray(value, np.int64) if tokens
                        else np.frombuffer(value.encode("utf-8"), np.uint8).astype(np.int64))
            out[f"{source}/{path.relative_to(root).as_posix()}/{row}"] = expected
    return out


# ---------------------------------------------------------------- detection


@pytest.mark.parametrize("uri, expected", [
    ("/d/part-0.parquet", True),
    ("/d/PART-0.PARQUET", True),
    ("s3://b/ds/data/train-00000-of-00002.parquet", True),
    ("s3://b/ds/default/train/0000.parquet", True),
    ("/d/_metadata", False),
    ("/d/_common_metadata", False),
    ("/d/_tmp.parquet", False),                 # pyarrow's discovery skips "_" and "." names
    ("/d/.part-0.parquet", False),
    ("/d/part-0.parquet.crc", False),
    ("/d/.parquet", False),
    ("/d/part-0.jsonl", False),
    ("/d/README.md", False),
])
def test_detection(uri, expected):
    assert ParquetFormat().matches(uri) is expected
    fmt = format_for(uri)
    if expected:
        assert isinstance(fmt, ParquetFormat) and fmt.field == "text" and not fmt.tokens
    else:
        assert not isinstance(fmt, ParquetFormat)
    assert (format_for(uri, format_name="parquet") is not None) is expected


def test_fields():
    assert ParquetFormat("body", None, True).field == "body"
    fmt = ParquetFormat(None, "input_ids", True)
    assert (fmt.field, fmt.tokens) == ("input_ids", True)
    with pytest.raises(ValueError):
        ParquetFormat("", None, False)


# ---------------------------------------------------------------- round trips, format level


@pytest.mark.parametrize("options", [
    {},
    {"compression": "zstd"},
    {"compression": "gzip", "use_dictionary": False},
    {"compression": "none", "data_page_version": "2.0", "data_page_size": 256},
    {"compression": "snappy", "write_statistics": False, "row_group_size": 1},
])
async def test_text_records_match_read_table(tmp_path, options):
    options = dict(options)
    row_group_size = options.pop("row_group_size", 7)
    path = write(tmp_path / "a.parquet", {"id": list(range(50)), "text": texts(50, 1),
                                          "meta": [{"k": i} for i in range(50)]},
                 row_group_size=row_group_size, **options)
    records = await read_shard(ParquetFormat(), path)
    expected = pq.read_table(path).column("text").to_pylist()
    assert records == [RawRecord(i, t) for i, t in enumerate(expected)]
    assert pq.read_metadata(path).num_row_groups == -(-50 // row_group_size)


@pytest.mark.parametrize("type_", [
    pa.list_(pa.int32()), pa.list_(pa.uint16()), pa.list_(pa.int64()),
    pa.large_list(pa.uint32()), pa.list_(pa.int8()),
])
async def test_token_records_match_read_table(tmp_path, type_):
    rng = np.random.default_rng(3)
    high = min(120, np.iinfo(type_.value_type.to_pandas_dtype()).max)
    docs = [rng.integers(0, high, int(rng.integers(0, 40))).tolist() for _ in range(60)]
    path = write(tmp_path / "t.parquet", {"input_ids": pa.array(docs, type_),
                                          "text": [str(i) for i in range(60)]}, row_group_size=9)
    records = await read_shard(ParquetFormat(None, "input_ids", True), path)
    expected = pq.read_table(path).column("input_ids").to_pylist()
    assert [r.index for r in records] == list(range(60))
    assert [r.payload.tolist() for r in records] == expected
    assert all(isinstance(r.payload, np.ndarray) for r in records)


async def test_fixed_size_list_tokens(tmp_path):
    docs = np.arange(40 * 8, dtype=np.int32).reshape(40, 8)
    array = pa.FixedSizeListArray.from_arrays(pa.array(docs.reshape(-1)), 8)
    path = write(tmp_path / "f.parquet", {"ids": array}, row_group_size=6)
    records = await read_shard(ParquetFormat(None, "ids", True), path)
    assert [r.payload.tolist() for r in records] == docs.tolist()


async def test_dictionary_text_column_and_empty_file(tmp_path):
    text = pa.array(["a", "b", "a", "c"] * 5).dictionary_encode()
    path = write(tmp_path / "d.parquet", {"text": text}, row_group_size=3)
    records = await read_shard(ParquetFormat(), path)
    assert [r.payload for r in records] == ["a", "b", "a", "c"] * 5
    empty = write(tmp_path / "e.parquet", {"text": pa.array([], pa.string())})
    assert await read_shard(ParquetFormat(), empty) == []


async def test_ranges_are_the_column_chunks(tmp_path):
    rng = np.random.default_rng(0)
    n = 400
    path = write(tmp_path / "a.parquet", {"blob": [rng.bytes(2000) for _ in range(n)],
                                          "text": texts(n, 2)}, row_group_size=50)
    metadata = pq.read_metadata(path)
    store = FileStore()
    stream = await ParquetFormat().open(store, info(path), problems=problems("a"),
                                        chunk_bytes=1 << 20)
    footer_bytes = store.bytes_read
    assert len(store.reads) == 1 and footer_bytes <= 64 << 10   # the tail, once
    ranges = stream.ranges()
    assert len(ranges) == metadata.num_row_groups == 8
    chunks = [metadata.row_group(k).column(1) for k in range(8)]
    for (start, end), chunk in zip(ranges, chunks):
        first = min(chunk.dictionary_page_offset or chunk.data_page_offset,
                    chunk.data_page_offset)
        assert start == first
        assert chunk.total_compressed_size <= end - start <= chunk.total_compressed_size + 100
    text_bytes = sum(end - start for start, end in ranges)
    assert text_bytes < path.stat().st_size / 10


async def test_footer_longer_than_the_first_read(tmp_path):
    # 3000 row groups of 3 columns: a footer of several hundred KiB, more than the tail probe.
    n = 3000
    path = write(tmp_path / "many.parquet", {"a": list(range(n)), "b": list(range(n)),
                                             "text": [f"t{i}" for i in range(n)]},
                 row_group_size=1)
    footer = int.from_bytes(path.read_bytes()[-8:-4], "little")
    assert footer > 64 << 10
    store = FileStore()
    records = await read_shard(ParquetFormat(), path, store=store)
    assert [r.payload for r in records] == [f"t{i}" for i in range(n)]
    assert len(store.reads) == 2 + n   # the tail, the rest of the footer, one per row group


# ---------------------------------------------------------------- through the Loader


def make_text_source(root: Path, shards: int = 3, rows: int = 40) -> Path:
    for s in range(shards):
        write(root / f"part-{s:05d}.parquet",
              {"id": list(range(rows)), "text": texts(rows, s, tag=f"s{s}/"),
               "score": np.random.default_rng(s).random(rows)}, row_group_size=6)
    return root


def test_loader_text_local(tmp_path):
    root = make_text_source(tmp_path / "web")
    docs, stats = run([sl.Source(str(root))])
    assert_matches(docs, reference_docs(root, "web"))
    assert stats["sources"]["web"]["skipped_records"] == 0


def test_loader_tokens_and_custom_text_field_local(tmp_path):
    rng = np.random.default_rng(5)
    root = tmp_path / "tok"
    for s in range(2):
        docs = [rng.integers(0, 50_000, int(rng.integers(1, 300))).tolist() for _ in range(30)]
        write(root / f"t-{s}.parquet", {"input_ids": pa.array(docs, pa.list_(pa.int32())),
                                        "body": texts(30, s)}, row_group_size=8)
    got, _ = run([sl.Source(str(root), tokens_field="input_ids")])
    assert_matches(got, reference_docs(root, "tok", "input_ids", tokens=True))
    got, _ = run([sl.Source(str(root), format="parquet", text_field="body")])
    assert_matches(got, reference_docs(root, "tok", "body"))


def make_hf_layouts(root: Path) -> None:
    """The two layouts of Hugging Face Parquet exports, plus files that are no shards."""
    data = root / "hub"
    write(data / "data" / "train-00000-of-00002.parquet", {"text": texts(25, 1, "a")})
    write(data / "data" / "train-00001-of-00002.parquet", {"text": texts(20, 2, "b")})
    write(data / "data" / "test-00000-of-00001.parquet", {"text": texts(10, 3, "c")})
    (data / "README.md").write_text("---\nconfigs: ...\n---\n")
    (data / ".gitattributes").write_text("*.parquet filter=lfs\n")
    conv = root / "conv"
    for split, n in (("train", 3), ("validation", 1)):
        for k in range(n):
            write(conv / "default" / split / f"{k:04d}.parquet",
                  {"text": texts(12, 10 * k + len(split), split[0])})
    (conv / "default" / "train" / "_SUCCESS").write_text("")


def test_hugging_face_layouts_local(tmp_path):
    make_hf_layouts(tmp_path)
    hub = tmp_path / "hub"
    docs, _ = run([sl.Source(str(hub))])
    assert_matches(docs, reference_docs(hub, "hub"))
    # one split of the `data/{split}-NNNNN-of-NNNNN` layout: a glob
    docs, _ = run([sl.Source(str(hub / "data" / "train-*.parquet"), name="train")])
    expected = {k.replace("hub/data/", "train/"): v
                for k, v in reference_docs(hub, "hub").items() if "/train-" in k}
    assert_matches(docs, expected)
    # the `{config}/{split}/NNNN` layout: the root, or one split's folder
    conv = tmp_path / "conv"
    docs, _ = run([sl.Source(str(conv))])
    assert_matches(docs, reference_docs(conv, "conv"))
    docs, _ = run([sl.Source(str(conv / "default" / "train"))])
    assert_matches(docs, reference_docs(conv / "default" / "train", "train"))
    assert len(docs) == 36


HUB_SHARDS = ["data/test-00000-of-00001.parquet", "data/train-00000-of-00002.parquet",
              "data/train-00001-of-00002.parquet"]
CONV_SHARDS = ["default/train/0000.parquet", "default/train/0001.parquet",
               "default/train/0002.parquet", "default/validation/0000.parquet"]


async def listed(uri: str, storage_options=None) -> list[str]:
    """The shard names the fetcher lists for a source, in its order (the stable shard ids)."""
    from streamload.formats.catalog import list_shards
    from streamload.storage import open_store

    store = open_store(uri, storage_options)
    try:
        return [s.name for s in await list_shards(sl.Source(uri), store)]
    finally:
        await store.aclose()


async def test_listing_order_is_sorted_paths(tmp_path):
    make_hf_layouts(tmp_path)
    assert await listed(str(tmp_path / "hub")) == HUB_SHARDS
    assert await listed(str(tmp_path / "conv")) == CONV_SHARDS
    assert await listed(str(tmp_path / "conv" / "default" / "train")) == [
        "0000.parquet", "0001.parquet", "0002.parquet"]


def test_loader_over_s3(tmp_path, s3_bucket, storage_options):
    client, bucket = s3_bucket
    make_hf_layouts(tmp_path)
    upload_dir(client, bucket, tmp_path / "hub", "hub")
    docs, stats = run([sl.Source(f"s3://{bucket}/hub/", storage_options=storage_options)])
    assert_matches(docs, reference_docs(tmp_path / "hub", "hub"))
    upload_dir(client, bucket, tmp_path / "conv", "conv")
    assert asyncio.run(listed(f"s3://{bucket}/hub/", storage_options)) == HUB_SHARDS
    assert asyncio.run(listed(f"s3://{bucket}/conv/", storage_options)) == CONV_SHARDS
    docs, _ = run([sl.Source(f"s3://{bucket}/conv/default/train/", name="train",
                             storage_options=storage_options)])
    assert_matches(docs, reference_docs(tmp_path / "conv" / "default" / "train", "train"))
    # token ids over S3 too
    rng = np.random.default_rng(9)
    ids = [rng.integers(0, 1000, int(rng.integers(1, 50))).tolist() for _ in range(40)]
    write(tmp_path / "tok" / "t.parquet", {"ids": pa.array(ids, pa.list_(pa.uint16()))},
          row_group_size=7)
    upload_dir(client, bucket, tmp_path / "tok", "tok")
    docs, _ = run([sl.Source(f"s3://{bucket}/tok/", tokens_field="ids",
                             storage_options=storage_options)])
    assert_matches(docs, reference_docs(tmp_path / "tok", "tok", "ids", tokens=True))


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("stop", [1, 5, 10])
def test_exact_resume(tmp_path, stop):
    root = make_text_source(tmp_path / "web", shards=3, rows=50)

    def make():
        return loader([sl.Source(str(root))], micro_batch_tokens=1024, micro_batches=2,
                      chunk_bytes=4096)

    run = stop_and_resume(make, stop)
    assert len(run.full) > stop + 2
    assert run.head + run.tail == run.full
    ids = [i for step in run.head + run.tail for mb in step for i in mb[0]]
    assert Counter(ids) == Counter(list(reference_docs(root, "web")))   # exactly once


# ---------------------------------------------------------------- ranged reads


def make_big_file(root: Path, rows: int = 2000) -> Path:
    """~5 MB of incompressible blobs beside a small text column, in 40 row groups."""
    rng = np.random.default_rng(1)
    return write(root / "big.parquet", {"blob": [rng.bytes(2500) for _ in range(rows)],
                                        "text": texts(rows, 4)}, row_group_size=50)


async def test_a_few_records_read_a_small_part(tmp_path):
    path = make_big_file(tmp_path / "big")
    size = path.stat().st_size
    store = FileStore()
    lengths, _ = await ParquetFormat().document_lengths(store, info(path),
                                                        problems=problems("big.parquet"),
                                                        limit=10)
    expected = [len(t.encode()) for t in pq.read_table(path).column("text").to_pylist()]
    assert lengths.tolist() == expected[:10]
    # the footer (one or two reads: the blobs' statistics make it long), then the first row
    # group's text chunk alone
    assert len(store.reads) <= 3
    assert store.bytes_read < size / 10, (store.bytes_read, size)
    assert store.reads[-1][2] - store.reads[-1][1] < 4096


def test_loader_reads_only_the_text_column_also_when_resumed(tmp_path):
    root = tmp_path / "big"
    path = make_big_file(root)
    size = path.stat().st_size

    def make():
        return loader([sl.Source(str(root))], micro_batch_tokens=2048, micro_batches=1)

    full = full_run(make)
    fetched = full[1]["sources"]["big"]["bytes_fetched"]
    print(f"file {size} bytes, a full read fetched {fetched}")
    assert 0 < fetched < size / 10, (fetched, size)
    stop = len(full[0]) // 2
    run = stop_and_resume(make, stop, full)
    resumed = run.resumed_stats["sources"]["big"]["bytes_fetched"]
    print(f"resumed after {stop} of {len(run.full)} steps: fetched {resumed}")
    assert run.head + run.tail == run.full
    assert 0 < resumed < size / 10, (resumed, size)


# ---------------------------------------------------------------- bad input


def test_missing_column_names_source_shard_and_columns(tmp_path):
    root = tmp_path / "src"
    write(root / "a.parquet", {"text": ["fine"] * 3})
    write(root / "b.parquet", {"content": ["x"] * 4, "id": [1, 2, 3, 4]})
    with pytest.raises(sl.DataError, match=r"source 'src'.*shard 'b.parquet'.*no column 'text'"
                                           r".*columns are 'content', 'id'"):
        run([sl.Source(str(root))])
    docs, stats = run([sl.Source(str(root))], on_error="skip")
    assert sorted(i for i, _ in docs) == [f"src/a.parquet/{r}" for r in range(3)]
    assert stats["sources"]["src"]["skipped_shards"] == 1
    assert "src/b.parquet: no column 'text'" in stats["sources"]["src"]["skip_reasons"][0]


def test_missing_column_suggests_the_field_and_not_skipping(tmp_path):
    """Every shard lacks the column (a misspelt text_field): on_error="skip" would skip them all,
    so the error names the column the file has instead (issue 21, item 3)."""
    root = tmp_path / "src"
    write(root / "a.parquet", {"content": ["x"] * 4, "id": [1, 2, 3, 4]})
    with pytest.raises(sl.DataError) as caught:
        run([sl.Source(str(root), text_field="contents")])
    message = str(caught.value)
    assert message.endswith("no column 'contents' (text_field); the file's columns are "
                            "'content', 'id'; did you mean text_field='content'?"), message
    assert "on_error" not in message
    write(root / "b.parquet", {"input_ids": [[1, 2], [3]]})
    with pytest.raises(sl.DataError, match=r"shard 'a.parquet': no column 'input_ids' "
                                           r"\(tokens_field\).*; set the source's tokens_field to "
                                           r"the field that holds the token ids$"):
        run([sl.Source(str(root), tokens_field="input_ids")])


def test_null_text_is_a_record_error(tmp_path):
    root = tmp_path / "src"
    write(root / "a.parquet", {"text": ["r0", None, "r2", "r3", None, "r5", "r6", "r7", "r8"]},
          row_group_size=4)
    with pytest.raises(sl.DataError, match=r"source 'src'.*shard 'a.parquet'.*record 1.*null"):
        run([sl.Source(str(root))])
    docs, stats = run([sl.Source(str(root))], on_error="skip")
    assert sorted(i for i, _ in docs) == sorted(f"src/a.parquet/{r}" for r in (0, 2, 3, 5, 6, 7, 8))
    assert stats["sources"]["src"]["skipped_records"] == 2
    assert_matches(docs, reference_docs(root, "src"))


async def test_bad_token_lists_are_record_errors(tmp_path):
    path = write(tmp_path / "t.parquet",
                 {"ids": pa.array([[1, 2], None, [3, None], [4, -5], [], [6]],
                                  pa.list_(pa.int32()))}, row_group_size=4)
    fmt = ParquetFormat(None, "ids", True)
    with pytest.raises(DataError, match=r"shard 't.parquet', record 1: null value in column 'ids'"):
        await read_shard(fmt, path)
    skips = Skips()
    records = await read_shard(fmt, path, skips=skips)
    assert [(r.index, r.payload.tolist()) for r in records] == [(0, [1, 2]), (4, []), (5, [6])]
    assert [i for i, _ in skips.calls] == [1, 2, 3]
    assert "null token id" in skips.calls[1][1] and "negative token id" in skips.calls[2][1]


def payloads(records: list[RawRecord]) -> list:
    return [(r.index, r.payload if isinstance(r.payload, str) else r.payload.tolist())
            for r in records]


@pytest.mark.parametrize("type_", [pa.list_(pa.int32()), pa.list_(pa.uint16()),
                                   pa.large_list(pa.int64()), pa.list_(pa.int8())])
async def test_columns_are_the_records(tmp_path, type_):
    """A row group as columns: the same records as `decode`, token ids as one buffer of
    Arrow's values (the row group's, not one array per row), texts as one list."""
    rng = np.random.default_rng(4)
    docs = [rng.integers(0, 120, int(rng.integers(0, 40))).tolist() for _ in range(60)]
    path = write(tmp_path / "t.parquet", {"ids": pa.array(docs, type_),
                                          "text": texts(60, 2)}, row_group_size=9)
    for fmt in (ParquetFormat(None, "ids", True), ParquetFormat()):
        assert payloads(await read_columns(fmt, path)) == payloads(await read_shard(fmt, path))
    store, shard = FileStore(), info(path)
    stream = await ParquetFormat(None, "ids", True).open(store, shard, problems=problems("t"),
                                                         chunk_bytes=1 << 20)
    (start, end), *_ = stream.ranges()
    records = stream.decode_columns(await store.read_range(shard.uri, start, end))
    assert records.tokens.dtype == type_.value_type.to_pandas_dtype()
    assert records.offsets.tolist() == np.cumsum([0] + [len(d) for d in docs[:9]]).tolist()


async def test_bad_rows_as_columns(tmp_path):
    """Null texts, null lists, null and negative ids, as columns: the same records kept and
    the same skips as `decode`, and the same first error."""
    ids = pa.array([[1, 2], None, [3, None], [4, -5], [], [6]], pa.list_(pa.int32()))
    path = write(tmp_path / "t.parquet", {"ids": ids, "text": ["a", None, "c", "d", None, "f"]},
                 row_group_size=4)
    for fmt in (ParquetFormat(None, "ids", True), ParquetFormat()):
        with pytest.raises(DataError, match=r"shard 't.parquet', record 1: null value"):
            await read_columns(fmt, path)
        skips, column_skips = Skips(), Skips()
        assert payloads(await read_columns(fmt, path, skips=column_skips)) == \
            payloads(await read_shard(fmt, path, skips=skips))
        assert column_skips.calls == skips.calls and len(skips.calls) >= 2


@pytest.mark.parametrize("columns, fmt, message", [
    ({"text": [1, 2, 3]}, ParquetFormat(), r"column 'text' \(text_field\) must hold strings"),
    ({"text": pa.array([[1], [2]], pa.list_(pa.int64()))}, ParquetFormat(),
     "a column of token ids is read with tokens_field"),
    ({"ids": ["a", "b"]}, ParquetFormat(None, "ids", True),
     r"column 'ids' \(tokens_field\) must be a list of integers"),
    ({"ids": pa.array([[1.5]], pa.list_(pa.float32()))}, ParquetFormat(None, "ids", True),
     "must be a list of integers"),
])
async def test_wrong_column_type_is_a_shard_error(tmp_path, columns, fmt, message):
    path = write(tmp_path / "w.parquet", columns)
    with pytest.raises(DataError, match=rf"source 'src', shard 'w.parquet': .*{message}"):
        await read_shard(fmt, path)
    skips = Skips()
    assert await read_shard(fmt, path, skips=skips) == []
    assert skips.calls[0][0] is None and len(skips.calls) == 1


async def test_duplicate_column_is_a_shard_error(tmp_path):
    path = tmp_path / "dup.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])],
                                        names=["text", "text"]), path)
    with pytest.raises(DataError, match=r"shard 'dup.parquet': column 'text' .*more than once"):
        await read_shard(ParquetFormat(), path)


async def test_not_parquet_or_truncated_or_corrupt(tmp_path):
    good = write(tmp_path / "good.parquet", {"text": texts(30, 1)}, row_group_size=10)
    data = good.read_bytes()
    cases = {
        "tiny.parquet": (b"PAR1", "too small"),
        "json.parquet": (b'{"text": "not parquet at all"}\n', "no PAR1 magic"),
        "cut.parquet": (data[:-100], "no PAR1 magic"),
        "footer.parquet": (data[:-8] + (len(data) * 2).to_bytes(4, "little") + b"PAR1",
                           "does not fit"),
        "garbled.parquet": (data[:-40] + b"\x07" * 32 + data[-8:], "unreadable Parquet footer"),
        "enc.parquet": (data[:-4] + b"PARE", "encrypted footer"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(DataError, match=rf"shard '{name}': .*{message}"):
            await read_shard(ParquetFormat(), path)
        skips = Skips()
        assert await read_shard(ParquetFormat(), path, skips=skips) == []
        assert len(skips.calls) == 1 and skips.calls[0][0] is None


async def test_corrupt_row_group_stops_the_shard(tmp_path):
    path = write(tmp_path / "c.parquet", {"text": texts(30, 1)}, row_group_size=10,
                 compression="zstd")
    metadata = pq.read_metadata(path)
    chunk = metadata.row_group(1).column(0)
    start = min(chunk.dictionary_page_offset or chunk.data_page_offset, chunk.data_page_offset)
    data = bytearray(path.read_bytes())
    data[start:start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard 'c.parquet': row group 1: cannot decode"):
        await read_shard(ParquetFormat(), path)
    skips = Skips()
    records = await read_shard(ParquetFormat(), path, skips=skips)
    assert [r.index for r in records] == list(range(10))     # row group 0, then the shard stops
    assert len(skips.calls) == 1 and skips.calls[0][0] is None


# ---------------------------------------------------------------- document lengths


async def test_document_lengths(tmp_path):
    values = texts(45, 7)
    values[3] = None
    path = write(tmp_path / "a.parquet", {"text": values,
                                          "ids": pa.array([list(range(i % 13)) for i in range(45)],
                                                          pa.list_(pa.int64()))},
                 row_group_size=8)
    fmt, shard = ParquetFormat(), info(path)
    with pytest.raises(DataError, match="record 3: null value"):
        await fmt.document_lengths(FileStore(), shard, problems=problems("a"))
    skips = Skips()
    lengths, _ = await fmt.document_lengths(FileStore(), shard, problems=skips)
    assert lengths.tolist() == [len(t.encode()) for t in values if t is not None]
    assert [i for i, _ in skips.calls] == [3]
    tokenizer = PerDocument(lambda text: [len(w) for w in text.split()])
    lengths, _ = await fmt.document_lengths(FileStore(), shard, problems=Skips("src", "a"),
                                            tokenizer=tokenizer, limit=20)
    assert lengths.tolist() == [len(t.split()) for t in values if t is not None][:20]
    lengths, _ = await ParquetFormat(None, "ids", True).document_lengths(
        FileStore(), shard, problems=problems("a"))
    assert lengths.tolist() == [i % 13 for i in range(45)]


def test_reference_reader_agrees_on_bytes(tmp_path):
    """The loader's footer-only parse (`_read_footer`, from the file's tail) gives the same
    metadata as pyarrow's own read of the file, and where the footer starts."""
    from streamload.formats.parquet import _read_footer
    path = write(tmp_path / "a.parquet", {"text": texts(20, 1)}, row_group_size=6)
    data = path.read_bytes()
    length = int.from_bytes(data[-8:-4], "little")
    metadata, footer_start = asyncio.run(_read_footer(FileStore(), info(path)))
    assert metadata.equals(pq.read_metadata(path))
    assert footer_start == len(data) - 8 - length
