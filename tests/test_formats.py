"""Shard formats: JSONL (plain, gzip, zstd) and pre-tokenized .npy shards, read the way the
fetcher reads them: open, fetch every planned range in order, decode each, finish."""
from __future__ import annotations

import gzip
import json
import mmap
import sys
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zstandard

from formatcheck import FileStore, Skips, info, problems, read_shard
from streamload.errors import ConfigError, DataError
from streamload.formats import (FORMATS, JsonlFormat, RawRecord, TokensFormat, format_for,
                                write_jsonl, write_token_shard)
from streamload import pieces
from streamload.formats.jsonl import JsonlStream
from streamload.formats.tokens import plan_groups
from streamload.pieces import cut_documents
from streamload.pipeline.transform import records_to_block, to_tokens
from streamload.tokenizer import PerDocument

TEXTS = [
    "hello world",
    "",                                   # an empty text is a record, not a skip
    "ünïcödé — 日本語 テキスト 🙂🙂",       # 2-, 3- and 4-byte UTF-8 sequences
    "line with \"quotes\" and \\ backslash and \n escaped newline",
    "x" * 300,
    "last",
]


# ---------------------------------------------------------------- JSONL


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.ndjson.zstd"])
@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
async def test_jsonl_round_trip(tmp_path, name, chunk_bytes):
    path = write_jsonl(tmp_path / name, TEXTS, extra_fields={"id": 5, "meta": {"a": [1, 2]}})
    records = await read_shard(JsonlFormat(), path, chunk_bytes=chunk_bytes)
    assert records == [RawRecord(i, t) for i, t in enumerate(TEXTS)]
    assert all(type(r.payload) is str for r in records)


async def test_jsonl_compression_comes_from_the_name(tmp_path):
    assert gzip.decompress(write_jsonl(tmp_path / "a.jsonl.gz", ["x"]).read_bytes())
    assert zstandard.ZstdDecompressor().decompress(
        write_jsonl(tmp_path / "a.jsonl.zst", ["x"]).read_bytes())
    assert write_jsonl(tmp_path / "a.jsonl", ["x"]).read_bytes() == b'{"text":"x"}\n'
    # an explicit compression wins over the name
    path = write_jsonl(tmp_path / "b.jsonl.gz", ["x"], compression="plain")
    assert path.read_bytes() == b'{"text":"x"}\n'


async def test_jsonl_multibyte_split_across_every_boundary(tmp_path):
    text = "🙂é日" * 5
    path = write_jsonl(tmp_path / "a.jsonl", [text, text])
    for chunk_bytes in range(1, 12):
        assert [r.payload for r in await read_shard(JsonlFormat(), path,
                                                   chunk_bytes=chunk_bytes)] == [text, text]


async def test_jsonl_indices_count_blank_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'\n{"text":"one"}\n   \n\r\n{"text":"four"}\r\n\n{"text":"six"}')  # no final \n
    for chunk_bytes in (3, 1 << 20):
        records = await read_shard(JsonlFormat(), path, chunk_bytes=chunk_bytes)
        assert records == [RawRecord(1, "one"), RawRecord(4, "four"), RawRecord(6, "six")]


