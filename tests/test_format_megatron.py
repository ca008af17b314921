"""Megatron-LM indexed datasets (`<prefix>.bin` + `<prefix>.idx`): every sequence read through
the format and through the public Loader (local files and the moto S3 server) equals what the
reference reader gives: megatron-core's `IndexedDataset` where it imports (files written by
its `IndexedDatasetBuilder` too), else a reader of the documented layout written here."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import formatcheck
import streamload as sl
from formatcheck import Skips, assert_delivered, collect, info, problems
from resumecheck import stop_and_resume
from streamload.errors import DataError
from streamload.formats import format_for
from streamload.formats.megatron import (HEADER_BYTES, MAGIC, MegatronFormat, idx_uri,
                                         write_megatron_dataset)

pytestmark = [pytest.mark.timeout(180),
              # megatron-core's builder on NumPy 2 (not ours)
              pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")]


def _megatron_core():
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
        return indexed_dataset
    except Exception:   # not installed, or it does not import on this machine
        return None


MCORE = _megatron_core()
needs_mcore = pytest.mark.skipif(MCORE is None, reason="megatron-core is not importable here")


# ------------------------------------------------------------------ reference readers, stores


def layout_reader(prefix: Path) -> list[np.ndarray]:
    """Every sequence, read by the documented layout (megatron-core's `_IndexReader`)."""
    idx = (prefix.parent / (prefix.name + ".idx")).read_bytes()
    assert idx[:9] == MAGIC
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", idx, 9)
    assert version == 1
    dtype = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}[code]
    lengths = np.frombuffer(idx, np.int32, n_seq, HEADER_BYTES)
    pointers = np.frombuffer(idx, np.int64, n_seq, HEADER_BYTES + 4 * n_seq)
    data = (prefix.parent / (prefix.name + ".bin")).read_bytes()
    return [np.frombuffer(data, dtype, int(n), int(p)) for n, p in zip(lengths, pointers)]


def reference(prefix: Path) -> list[np.ndarray]:
    """megatron-core's reader when it imports, else the layout reader; both when both can."""
    sequences = layout_reader(prefix)
    if MCORE is not None:
        dataset = MCORE.IndexedDataset(str(prefix))
        assert len(dataset) == len(sequences)
        for k, seq in enumerate(sequences):
            np.testing.assert_array_equal(dataset[k], seq)
    return sequences


class FileStore(formatcheck.FileStore):
    """The shared local store; a read may run past the end of an `.idx`."""

    past_end = (".idx",)


async def read_shard(path: Path, *, fmt=None, store=None, **options):
    return await formatcheck.read_shard(fmt or MegatronFormat(), path, store=store or FileStore(),
                                        **options)


def assert_records(records, sequences, expected_indices=None):
    indices = list(range(len(sequences))) if expected_indices is None else expected_indices
    assert [r.index for r in records] == indices
    for r in records:
        assert r.payload.ndim == 1 and r.payload.dtype in (np.int32, np.int64)
        np.testing.assert_array_equal(r.payload, sequences[r.index])


def random_sequences(seed: int, n: int, high: int, max_len: int = 400) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, n)
    lengths[rng.integers(0, n, 3)] = 0           # a few empty sequences
    return [rng.integers(0, high, int(k)) for k in lengths]


# ------------------------------------------------------------------ reading shards


@pytest.mark.parametrize("dtype,high", [(np.uint16, 2**16), (np.int32, 2**31 - 1),
                                        (np.uint8, 256), (np.int8, 128), (np.int16, 2**15),
                                        (np.int64, 2**31 - 1)])
@pytest.mark.parametrize("chunk_bytes", [1, 64, 1000, 1 << 20])
async def test_round_trip_against_the_reference_reader(tmp_path, dtype, high, chunk_bytes):
    sequences = random_sequences(1, 60, high)
    path = write_megatron_dataset(tmp_path / "part", sequences, dtype=dtype)
    expected = reference(tmp_path / "part")
    for mine, ref in zip(sequences, expected):
        np.testing.assert_array_equal(mine, ref)
    assert_records(await read_shard(path, chunk_bytes=chunk_bytes), expected)