async def test_jsonl_byte_order_mark(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text":"a"}\n{"text":"b"}\n')
    for chunk_bytes in (1, 2, 100):
        assert await read_shard(JsonlFormat(), path, chunk_bytes=chunk_bytes) == [
            RawRecord(0, "a"), RawRecord(1, "b")]


async def test_jsonl_custom_text_field(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["a", "b"], text_field="content",
                       extra_fields=[{"text": 1}, {"text": None}])
    assert [r.payload for r in await read_shard(JsonlFormat("content"), path)] == ["a", "b"]
    # a field name that is no Python identifier works too
    path = write_jsonl(tmp_path / "b.jsonl", ["c"], text_field="my field.text")
    assert [r.payload for r in await read_shard(JsonlFormat("my field.text"), path)] == ["c"]


@pytest.mark.parametrize("chunk_bytes", [5, 1 << 20])
async def test_jsonl_zstd_multi_frame(tmp_path, chunk_bytes):
    compressor = zstandard.ZstdCompressor()
    frames = [compressor.compress(b'{"text":"a"}\n{"text":"b'),   # a line spans two frames
              compressor.compress(b'c"}\n'),
              compressor.compress(b""),                              # an empty frame
              compressor.compress(b'{"text":"d"}\n')]
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(b"".join(frames))
    assert await read_shard(JsonlFormat(), path, chunk_bytes=chunk_bytes) == [
        RawRecord(0, "a"), RawRecord(1, "bc"), RawRecord(2, "d")]


async def test_jsonl_gzip_multi_member(tmp_path):
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text":"a"}\n{"te') + gzip.compress(b'xt":"b"}\n'))
    for chunk_bytes in (4, 1 << 20):
        assert await read_shard(JsonlFormat(), path, chunk_bytes=chunk_bytes) == [
            RawRecord(0, "a"), RawRecord(1, "b")]


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.jsonl.gz", "empty.jsonl.zst"])
async def test_jsonl_empty_shards(tmp_path, name):
    assert await read_shard(JsonlFormat(), write_jsonl(tmp_path / name, [])) == []
    (tmp_path / "zero.jsonl.gz").write_bytes(b"")
    assert await read_shard(JsonlFormat(), tmp_path / "zero.jsonl.gz") == []


async def test_jsonl_ranges_cover_the_object(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    size = path.stat().st_size
    stream = await JsonlFormat().open(FileStore(), info(path), problems=problems("a", "s"),
                                      chunk_bytes=100)
    ranges = stream.ranges()
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(end - start == 100 for start, end in ranges[:-1])


BAD_LINES = [  # (line, what the message says)
    (b'{"text": "ok", ', "invalid JSON"),
    (b"not json at all", "invalid JSON"),
    (b'{"other": "x"}', "missing field 'text'"),
    (b'{"text": 42}', "field 'text' is not a string (got int)"),
    (b'{"text": null}', "field 'text' is not a string (got null)"),
    (b'["text"]', "not a JSON object"),
    (b'{"text": "bad \xff\xfe utf8"}', "invalid UTF-8"),
    (b'{"text": "ok"} trailing', "invalid JSON"),
]


JSONL_LINES = [b'{"text": "plain"}', b'{"text": "caf\xc3\xa9 \xe6\x97\xa5"}', b"", b"   ", b"\r",
               b"\t \r", b"\x0c", b'  {"text": "padded"}  ', b'{"text": "crlf"}\r',
               b'{"text": "a"} {"text": "b"}', b'{"text": 1}', b"not json", b'{"other": "x"}',
               b'{"text": "x", "id": 3}', b'{"text": ""}', b'{"te', b'xt": "split"}']


@pytest.mark.parametrize("seed", range(12))
async def test_jsonl_columns_read_what_lines_read(tmp_path, seed):
    """A range's records come from one msgspec call (`decode_lines`) when it can stand for
    the lines; whatever the shard holds (blank and whitespace-only lines, CRLF, two values on
    a line, bad records, a BOM), the records, their line numbers and the skips are the ones
    read line by line."""
    rng = np.random.default_rng(seed)
    weights = np.ones(len(JSONL_LINES))
    weights[:2] = 12 if seed % 2 else 40   # mostly good lines, so whole ranges decode at once
    lines = [JSONL_LINES[k] for k in rng.choice(len(JSONL_LINES), 80, p=weights / weights.sum())]
    raw = (b"\xef\xbb\xbf" if seed % 3 == 0 else b"") + b"\n".join(lines) + \
        (b"\n" if seed % 4 else b"")
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(raw)
    expected, expected_skips = [], []
    decode = msgspec.json.Decoder(dict).decode
    for index, line in enumerate(raw.removeprefix(b"\xef\xbb\xbf").split(b"\n")):
        if not line or line.isspace():
            continue
        try:
            text = decode(line)["text"]
            assert isinstance(text, str)
            expected.append(RawRecord(index, text))
        except (msgspec.MsgspecError, KeyError, AssertionError, TypeError):
            expected_skips.append(index)
    for chunk_bytes in (5, 64, 700, 1 << 20):
        skips = Skips()
        records = await read_shard(JsonlFormat(), path, chunk_bytes=chunk_bytes, skips=skips)
        assert records == expected
        assert [record for record, _ in skips.calls] == expected_skips


@pytest.mark.parametrize("buffer", [bytearray, lambda size: mmap.mmap(-1, size)])
@pytest.mark.parametrize("seed", range(6))
async def test_jsonl_reads_ranges_in_buffers(tmp_path, seed, buffer):
    """The fetcher reads a JSONL shard's ranges into buffers (`takes_buffers`; a bytearray, or
    an mmap, which has neither `count` nor `startswith`): the records, their line numbers and
    the skips are the ones read from bytes, and nothing keeps a buffer once the shard is read."""
    rng = np.random.default_rng(seed)
    lines = [JSONL_LINES[k] for k in rng.choice(len(JSONL_LINES), 80)]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes((b"\xef\xbb\xbf" if seed % 2 else b"") + b"\n".join(lines))
    assert JsonlStream.takes_buffers
    for chunk_bytes in (5, 64, 700, 1 << 20):
        expected_skips = Skips()
        expected = await read_shard(JsonlFormat(), path, chunk_bytes=chunk_bytes,
                                    skips=expected_skips)
        skips, store = Skips(), FileStore()
        stream = await JsonlFormat().open(store, info(path), problems=skips,
                                          chunk_bytes=chunk_bytes)
        records, chunks = [], []
        for start, end in stream.ranges():
            data = await store.read_range(str(path), start, end)
            chunks.append(buffer(len(data)))
            memoryview(chunks[-1])[:] = data
            records += stream.decode(chunks[-1])
        assert records + stream.finish() == expected
        assert skips.calls == expected_skips.calls
        assert all(isinstance(chunk, (bytearray, mmap.mmap)) for chunk in chunks)
        # once the shard is read, only `chunks` holds them (with the comprehension's name and
        # getrefcount's argument): a line that spans ranges holds its chunks until it ends
        assert [sys.getrefcount(chunk) for chunk in chunks] == [3] * len(chunks)


def shard_with_bad_line(tmp_path: Path, bad: bytes, suffix: str = ".jsonl") -> Path:
    raw = b'{"text":"zero"}\n\n' + bad + b'\n{"text":"three"}\n'
    path = tmp_path / f"bad{suffix}"
    if suffix.endswith(".gz"):
        raw = gzip.compress(raw)
    elif suffix.endswith(".zst"):
        raw = zstandard.ZstdCompressor().compress(raw)
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize("bad, message", BAD_LINES)
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
async def test_jsonl_bad_record_raises_naming_source_shard_and_record(tmp_path, bad, message,
                                                                      suffix):
    path = shard_with_bad_line(tmp_path, bad, suffix)
    for chunk_bytes in (7, 1 << 20):
        with pytest.raises(DataError) as caught:
            await read_shard(JsonlFormat(), path, chunk_bytes=chunk_bytes)
        error = caught.value
        assert (error.source, error.shard, error.record) == ("src", path.name, 2)
        assert message in str(error)
        assert "source 'src'" in str(error) and path.name in str(error) and "record 2" in str(error)


@pytest.mark.parametrize("bad, message", BAD_LINES)
async def test_jsonl_bad_record_skipped_and_reported(tmp_path, bad, message):
    path = shard_with_bad_line(tmp_path, bad, ".jsonl.gz")
    for chunk_bytes in (7, 1 << 20):
        skips = Skips()
        records = await read_shard(JsonlFormat(), path, chunk_bytes=chunk_bytes, skips=skips)
        assert records == [RawRecord(0, "zero"), RawRecord(3, "three")]
        assert len(skips.calls) == 1
        assert skips.calls[0][0] == 2 and message in skips.calls[0][1]


def corrupt_gzip(tmp_path: Path) -> Path:
    # (Damage inside the deflate data can first decode to garbage lines; what is always caught
    # is a bad header, here one of a second member, and a bad checksum: see the next helper.)
    data = gzip.compress(b'{"text":"a"}\n' * 50) + b"not a gzip member"
    path = tmp_path / "corrupt.jsonl.gz"
    path.write_bytes(data)
    return path


def bad_crc_gzip(tmp_path: Path) -> Path:
    data = bytearray(gzip.compress(b'{"text":"a"}\n' * 50))
    data[-8] ^= 0xFF                      # the CRC-32 of the trailer
    path = tmp_path / "crc.jsonl.gz"
    path.write_bytes(bytes(data))
    return path


def corrupt_zstd(tmp_path: Path) -> Path:
    data = zstandard.ZstdCompressor().compress(b'{"text":"a"}\n' * 10) + b"garbage after frame"
    path = tmp_path / "corrupt.jsonl.zst"
    path.write_bytes(data)
    return path


def truncated_gzip(tmp_path: Path) -> Path:
    data = gzip.compress(b'{"text":"a"}\n' * 100)
    path = tmp_path / "truncated.jsonl.gz"
    path.write_bytes(data[:-10])
    return path


def truncated_zstd(tmp_path: Path) -> Path:
    data = zstandard.ZstdCompressor().compress(b'{"text":"a"}\n' * 100)
    path = tmp_path / "truncated.jsonl.zst"
    path.write_bytes(data[:-5])
    return path


@pytest.mark.parametrize("make, message", [(corrupt_gzip, "corrupt gzip"),
                                           (bad_crc_gzip, "corrupt gzip"),
                                           (corrupt_zstd, "corrupt zstd"),
                                           (truncated_gzip, "truncated gzip"),
                                           (truncated_zstd, "truncated zstd")])
async def test_jsonl_bad_compression(tmp_path, make, message):
    path = make(tmp_path)
    for chunk_bytes in (64, 1 << 20):
        with pytest.raises(DataError) as caught:
            await read_shard(JsonlFormat(), path, chunk_bytes=chunk_bytes)
        assert caught.value.shard == path.name and caught.value.record is None
        assert message in str(caught.value) and path.name in str(caught.value)

        skips = Skips()
        records = await read_shard(JsonlFormat(), path, chunk_bytes=chunk_bytes, skips=skips)
        assert len(skips.calls) == 1
        assert skips.calls[0][0] is None and message in skips.calls[0][1]
        # what was decoded before the damage is kept, in order, with its line numbers
        assert [r.index for r in records] == list(range(len(records)))
        assert all(r.payload == "a" for r in records)


async def test_jsonl_corrupt_stream_stops_the_shard(tmp_path):
    path = corrupt_gzip(tmp_path)
    store, skips = FileStore(), Skips()
    stream = await JsonlFormat().open(store, info(path), problems=skips, chunk_bytes=64)
    after = []
    for start, end in stream.ranges():
        records = stream.decode(await store.read_range(str(path), start, end))
        if skips.calls:
            after += records
    after += stream.finish()
    assert after == [] and len(skips.calls) == 1


# ---------------------------------------------------------------- tokens


def make_docs(rng: np.random.Generator, high: int, n: int = 40) -> list[np.ndarray]:
    lengths = rng.integers(0, 50, size=n)
    lengths[[3, 4, 17]] = 0           # empty documents, two of them in a row
    lengths[10] = 700                 # one document longer than the small chunk sizes
    return [rng.integers(0, high, size=int(length)) for length in lengths]


@pytest.mark.parametrize("dtype, high, out", [(np.uint16, 2**16, np.int32),
                                              (np.int32, 2**31 - 1, np.int32),
                                              (np.uint32, 2**32, np.int64),
                                              (np.int64, 2**40, np.int64)])
@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1000, 1 << 20])
async def test_tokens_round_trip(tmp_path, dtype, high, out, chunk_bytes):
    docs = make_docs(np.random.default_rng(0), high)
    tokens_path, offsets_path = write_token_shard(tmp_path / "shard-0", docs, dtype=dtype)
    assert tokens_path.name == "shard-0.tokens.npy" and offsets_path.name == "shard-0.offsets.npy"
    records = await read_shard(TokensFormat(), tokens_path, chunk_bytes=chunk_bytes)
    assert [r.index for r in records] == list(range(len(docs)))
    for record, doc in zip(records, docs):
        assert isinstance(record.payload, np.ndarray) and record.payload.dtype == out
        np.testing.assert_array_equal(record.payload, doc)
    assert records[3].payload.size == 0 and records[4].payload.size == 0