@needs_mcore
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
async def test_files_written_by_megatron_core_builder(tmp_path, dtype):
    """IndexedDatasetBuilder's files, one sequence per document (add_item + end_document) and
    several per document (add_document), read as megatron-core reads them: one record per
    sequence."""
    import torch
    sequences = random_sequences(2, 50, 50_000)
    builder = MCORE.IndexedDatasetBuilder(str(tmp_path / "a.bin"), dtype=dtype)
    for seq in sequences[:30]:
        builder.add_item(torch.from_numpy(seq.astype(np.int64)))
        builder.end_document()
    rest = sequences[30:]
    for first in range(0, len(rest), 4):   # documents of up to 4 sequences ("--split-sentences")
        group = rest[first:first + 4]
        builder.add_document(torch.from_numpy(np.concatenate(group).astype(np.int64)),
                             [len(s) for s in group])
    builder.finalize(str(tmp_path / "a.idx"))
    dataset = MCORE.IndexedDataset(str(tmp_path / "a"))
    assert len(dataset) == len(sequences) and dataset.document_indices[-1] == len(sequences)
    expected = [np.asarray(dataset[k]) for k in range(len(dataset))]
    for mine, ref in zip(sequences, expected):
        np.testing.assert_array_equal(mine, ref)
    for chunk_bytes in (3, 500, 1 << 20):
        assert_records(await read_shard(tmp_path / "a.bin", chunk_bytes=chunk_bytes), expected)
    lengths, _ = await MegatronFormat().document_lengths(FileStore(), info(tmp_path / "a.bin"),
                                                         problems=problems("a.bin"))
    assert lengths.tolist() == dataset.sequence_lengths.tolist()


@needs_mcore
async def test_multimodal_index_modes_are_ignored(tmp_path):
    import torch
    sequences = random_sequences(3, 20, 1000)
    builder = MCORE.IndexedDatasetBuilder(str(tmp_path / "mm.bin"), dtype=np.uint16,
                                          multimodal=True)
    for k, seq in enumerate(sequences):
        builder.add_item(torch.from_numpy(seq.astype(np.int64)), mode=k % 2)
        builder.end_document()
    builder.finalize(str(tmp_path / "mm.idx"))
    dataset = MCORE.IndexedDataset(str(tmp_path / "mm"), multimodal=True)
    expected = [np.asarray(dataset[k][0]) for k in range(len(dataset))]
    assert_records(await read_shard(tmp_path / "mm.bin", chunk_bytes=100), expected)