@pytest.mark.parametrize("dtype, column", [(np.uint16, np.uint16), (np.int32, np.int32),
                                           (np.uint32, np.int64)])
async def test_tokens_columns_are_views_of_the_range(tmp_path, dtype, column):
    """`decode_columns` gives a range's documents as offsets over one buffer: for uint16 and
    int32 shards the bytes read themselves (no copy), and the transform keeps them so (one
    buffer per range, packing widens); `decode` hands out the same ids as int32 / int64."""
    from streamload.formats.base import decode_columns
    from streamload.storage.fs import LocalStore
    docs = make_docs(np.random.default_rng(1), 2 ** 16)
    tokens_path, _ = write_token_shard(tmp_path / "shard-0", docs, dtype=dtype)
    store = LocalStore()
    stream = await TokensFormat().open(store, info(tokens_path), problems=problems("s"),
                                       chunk_bytes=1 << 20)
    (start, end), = stream.ranges()
    chunk = await store.read_range(str(tokens_path), start, end)
    records = decode_columns(stream, chunk)
    assert records.tokens.dtype == column and records.index.tolist() == list(range(len(docs)))
    assert np.shares_memory(records.tokens, np.frombuffer(chunk, np.uint8)) == (column == dtype)
    for k, doc in enumerate(docs):
        np.testing.assert_array_equal(
            records.tokens[records.offsets[k]:records.offsets[k + 1]], doc)
    block, counts = records_to_block(records, 0, 1 << 20, "split")
    assert block.tokens is records.tokens or column != dtype
    assert counts.tokens == sum(d.size for d in docs)