async def test_layout_writer_matches_megatron_core_byte_for_byte(tmp_path):
    if MCORE is None:
        pytest.skip("megatron-core is not importable here")
    import torch
    sequences = random_sequences(4, 25, 60_000)
    write_megatron_dataset(tmp_path / "mine", sequences, dtype=np.uint16)
    builder = MCORE.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for seq in sequences:
        builder.add_item(torch.from_numpy(seq.astype(np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"mine{suffix}").read_bytes() == \
            (tmp_path / f"theirs{suffix}").read_bytes()


async def test_ranges_hold_whole_sequences_and_only_the_index_is_read_whole(tmp_path):
    sequences = [np.arange(n, dtype=np.int64) % 1000 for n in [10, 0, 300, 5, 5, 5, 2000, 1, 0]]
    path = write_megatron_dataset(tmp_path / "r", sequences, dtype=np.uint16)
    store = FileStore()
    stream = await MegatronFormat().open(store, info(path), problems=problems("r.bin"),
                                         chunk_bytes=100)
    assert [(u.rsplit("/", 1)[-1], a, b) for u, a, b in store.reads] == \
        [("r.idx", 0, HEADER_BYTES), ("r.idx", HEADER_BYTES, path.with_suffix(".idx").stat().st_size)]
    # 100 bytes = 50 uint16 tokens: [10, 0] then 300 alone, [5, 5, 5], 2000 alone, [1, 0].
    assert stream.ranges() == [(0, 20), (20, 620), (620, 650), (650, 4650), (4650, 4652)]
    assert_records(await read_shard(path, chunk_bytes=100), sequences)


async def test_pointers_need_not_be_back_to_back(tmp_path):
    """A hand-made index whose sequences lie in another order, with gaps, in the .bin: each
    sequence is read from its pointer, ranges never span a gap, records stay in index order."""
    rng = np.random.default_rng(5)
    sequences = [rng.integers(0, 65535, n).astype(np.uint16) for n in (7, 0, 40, 3, 12)]
    layout = [(3, 0), (0, 8), (4, 100), (2, 200), (1, 200)]   # (sequence, byte pointer)
    data = bytearray(400)
    pointers = [0] * len(sequences)
    for seq, at in layout:
        data[at:at + sequences[seq].nbytes] = sequences[seq].tobytes()
        pointers[seq] = at
    (tmp_path / "g.bin").write_bytes(bytes(data))
    lengths = np.array([s.size for s in sequences], np.int32)
    idx = MAGIC + struct.pack("<QBQQ", 1, 8, len(sequences), len(sequences) + 1) + \
        lengths.tobytes() + np.array(pointers, np.int64).tobytes() + \
        np.arange(len(sequences) + 1, dtype=np.int64).tobytes()
    (tmp_path / "g.idx").write_bytes(idx)
    expected = reference(tmp_path / "g")
    store = FileStore()
    fmt = MegatronFormat()
    stream = await fmt.open(store, info(tmp_path / "g.bin"), problems=problems("g.bin"),
                            chunk_bytes=1 << 20)
    records = []
    for start, end in stream.ranges():
        records += stream.decode(await store.read_range(str(tmp_path / "g.bin"), start, end))
    records += stream.finish()
    assert_records(records, expected)


async def test_only_empty_sequences(tmp_path):
    path = write_megatron_dataset(tmp_path / "e", [np.zeros(0, np.int64)] * 3, dtype=np.int32)
    records = await read_shard(path)
    assert [r.index for r in records] == [0, 1, 2] and all(r.payload.size == 0 for r in records)
    path = write_megatron_dataset(tmp_path / "none", [], dtype=np.uint16)
    assert await read_shard(path) == []


async def test_document_lengths_from_the_index_alone(tmp_path):
    sequences = random_sequences(6, 80, 1000)
    path = write_megatron_dataset(tmp_path / "d", sequences, dtype=np.uint16)
    fmt = MegatronFormat()
    for limit in (None, 0, 1, 17, 80, 500):
        store = FileStore()
        lengths, method = await fmt.document_lengths(store, info(path), problems=problems("d.bin"),
                                                     limit=limit)
        assert method == "index"
        assert lengths.dtype == np.int64
        assert lengths.tolist() == [s.size for s in sequences][:limit]
        assert all(uri.endswith(".idx") for uri, _, _ in store.reads)   # never the .bin
        if limit is not None:   # the lengths and pointers it needs, no more
            assert sum(end - start for _, start, end in store.reads) <= \
                HEADER_BYTES + 12 * min(limit, 80)


# ------------------------------------------------------------------ detection


@pytest.mark.parametrize("uri,named,expected", [
    ("s3://b/corpus/part_text_document.bin", False, True),
    ("/d/x.bin", True, True),
    ("/d/x.idx", False, False),
    ("/d/x.idx", True, False),
    ("/d/.bin", False, False),
    ("/d/x.bin.gz", False, False),
    ("/d/chunk-0-12.bin", False, False),    # a LitData chunk, when detecting
    ("/d/chunk-0-12.bin", True, True),      # ... but format="megatron" reads every .bin
    ("/d/chunk-0-12.zstd.bin", False, False),
    ("/d/chunk-a.bin", False, True),
])
def test_matches(uri, named, expected):
    assert MegatronFormat(None, None, named).matches(uri) is expected


def test_format_for(tmp_path):
    assert isinstance(format_for("/d/p_text_document.bin"), MegatronFormat)
    assert format_for("/d/p_text_document.idx") is None
    assert isinstance(format_for("/d/chunk-0-0.bin", format_name="megatron"), MegatronFormat)
    assert idx_uri("s3://b/a/x.y.bin") == "s3://b/a/x.y.idx"


# ------------------------------------------------------------------ bad input


async def test_truncated_bin_names_the_first_sequence_that_does_not_fit(tmp_path):
    sequences = [np.full(n, 7, np.int64) for n in (10, 20, 30, 40)]
    path = write_megatron_dataset(tmp_path / "t", sequences, dtype=np.uint16)
    path.write_bytes(path.read_bytes()[:2 * (10 + 20 + 15)])   # sequence 2 half there
    with pytest.raises(DataError, match=r"source 'src', shard 't.bin', record 2: sequence 2 "
                                        r"ends at byte 120 but the .bin holds 90 bytes") as err:
        await read_shard(path)
    assert (err.value.source, err.value.shard, err.value.record) == ("src", "t.bin", 2)
    skips = Skips()
    records = await read_shard(path, skips=skips)
    assert_records(records, sequences, [0, 1])
    assert [i for i, _ in skips.calls] == [2, 3]
    assert "truncated" in skips.calls[0][1]
    fmt = MegatronFormat()
    with pytest.raises(DataError, match="record 2"):
        await fmt.document_lengths(FileStore(), info(path), problems=problems("t.bin"))
    lengths, _ = await fmt.document_lengths(FileStore(), info(path), problems=Skips("src", "t.bin"))
    assert lengths.tolist() == [10, 20]


def rewrite_idx(path: Path, edit) -> None:
    idx = path.with_suffix(".idx")
    idx.write_bytes(edit(bytearray(idx.read_bytes())))


def set_code(code):
    def edit(b):
        b[17] = code
        return b
    return edit


@pytest.mark.parametrize("edit,message", [
    (lambda b: b"MMIDIDY\x00\x00" + b[9:], r"index file 'i.idx' is not a Megatron index \(bad magic"),
    (lambda b: b"\x93NUMPY" + b[6:], r"index file 'i.idx' is not a Megatron index"),
    (lambda b: b[:5], r"index file 'i.idx' is not a Megatron index"),
    (lambda b: b[:20], r"index file 'i.idx' is truncated"),
    (lambda b: b[:-3], r"index file 'i.idx' is truncated"),
    (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "version 2"),
    (set_code(7), "holds float32 values, not token ids"),
    (set_code(9), "unknown dtype code 9"),
    (lambda b: b[:HEADER_BYTES] + struct.pack("<i", -1) + b[HEADER_BYTES + 4:],
     "sequence 0 a negative length"),
    (lambda b: b[:-8] + struct.pack("<q", 3), "document indices"),
])
async def test_bad_index_is_a_shard_error_naming_the_idx(tmp_path, edit, message):
    path = write_megatron_dataset(tmp_path / "i", [np.arange(5), np.arange(3)], dtype=np.uint16)
    rewrite_idx(path, edit)
    with pytest.raises(DataError, match=message) as err:
        await read_shard(path)
    assert (err.value.source, err.value.shard, err.value.record) == ("src", "i.bin", None)
    skips = Skips()
    assert await read_shard(path, skips=skips) == []
    assert len(skips.calls) == 1 and skips.calls[0][0] is None
    with pytest.raises(DataError, match=message):
        await MegatronFormat().document_lengths(FileStore(), info(path), problems=problems("i.bin"))


async def test_misaligned_pointer(tmp_path):
    path = write_megatron_dataset(tmp_path / "i", [np.arange(5), np.arange(3)], dtype=np.int32)
    rewrite_idx(path, lambda b: b[:HEADER_BYTES + 8 + 8] + struct.pack("<q", 6)
                + b[HEADER_BYTES + 24:])
    with pytest.raises(DataError, match="sequence 1 the byte pointer 6, not a non-negative "
                                        "multiple of 4"):
        await read_shard(path)


async def test_negative_token_ids_are_record_errors(tmp_path):
    sequences = [np.array([1, 2, 3]), np.array([4, -5, 6]), np.array([7]), np.array([-1])]
    path = write_megatron_dataset(tmp_path / "n", sequences, dtype=np.int32)
    with pytest.raises(DataError, match="record 1: negative token id"):
        await read_shard(path)
    skips = Skips()
    assert_records(await read_shard(path, skips=skips), sequences, [0, 2])
    assert [i for i, _ in skips.calls] == [1, 3]


# ------------------------------------------------------------------ through the Loader


def write_source(root: Path, shards: int = 3, per_shard: int = 40, dtype=np.uint16,
                 seed: int = 0) -> dict[str, np.ndarray]:
    """Shards `part-k.bin/.idx` under `root`; {sample id: tokens} by the reference reader."""
    expected = {}
    for k in range(shards):
        sequences = random_sequences(seed + k, per_shard, 30_000, max_len=300)
        write_megatron_dataset(root / f"part-{k}", sequences, dtype=dtype)
        for d, seq in enumerate(reference(root / f"part-{k}")):
            if seq.size:   # empty documents are counted, not delivered
                expected[f"meg/part-{k}.bin/{d}"] = seq.astype(np.int64)
    return expected


def test_loader_delivers_every_sequence_once(tmp_path):
    expected = write_source(tmp_path / "meg")
    with sl.Loader([sl.Source(str(tmp_path / "meg"), name="meg")], micro_batch_tokens=512,
                   micro_batches=2, epochs=1, chunk_bytes=700) as loader:
        steps, docs = collect(loader)
        stats = loader.stats()
    ids = [i for step in steps for mb in step for i in mb[0]]
    assert len(ids) == len(set(ids))
    assert_delivered(docs, expected)
    assert stats["sources"]["meg"]["requests"] > 3 * 2


def test_loader_splits_long_sequences_and_keeps_them_whole(tmp_path):
    expected = write_source(tmp_path / "meg", shards=2, per_shard=30, dtype=np.int32)
    with sl.Loader([sl.Source(str(tmp_path / "meg"), name="meg", format="megatron")],
                   micro_batch_tokens=64, micro_batches=2, epochs=1, chunk_bytes=300) as loader:
        _, docs = collect(loader)
    assert_delivered(docs, expected)


def test_loader_over_s3(tmp_path, s3_bucket, storage_options):
    client, bucket = s3_bucket
    expected = write_source(tmp_path / "meg", shards=3, per_shard=30, seed=10)
    for path in sorted((tmp_path / "meg").iterdir()):
        client.upload_file(str(path), bucket, f"corpus/meg/{path.name}")
    with sl.Loader([sl.Source(f"s3://{bucket}/corpus/meg/", name="meg")],
                   micro_batch_tokens=512, micro_batches=2, epochs=1, chunk_bytes=1000,
                   storage_options=storage_options) as loader:
        _, docs = collect(loader)
        stats = loader.stats()
    assert_delivered(docs, expected)
    assert stats["sources"]["meg"]["bytes_fetched"] > 0


@pytest.mark.parametrize("stop_after", [1, 4])
def test_exact_resume(tmp_path, stop_after):
    expected = write_source(tmp_path / "meg", shards=3, per_shard=40, seed=20)

    def loader():
        return sl.Loader([sl.Source(str(tmp_path / "meg"), name="meg")], micro_batch_tokens=256,
                         micro_batches=2, epochs=1, chunk_bytes=500)

    with loader() as full_loader:
        full, docs = collect(full_loader)
        stats = full_loader.stats()
    assert_delivered(docs, expected)
    assert len(full) > stop_after + 2
    run = stop_and_resume(loader, stop_after, (full, stats))
    assert run.head + run.tail == run.full


def test_loader_truncated_bin_raises_or_skips(tmp_path):
    expected = write_source(tmp_path / "meg", shards=2, per_shard=20, seed=30)
    bad = tmp_path / "meg" / "part-1.bin"
    bad.write_bytes(bad.read_bytes()[:-3])
    last = max(int(sid.rsplit("/", 1)[1]) for sid in expected if "/part-1.bin/" in sid)
    with pytest.raises(DataError, match=rf"source 'meg', shard 'part-1.bin', record {last}:"):
        with sl.Loader([sl.Source(str(tmp_path / "meg"), name="meg")], micro_batch_tokens=512,
                       epochs=1) as loader:
            collect(loader)
    with sl.Loader([sl.Source(str(tmp_path / "meg"), name="meg")], micro_batch_tokens=512,
                   epochs=1, on_error="skip") as loader:
        _, docs = collect(loader)
        stats = loader.stats()
    del expected[f"meg/part-1.bin/{last}"]
    assert_delivered(docs, expected)
    assert stats["sources"]["meg"]["skipped_records"] == 1


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_bin_without_its_idx_names_what_is_missing_or_is_skipped(tmp_path, where, request):
    """A `.bin` whose `.idx` is absent (say a stray model file) is a bad shard whose error says
    what was expected and how to leave such files out; on_error="skip" skips and counts it."""
    expected = write_source(tmp_path / "meg", shards=2, per_shard=20, seed=40)
    (tmp_path / "meg" / "part-1.idx").unlink()
    uri, options = str(tmp_path / "meg"), {}
    if where == "s3":
        client, bucket = request.getfixturevalue("s3_bucket")
        options = {"storage_options": request.getfixturevalue("storage_options")}
        for path in sorted((tmp_path / "meg").iterdir()):
            client.upload_file(str(path), bucket, f"missing/meg/{path.name}")
        uri = f"s3://{bucket}/missing/meg/"
    with pytest.raises(DataError, match=r"source 'meg', shard 'part-1.bin': index file "
                                        r"'part-1.idx' is missing: a Megatron dataset is"):
        with sl.Loader([sl.Source(uri, name="meg")], micro_batch_tokens=512, epochs=1,
                       **options) as loader:
            collect(loader)
    with sl.Loader([sl.Source(uri, name="meg")], micro_batch_tokens=512, epochs=1,
                   on_error="skip", **options) as loader:
        _, docs = collect(loader)
        stats = loader.stats()["sources"]["meg"]
    assert_delivered(docs, {k: v for k, v in expected.items() if "/part-1.bin/" not in k})
    assert stats["skipped_shards"] == 1 and "part-1.idx" in stats["skip_reasons"][0]