async def test_tokens_ranges_hold_whole_documents(tmp_path):
    docs = make_docs(np.random.default_rng(1), 1000, n=200)
    tokens_path, _ = write_token_shard(tmp_path / "s", docs, dtype=np.uint16)
    stream = await TokensFormat().open(FileStore(), info(tokens_path), problems=problems("s", "s"),
                                       chunk_bytes=200)
    ranges = stream.ranges()
    header = ranges[0][0]
    boundaries = {header + 2 * int(o) for o in np.cumsum([0] + [d.size for d in docs])}
    assert all(start in boundaries and end in boundaries for start, end in ranges)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert ranges[-1][1] == tokens_path.stat().st_size
    long_ranges = [r for r in ranges if r[1] - r[0] > 200]
    assert long_ranges == [r for r in ranges if r[1] - r[0] == 1400]    # only the 700-token doc


def test_plan_groups():
    offsets = np.array([0, 0, 5, 5, 20, 22, 22, 22], dtype=np.int64)   # docs: 0,5,0,15,2,0,0
    assert plan_groups(offsets, 10) == [(0, 3), (3, 4), (4, 7)]
    assert plan_groups(offsets, 100) == [(0, 7)]
    assert plan_groups(offsets, 1) == [(0, 3), (3, 4), (4, 7)]
    assert plan_groups(np.array([0, 3, 6, 9]), 6) == [(0, 2), (2, 3)]


async def test_tokens_shard_of_only_empty_documents(tmp_path):
    tokens_path, _ = write_token_shard(tmp_path / "e", [np.array([], dtype=np.int64)] * 3)
    records = await read_shard(TokensFormat(), tokens_path, chunk_bytes=8)
    assert [(r.index, r.payload.size) for r in records] == [(0, 0), (1, 0), (2, 0)]
    tokens_path, _ = write_token_shard(tmp_path / "none", [])
    assert await read_shard(TokensFormat(), tokens_path) == []


async def test_tokens_large_npy_header(tmp_path):
    """Version-2 headers and headers longer than the first read both work."""
    docs = [np.arange(5), np.arange(3)]
    tokens_path, offsets_path = write_token_shard(tmp_path / "h", docs, dtype=np.int32)
    for path, array in ((tokens_path, np.concatenate(docs).astype("<i4")),
                        (offsets_path, np.array([0, 5, 8], dtype="<i8"))):
        header = {"descr": array.dtype.str, "fortran_order": False, "shape": array.shape}
        text = repr(header).encode("latin-1")
        text += b" " * (5000 - len(text)) + b"\n"
        path.write_bytes(b"\x93NUMPY\x02\x00" + len(text).to_bytes(4, "little") + text
                         + array.tobytes())
    records = await read_shard(TokensFormat(), tokens_path, chunk_bytes=16)
    assert [r.payload.tolist() for r in records] == [list(range(5)), list(range(3))]


async def expect_shard_error(tokens_path: Path, message: str) -> None:
    with pytest.raises(DataError) as caught:
        await read_shard(TokensFormat(), tokens_path)
    assert caught.value.shard == tokens_path.name and caught.value.record is None
    assert message in str(caught.value), str(caught.value)
    skips = Skips()
    assert await read_shard(TokensFormat(), tokens_path, skips=skips) == []
    assert len(skips.calls) == 1 and skips.calls[0][0] is None and message in skips.calls[0][1]


async def test_tokens_wrong_dtype(tmp_path):
    tokens_path, _ = write_token_shard(tmp_path / "f", [np.arange(4)], dtype=np.uint16)
    np.save(tokens_path, np.arange(4, dtype=np.float32))
    await expect_shard_error(tokens_path, "token dtype '<f4' is not supported")
    np.save(tokens_path, np.arange(4, dtype=">i4"))
    await expect_shard_error(tokens_path, "token dtype '>i4' is not supported")
    np.save(tokens_path, np.arange(4, dtype=np.uint16).reshape(2, 2))
    await expect_shard_error(tokens_path, "1-D array")


@pytest.mark.parametrize("offsets, message", [
    (np.array([0, 3, 2, 4]), "decreases at document 1"),
    (np.array([1, 2, 4]), "must start at 0"),
    (np.array([0, 2, 3]), "end at the token count 4"),
    (np.array([0, 2, 4], dtype=np.int32), "must hold little-endian int64"),
    (np.array([], dtype=np.int64), "is empty"),
])
async def test_tokens_bad_offsets(tmp_path, offsets, message):
    tokens_path, offsets_path = write_token_shard(tmp_path / "o", [np.arange(2), np.arange(2)])
    np.save(offsets_path, offsets)
    await expect_shard_error(tokens_path, message)
    await expect_shard_error(tokens_path, "offsets file 'o.offsets.npy'")


async def test_tokens_missing_offsets_says_what_belongs_beside_it(tmp_path):
    tokens_path, offsets_path = write_token_shard(tmp_path / "m", [np.arange(3)])
    offsets_path.unlink()
    await expect_shard_error(tokens_path, "offsets file 'm.offsets.npy' is missing: a token "
                                          "shard is <stem>.tokens.npy with <stem>.offsets.npy")


async def test_tokens_truncated_or_not_npy(tmp_path):
    tokens_path, _ = write_token_shard(tmp_path / "t", [np.arange(100)])
    tokens_path.write_bytes(tokens_path.read_bytes()[:-10])
    await expect_shard_error(tokens_path, "truncated or corrupt")
    tokens_path.write_bytes(b"definitely not numpy")
    await expect_shard_error(tokens_path, "not a .npy file")


async def test_tokens_negative_ids(tmp_path):
    tokens_path, _ = write_token_shard(tmp_path / "n", [np.arange(3), np.arange(3), np.arange(2)],
                                       dtype=np.int32)
    np.save(tokens_path, np.array([0, 1, 2, 0, -1, 2, 5, 6], dtype=np.int32))
    with pytest.raises(DataError, match="record 1: negative token id"):
        await read_shard(TokensFormat(), tokens_path)
    skips = Skips()
    records = await read_shard(TokensFormat(), tokens_path, skips=skips)
    assert [r.index for r in records] == [0, 2] and skips.calls == [(1, "negative token id")]


async def test_tokens_reads_are_few_and_small(tmp_path):
    tokens_path, offsets_path = write_token_shard(tmp_path / "r", [np.arange(10)] * 10)
    store = FileStore()
    stream = await TokensFormat().open(store, info(tokens_path), problems=problems("r", "s"),
                                       chunk_bytes=1 << 20)
    assert len(store.reads) <= 4                         # token header + offsets header/data
    assert all(end - start <= 1024 for _, start, end in store.reads)
    assert stream.ranges() == [(128, 128 + 200)]


def test_write_token_shard_checks_values(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        write_token_shard(tmp_path / "x", [np.array([70000])], dtype=np.uint16)
    with pytest.raises(ValueError, match="dtype"):
        write_token_shard(tmp_path / "x", [np.array([1])], dtype=np.float32)


# ---------------------------------------------------------------- format_for


@pytest.mark.parametrize("uri, expected", [
    ("s3://b/web/part-0.jsonl", "jsonl"),
    ("s3://b/web/part-0.jsonl.gz", "jsonl"),
    ("/data/a.JSONL.ZST", "jsonl"),
    ("/data/a.jsonl.zstd", "jsonl"),
    ("/data/a.ndjson", "jsonl"),
    ("/data/a.ndjson.gz", "jsonl"),
    ("/data/a.tokens.npy", "tokens"),
    ("/data/a.offsets.npy", None),          # a companion, not a shard
    ("/data/a.json.gz", None),              # ambiguous unless the format is named
    ("/data/a.npy", None),
    ("/data/_SUCCESS", None),
    ("/data/jsonl/readme.txt", None),
])
def test_format_for_detects_by_name(uri, expected):
    fmt = format_for(uri)
    assert (fmt.name if fmt else None) == expected


def test_format_for_named():
    assert format_for("/d/c4-train.00000-of-01024.json.gz", format_name="jsonl").name == "jsonl"
    assert format_for("/d/a.json", format_name="jsonl").name == "jsonl"
    assert format_for("/d/a.tokens.npy", format_name="jsonl") is None
    assert format_for("/d/a.jsonl", format_name="tokens") is None
    assert format_for("/d/a.offsets.npy", format_name="tokens") is None
    assert format_for("/d/a.jsonl", text_field="body").text_field == "body"
    assert set(FORMATS) == {"jsonl", "tokens", "parquet", "megatron", "mds", "litdata",
                            "webdataset"}
    with pytest.raises(ConfigError, match="unknown format 'arrow'"):
        format_for("/d/a.arrow", format_name="arrow")


async def test_named_jsonl_reads_json_gz(tmp_path):
    path = tmp_path / "c4.json.gz"
    path.write_bytes(gzip.compress(b"".join(json.dumps({"text": t}).encode() + b"\n"
                                            for t in TEXTS)))
    records = await read_shard(format_for(str(path), format_name="jsonl"), path, chunk_bytes=9)
    assert [r.payload for r in records] == TEXTS


def test_zlib_is_what_gzip_uses():
    # the gzip decoder accepts what the standard library's gzip writes (wbits=31)
    obj = zlib.decompressobj(wbits=31)
    assert obj.decompress(gzip.compress(b"x")) == b"x" and obj.eof


# ---------------------------------------------------------------- with the real local store


async def test_reading_a_directory_through_the_local_store(tmp_path):
    from streamload.storage import open_store

    write_jsonl(tmp_path / "text" / "a.jsonl.zst", TEXTS)
    write_jsonl(tmp_path / "text" / "b.jsonl.gz", ["b0", "b1"])
    docs = make_docs(np.random.default_rng(2), 2**16)
    write_token_shard(tmp_path / "text" / "c", docs)
    (tmp_path / "text" / "_SUCCESS").write_bytes(b"")

    store = open_store(str(tmp_path))
    try:
        read = {}
        for shard in await store.list(str(tmp_path / "text")):
            fmt = format_for(shard.uri)
            if fmt is None:
                continue
            stream = await fmt.open(store, shard, problems=problems(Path(shard.uri).name, "text"),
                                    chunk_bytes=100)
            records = []
            for start, end in stream.ranges():
                records += stream.decode(await store.read_range(shard.uri, start, end))
            read[Path(shard.uri).name] = records + stream.finish()
    finally:
        await store.aclose()
    assert sorted(read) == ["a.jsonl.zst", "b.jsonl.gz", "c.tokens.npy"]
    assert [r.payload for r in read["a.jsonl.zst"]] == TEXTS
    assert [r.payload for r in read["b.jsonl.gz"]] == ["b0", "b1"]
    assert [r.payload.tolist() for r in read["c.tokens.npy"]] == [d.tolist() for d in docs]


# ---------------------------------------------------------------- document_lengths


def words(text: str) -> np.ndarray:
    """A tokenizer: one id per word."""
    return np.array([len(w) for w in text.split()], dtype=np.int64)


async def fetched_lengths(fmt, path: Path, tokenizer=None) -> list[int]:
    """Token counts of the records the fetch path makes of a shard: read as the fetcher
    reads, texts tokenized as `SourceFetcher._tokenize` does (UTF-8 bytes without a
    tokenizer), then `to_tokens` as `records_to_block` applies it."""
    records = await read_shard(fmt, path, chunk_bytes=64)
    if tokenizer is not None:
        texts = [r.payload for r in records if isinstance(r.payload, str)]
        ids = iter(tokenizer.encode_texts(texts))
        records = [RawRecord(r.index, np.asarray(next(ids))) if isinstance(r.payload, str)
                   else r for r in records]
        records = [RawRecord(r.index, r.payload.astype(np.int64))   # as fetch.py does
                   if r.payload.dtype == np.int32 else r for r in records]
    return [int(to_tokens(r.payload).shape[0]) for r in records]


async def test_document_lengths_of_a_token_shard_from_the_index_alone(tmp_path):
    docs = make_docs(np.random.default_rng(7), 2**16, n=300)
    tokens_path, offsets_path = write_token_shard(tmp_path / "s", docs, dtype=np.uint16)
    store = FileStore()
    lengths, _ = await TokensFormat().document_lengths(store, info(tokens_path),
                                                       problems=problems("s"))
    assert lengths.dtype == np.int64
    assert lengths.tolist() == [len(d) for d in docs]
    assert lengths.tolist() == await fetched_lengths(TokensFormat(), tokens_path)
    assert {uri for uri, _, _ in store.reads} == {str(offsets_path)}   # never the token file

    store = FileStore()
    first, _ = await TokensFormat().document_lengths(store, info(tokens_path),
                                                     problems=problems("s"), limit=10)
    assert first.tolist() == lengths[:10].tolist()
    assert max(end for _, _, end in store.reads) < offsets_path.stat().st_size


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.zst"])
@pytest.mark.parametrize("tokenizer", [None, PerDocument(words)])
async def test_document_lengths_of_a_jsonl_shard_as_fetched(tmp_path, name, tokenizer):
    rng = np.random.default_rng(3)
    texts = TEXTS + [" ".join("wörd" for _ in range(int(n))) for n in rng.integers(0, 400, 200)]
    path = write_jsonl(tmp_path / name, texts)
    fmt = JsonlFormat()
    lengths, _ = await fmt.document_lengths(FileStore(), info(path), problems=problems(name),
                                            tokenizer=tokenizer,
                                            chunk_bytes=100)
    assert lengths.dtype == np.int64
    assert lengths.tolist() == await fetched_lengths(fmt, path, tokenizer)
    if tokenizer is None:
        assert lengths.tolist() == [len(t.encode("utf-8")) for t in texts]
    for limit in (0, 1, 7, len(texts), len(texts) + 5):
        cut, _ = await fmt.document_lengths(FileStore(), info(path), problems=problems(name),
                                            tokenizer=tokenizer, limit=limit,
                                            chunk_bytes=100)
        assert cut.tolist() == lengths[:limit].tolist()


async def test_document_lengths_match_what_the_loader_delivers(tmp_path):
    """The whole Loader, one epoch: every delivered document (its pieces summed) has the
    length `document_lengths` gives it, token shard and JSONL shard alike."""
    import streamload as sl

    rng = np.random.default_rng(11)
    docs = [rng.integers(0, 2**16, int(n)) for n in rng.integers(0, 900, 60)]
    write_token_shard(tmp_path / "src" / "t", docs, dtype=np.uint16)
    texts = ["".join(chr(97 + k % 26) for k in range(int(n))) + " ü" * int(n % 7)
             for n in rng.integers(0, 700, 80)]
    write_jsonl(tmp_path / "src" / "j.jsonl.gz", texts)
    with sl.Loader([sl.Source(str(tmp_path / "src"))], micro_batch_tokens=256,
                   micro_batches=2, epochs=1, chunk_bytes=128) as loader:
        delivered: dict[str, int] = {}
        for batch in loader:
            for mb in batch.micro_batches:
                for sid, n in zip(mb.sample_ids, np.diff(mb.cu_seqlens.numpy())):
                    doc = pieces.parse(sid)[0]
                    delivered[doc] = delivered.get(doc, 0) + int(n)
    store = FileStore()
    expected = {}
    for shard in ("t.tokens.npy", "j.jsonl.gz"):
        path = tmp_path / "src" / shard
        lengths, _ = await format_for(str(path)).document_lengths(
               store, info(path), problems=problems(shard))
        expected.update({f"src/{shard}/{d}": int(n) for d, n in enumerate(lengths) if n})
    assert delivered == expected


async def test_document_lengths_skip_and_raise(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": 3}\nnot json\n\n{"text": "boom here"}\n'
                     b'{"text": ""}\n')

    def fragile(text: str) -> list[int]:
        if "boom" in text:
            raise RuntimeError("no")
        return [1] * len(text)

    fmt = JsonlFormat()
    with pytest.raises(DataError, match=r"source 'src', shard 'bad.jsonl', record 1"):
        await fmt.document_lengths(FileStore(), info(path), problems=problems("bad.jsonl"))
    skips = Skips()
    lengths, _ = await fmt.document_lengths(FileStore(), info(path), problems=skips,
                                            tokenizer=PerDocument(fragile))
    assert lengths.tolist() == [2, 0]
    assert [i for i, _ in skips.calls] == [1, 2, 4]      # the tokenizer's failure names record 4
    lengths, _ = await fmt.document_lengths(FileStore(), info(path),
                                            problems=Skips("src", "bad.jsonl"),
                                            tokenizer=PerDocument(fragile), limit=2, chunk_bytes=5)
    assert lengths.tolist() == [2, 0]                    # the limit counts documents, not skips
    clean = write_jsonl(tmp_path / "clean.jsonl", ["ok", "boom", "fine"])
    with pytest.raises(DataError, match=r"shard 'clean.jsonl', record 1: tokenizer failed"):
        await fmt.document_lengths(FileStore(), info(clean), problems=problems("clean.jsonl"),
                                   tokenizer=PerDocument(fragile))

    tokens_path, offsets_path = write_token_shard(tmp_path / "t", [np.arange(5), np.arange(3)])
    np.save(offsets_path, np.array([0, 5, 2], dtype=np.int64))
    with pytest.raises(DataError, match=r"source 'src', shard 't'.*decreases at document 1"):
        await TokensFormat().document_lengths(FileStore(), info(tokens_path),
                                              problems=problems("t"))
    skips = Skips()
    lengths, _ = await TokensFormat().document_lengths(FileStore(), info(tokens_path),
                                                       problems=skips)
    assert lengths.size == 0 and skips.calls[0][0] is None


# ---------------------------------------------------------------- cut_documents


@pytest.mark.parametrize("mode", ["split", "truncate", "drop"])
def test_cut_documents_matches_records_to_block(mode):
    """Lengths from 10 to 100k tokens, C=4096: the items records_to_block makes (lengths,
    chunk ids, tokens, counts) are the ones cut_documents describes."""
    C = 4096
    rng = np.random.default_rng(4)
    lengths = np.concatenate([
        np.geomspace(10, 100_000, 120).astype(np.int64), rng.integers(10, 100_001, 120),
        [0, 10, C - 1, C, C + 1, 2 * C, 2 * C + 1, 100_000, 0]])
    rng.shuffle(lengths)
    records = [RawRecord(3 * i + 1, np.arange(n, dtype=np.int32)) for i, n in enumerate(lengths)]
    block, counts = records_to_block(records, 5, C, mode)
    cuts = cut_documents(lengths, C, mode)
    assert block.length.tolist() == cuts.lengths.tolist()
    assert block.chunk.tolist() == cuts.chunks().tolist()
    assert block.record.tolist() == [records[d].index for d in cuts.document.tolist()]
    for k, start in enumerate(cuts.start.tolist()):
        assert block.item_tokens(k)[0] == start   # the document's tokens from `start`
    assert (block.chunk >= 0).tolist() == cuts.divisible.tolist()
    assert (counts.empty, counts.truncated, counts.dropped) == \
        (cuts.empty, cuts.truncated, cuts.dropped) == (2, *(
            [int((lengths > C).sum()), 0] if mode == "truncate" else
            [0, int((lengths > C).sum())] if mode == "drop" else [0, 0]))
    assert cuts.split == (int((lengths > C).sum()) if mode == "split" else 0)
    if mode == "split":
        assert all(pieces.split(c) == (s // C, 0) for c, s in
                   zip(cuts.chunks().tolist(), cuts.start.tolist()) if c >= 0)
        assert int(cuts.lengths.sum()) == int(lengths.sum())


def test_cut_documents_edges():
    cuts = cut_documents([], 8, "split")
    assert cuts.lengths.size == cuts.document.size == 0 and cuts.lengths.dtype == np.int64
    cuts = cut_documents([3, 0, 8, 9, 17], 8, "split")
    assert cuts.lengths.tolist() == [3, 8, 8, 1, 8, 8, 1]
    assert cuts.document.tolist() == [0, 2, 3, 3, 4, 4, 4]
    assert cuts.start.tolist() == [0, 0, 0, 8, 0, 8, 16]
    assert cuts.divisible.tolist() == [False, False, True, True, True, True, True]
    assert cuts.chunks().tolist() == [-1, -1, pieces.piece(0), pieces.piece(1),
                                      pieces.piece(0), pieces.piece(1), pieces.piece(2)]
    assert cuts.counts() == {"empty": 1, "split": 2, "truncated": 0, "dropped": 0}
    assert cut_documents([3, 0, 8, 9, 17], 8, "truncate").lengths.tolist() == [3, 8, 8, 8]
    assert cut_documents([3, 0, 8, 9, 17], 8, "drop").lengths.tolist() == [3, 8]
    with pytest.raises(ValueError, match="long_documents"):
        cut_documents([1], 8, "squash")
    with pytest.raises(ValueError, match=">= 0"):
        cut_documents([-1], 8, "split")
