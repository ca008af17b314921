"""LitData optimized datasets (`litdata.optimize` output): the format against litdata itself.

The datasets are written by `litdata.optimize` and read back by `litdata.StreamingDataset` (the
reference) in a subprocess (litdata starts processes and sets the multiprocessing start method;
neither belongs in the test process). Every record the Loader delivers, from local files and
from S3 (moto), is compared with the reference; then exact resume, `document_lengths`, the
ranged reads, and bad input.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import streamload as sl
from formatcheck import Skips, for_shard, problems
from resumecheck import stop_and_resume
from streamload.errors import DataError
from streamload.formats import format_for
from streamload.formats.catalog import catalog
from streamload.formats.litdata import LitdataFormat
from streamload.storage.base import ObjectInfo, StoreCounters
from streamload.storage.fs import LocalStore

pytestmark = pytest.mark.timeout(180)

GENERATOR = r'''
"""Writes the litdata test datasets with litdata.optimize and reads them back with
litdata.StreamingDataset (the reference), into <root>/reference.json."""
import json
import os
import shutil
import sys

try:
    import numpy as np
    import litdata as ld
    import litdata.streaming.item_loader as item_loader
    from litdata.streaming.item_loader import TokensLoader
except ImportError as exc:   # the test skips
    print(f"litdata is not importable: {exc}")
    sys.exit(3)

root = sys.argv[1]
KW = dict(num_workers=1, mode="overwrite", verbose=False, start_method="fork")
BLOCK = 8


def text_item(i):
    words = ["héllo", "wörld", "日本語", "🙂", "tab\there", "line\nbreak", "x" * 37]
    return {"text": "" if i % 29 == 5 else " ".join(words[(i + k) % 7] for k in range(i % 23)),
            "id": i}


def tokens_item(i):
    return ((np.arange(1 + (i * 7) % 41) * 31 + i) % 50000).astype(np.int32)


def npy_item(i):
    return {"tokens": ((np.arange((i * 5) % 33) * 17 + 3 * i) % 65000).astype(np.int32), "id": i}


def list_item(i):
    return {"tokens": [(j * 13 + i) % 1000 for j in range(i % 17)], "text": "t%d" % i}


def write(name, fn, n, **kw):
    ld.optimize(fn=fn, inputs=list(range(n)), output_dir=os.path.join(root, name), **KW, **kw)


def plain(name, fn, n, **kw):
    """Written with litdata's Arrow row footer turned off: classic pytree items."""
    saved = item_loader._PYARROW_AVAILABLE
    item_loader._PYARROW_AVAILABLE = False
    try:
        write(name, fn, n, **kw)
    finally:
        item_loader._PYARROW_AVAILABLE = saved


def reference(name, **kw):
    # litdata inflates a local dataset's compressed chunks in place (and drops the originals):
    # read a copy.
    scratch = os.path.join(root, "_scratch", name)
    shutil.copytree(os.path.join(root, name), scratch)
    items = []
    for item in ld.StreamingDataset(input_dir=scratch, cache_dir=scratch + "-cache", **kw):
        if isinstance(item, dict):
            items.append({k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in item.items()})
        else:
            items.append(item.tolist())
    return items


sets = {}
write("text", text_item, 150, chunk_bytes=1500)
sets["text"] = {"kind": "text"}
plain("text_plain", text_item, 150, chunk_bytes=1500)
sets["text_plain"] = {"kind": "text"}
try:
    import zstd  # noqa: F401  (litdata's whole-file compressor)
except ImportError:
    pass
else:
    plain("text_zstd", text_item, 150, chunk_bytes=1500, compression="zstd",
          compression_level="chunk")
    sets["text_zstd"] = {"kind": "text"}
# compression="zstd": framed zstd, or (rows of strings, with pyarrow) an Arrow footer that
# Arrow's IPC compression compresses
write("text_ipc_zstd", text_item, 150, chunk_bytes=1500, compression="zstd")
sets["text_ipc_zstd"] = {"kind": "text"}
write("list_tokens", list_item, 100, chunk_bytes=600)   # a list leaf: "json", Arrow footer
sets["list_tokens"] = {"kind": "tokens"}
write("tokens", tokens_item, 120, chunk_size=150, item_loader=TokensLoader())
sets["tokens"] = {"kind": "documents", "written": [tokens_item(i).tolist() for i in range(120)]}
shutil.copytree(os.path.join(root, "tokens"), os.path.join(root, "tokens_blocks"))
index_path = os.path.join(root, "tokens_blocks", "index.json")
with open(index_path) as f:
    index = json.load(f)
index["config"]["block_size"] = BLOCK
with open(index_path, "w") as f:
    json.dump(index, f)
sets["tokens_blocks"] = {"kind": "blocks", "block_size": BLOCK}
write("npy", npy_item, 120, chunk_bytes=700)
sets["npy"] = {"kind": "tokens"}
write("npy_batch", npy_item, 120, chunk_bytes=700, compression="zstd", compression_batch_size=4)
sets["npy_batch"] = {"kind": "tokens"}
write("npy_sample", npy_item, 120, chunk_bytes=700, compression="zstd",
      compression_level="sample")
sets["npy_sample"] = {"kind": "tokens"}

for name, info in sets.items():
    with open(os.path.join(root, name, "index.json")) as f:
        index = json.load(f)
    info["chunks"] = [(c["filename"], c["chunk_size"], c["dim"]) for c in index["chunks"]]
    info["config"] = {k: v for k, v in index["config"].items() if k != "data_spec"}
    first = os.path.join(root, name, index["chunks"][0]["filename"])
    with open(first, "rb") as f:
        data = f.read()
    info["arrow_footer"] = data.endswith(b"LDARW01\0")
    info["framed"] = data.startswith(b"LDFZ01\0\0")
    if info["kind"] == "blocks":
        info["reference"] = reference(name, item_loader=TokensLoader(block_size=BLOCK))
    elif info["kind"] == "documents":   # litdata reads TokensLoader data in blocks only
        info["reference"] = reference(name, item_loader=TokensLoader(block_size=1))
    else:
        info["reference"] = reference(name)
shutil.rmtree(os.path.join(root, "_scratch"), ignore_errors=True)
with open(os.path.join(root, "reference.json"), "w") as f:
    json.dump(sets, f)
'''

TEXT_SETS = ("text", "text_plain", "text_zstd", "text_ipc_zstd")
TOKEN_SETS = ("npy", "npy_batch", "npy_sample", "list_tokens")
ALL_SETS = TEXT_SETS + ("tokens", "tokens_blocks") + TOKEN_SETS
MB_TOKENS = 4096   # larger than every document: no piece suffixes


@pytest.fixture(scope="module")
def litdata_root(tmp_path_factory) -> tuple[Path, dict]:
    """(root, reference.json): the datasets and what litdata's reader yields from them."""
    if importlib.util.find_spec("litdata") is None:
        pytest.skip("litdata is not installed (pip install --no-deps litdata lightning-utilities)")
    root = tmp_path_factory.mktemp("litdata")
    script = root / "generate.py"
    script.write_text(GENERATOR)
    done = subprocess.run([sys.executable, str(script), str(root / "sets")], capture_output=True,
                          text=True, timeout=300)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return root / "sets", json.loads((root / "sets" / "reference.json").read_text())


def expected_records(name: str, info: dict) -> dict[tuple[str, int], list[int]]:
    """(chunk file, record index) -> tokens, from the reference reader's items in index order
    (TokensLoader "documents": the items `optimize` was given, checked against the reference's
    tokens, which litdata only hands out in blocks)."""
    ref, out = info["reference"], {}
    if info["kind"] == "documents":
        written = info["written"]
        assert [t for doc in written for t in doc] == [t for block in ref for t in block]
        at = 0
        for filename, items, _dim in info["chunks"]:
            for k in range(items):
                out[(filename, k)] = written[at + k]
            at += items
        return out
    at = 0
    for filename, items, dim in info["chunks"]:
        count = dim // info["block_size"] if info["kind"] == "blocks" else items
        for k in range(count):
            item = ref[at + k]
            if info["kind"] == "text":
                out[(filename, k)] = list(item["text"].encode("utf-8"))
            elif info["kind"] == "tokens":
                out[(filename, k)] = item["tokens"]
            else:
                out[(filename, k)] = item
        at += count
    assert at == len(ref)
    return out


def field_options(info: dict) -> dict:
    return {"tokens_field": "tokens"} if info["kind"] == "tokens" else {}


def delivered(batches) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for batch in batches:
        for mb in batch.micro_batches:
            tokens, cu = mb.tokens.numpy(), mb.cu_seqlens.numpy()
            for k, sid in enumerate(mb.sample_ids):
                assert sid not in out, f"{sid} delivered twice"
                out[sid] = tokens[cu[k]:cu[k + 1]].tolist()
    return out


def run(sources, **options):
    options = {"micro_batch_tokens": MB_TOKENS, "micro_batches": 2, "epochs": 1, **options}
    with sl.Loader(sources, **options) as loader:
        batches = list(loader)
        stats = loader.stats()
    return delivered(batches), stats


def assert_matches(got: dict[str, list[int]], source: str, expected: dict) -> None:
    want = {f"{source}/{chunk}/{k}": tokens for (chunk, k), tokens in expected.items() if tokens}
    assert sorted(got) == sorted(want)
    for sid, tokens in want.items():
        assert got[sid] == tokens, sid


# ------------------------------------------------------------------------------ detection


@pytest.mark.parametrize("uri, expected", [
    ("/data/ds/chunk-0-0.bin", True),
    ("s3://b/ds/chunk-12-345.bin", True),
    ("s3://b/ds/chunk-0-3.zstd.bin", True),
    ("s3://b/ds/chunk-0-3.zstd:4.bin", True),
    ("/data/ds/index.json", False),
    ("/data/ds/0.index.json", False),
    ("/data/ds/chunk-0-0.bin.tmp", False),
    ("/data/ds/chunk-a-0.bin", False),
    ("/data/ds/my_text_document.bin", False),
])
def test_detection(uri, expected):
    assert LitdataFormat().matches(uri) is expected
    fmt = format_for(uri, format_name="litdata")
    assert (fmt is not None) is expected


def test_detection_among_all_formats():
    """Unnamed, a chunk file is litdata's (not Megatron's .bin); index.json is no shard."""
    assert format_for("/d/chunk-0-7.bin").name == "litdata"
    assert format_for("/d/index.json") is None


def test_the_reference_writer_made_every_layout(litdata_root):
    _, sets = litdata_root
    assert sets["npy_batch"]["framed"] and sets["npy_batch"]["config"]["compression_level"] == "batch"
    assert sets["npy_sample"]["config"]["compression_level"] == "sample"
    assert not sets["text_plain"]["arrow_footer"]
    if "text_zstd" in sets:
        assert all(f.endswith(".zstd.bin") for f, _, _ in sets["text_zstd"]["chunks"])
    # with pyarrow installed, litdata keeps flat rows of strings in an Arrow IPC footer
    assert sets["text"]["arrow_footer"] == (importlib.util.find_spec("pyarrow") is not None)


# ------------------------------------------------------------------------------ the Loader


@pytest.mark.parametrize("name", ALL_SETS)
def test_loader_local_matches_the_reference(litdata_root, name):
    root, sets = litdata_root
    if name not in sets:
        pytest.skip(f"{name}: litdata could not write it here (no zstd module)")
    if name == "list_tokens" and not sets[name]["arrow_footer"]:
        pytest.skip("without pyarrow litdata writes lists as its own JSON encoding")
    info = sets[name]
    got, stats = run([sl.Source(str(root / name), format="litdata", **field_options(info))],
                     chunk_bytes=512)
    assert_matches(got, name, expected_records(name, info))
    assert stats["sources"][name]["skipped_records"] == 0


@pytest.mark.parametrize("name", ["text", "text_plain", "tokens", "npy", "npy_batch"])
def test_loader_over_s3_matches_the_reference(litdata_root, s3_bucket, storage_options, name):
    root, sets = litdata_root
    client, bucket = s3_bucket
    info = sets[name]
    for path in sorted((root / name).iterdir()):
        client.upload_file(str(path), bucket, f"sets/{name}/{path.name}")
    got, _ = run([sl.Source(f"s3://{bucket}/sets/{name}/", **field_options(info))],
                 storage_options=storage_options, chunk_bytes=300)
    assert_matches(got, name, expected_records(name, info))


def test_two_datasets_under_one_prefix(litdata_root, tmp_path):
    """Each chunk reads the index.json of its own directory."""
    root, sets = litdata_root
    for name in ("text_plain", "text"):
        shutil.copytree(root / name, tmp_path / "both" / name)
    got, _ = run([sl.Source(str(tmp_path / "both"), name="both")])
    for name in ("text_plain", "text"):
        want = {f"both/{name}/{c}/{k}": t
                for (c, k), t in expected_records(name, sets[name]).items() if t}
        assert {sid: got[sid] for sid in want} == want
    assert len(got) == 2 * sum(1 for t in expected_records("text", sets["text"]).values() if t)


@pytest.mark.parametrize("name, stop", [("text_plain", 3), ("tokens_blocks", 5), ("npy", 4)])
def test_exact_resume(litdata_root, name, stop):
    root, sets = litdata_root

    def make():
        return sl.Loader([sl.Source(str(root / name), format="litdata",
                                    **field_options(sets[name]))],
                         micro_batch_tokens=256, micro_batches=2, epochs=1, seed=3,
                         chunk_bytes=256)

    run = stop_and_resume(make, stop)
    assert run.head + run.tail == run.full
    ids = [sid for step in run.full for mb in step for sid in mb[0]]
    assert len(ids) == len(set(ids))
    whole = {sid.rsplit(":", 1)[0] for sid in ids}
    want = {f"{name}/{c}/{k}" for (c, k), t in expected_records(name, sets[name]).items() if t}
    assert whole == want


# ------------------------------------------------------------------------------ the format


class CountingStore(LocalStore):
    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, int, int]] = []

    async def read_range(self, uri, start, end, *, counters: StoreCounters | None = None):
        self.reads.append((uri.rsplit("/", 1)[-1], start, end))
        return await super().read_range(uri, start, end, counters=counters)

    def chunk_reads(self) -> list[tuple[str, int, int]]:
        return [read for read in self.reads if read[0] != "index.json"]


def chunk_info(root: Path, name: str, filename: str) -> ObjectInfo:
    path = root / name / filename
    return ObjectInfo(str(path), path.stat().st_size)


async def read_chunk(fmt, store, info: ObjectInfo, *, chunk_bytes=256, skips=None):
    stream = await fmt.open(store, info, problems=for_shard(skips, info.uri.rsplit("/", 1)[-1]),
                            chunk_bytes=chunk_bytes)
    records = []
    for start, end in stream.ranges():
        records += stream.decode(await store.read_range(info.uri, start, end))
    return records + stream.finish(), stream.ranges()


def format_for_set(info: dict) -> LitdataFormat:
    return LitdataFormat(None, field_options(info).get("tokens_field"), True)


@pytest.mark.parametrize("name, method", [
    ("text", None), ("text_plain", "index"), ("text_zstd", "scan"), ("tokens", "index"),
    ("tokens_blocks", "index"), ("npy", "index"), ("npy_batch", "index"),
    ("npy_sample", "scan")])
async def test_document_lengths(litdata_root, name, method):
    """From the offsets where they are exact, else a scan; always the delivered lengths."""
    root, sets = litdata_root
    if name not in sets:
        pytest.skip(f"{name} was not written here")
    info = sets[name]
    fmt = format_for_set(info)
    expected = expected_records(name, info)
    store = CountingStore()
    for filename, _items, _dim in info["chunks"]:
        shard = chunk_info(root, name, filename)
        lengths, measured = await fmt.document_lengths(store, shard, problems=problems(filename))
        want = [len(t) for (c, _k), t in expected.items() if c == filename]
        assert lengths.tolist() == want
        assert (await fmt.document_lengths(store, shard, problems=problems(filename),
                                           limit=2)).lengths.tolist() == want[:2]
        assert method is None or measured == method
    if name == "tokens_blocks":   # block_size from the index: no chunk is read at all
        assert not store.chunk_reads()


async def test_uncompressed_chunks_are_read_by_ranges_of_items(litdata_root):
    root, sets = litdata_root
    for name in ("text_plain", "npy", "tokens", "tokens_blocks"):
        info = sets[name]
        fmt = format_for_set(info)
        for filename, items, _dim in info["chunks"]:
            store = CountingStore()
            shard = chunk_info(root, name, filename)
            records, ranges = await read_chunk(fmt, store, shard, chunk_bytes=128)
            header = 4 + 4 * (items + 1)
            reads = store.chunk_reads()   # the header, then the planned ranges
            assert reads[0] == (filename, 0, header)
            assert reads[1:] == [(filename, a, b) for a, b in ranges]
            assert ranges[0][0] == header
            assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
            if info["kind"] != "blocks":
                assert ranges[-1][1] == shard.size
                assert [r.index for r in records] == list(range(items))
            assert len(ranges) > 1 or shard.size - header <= 256


async def test_framed_chunks_are_read_by_ranges_of_frames(litdata_root):
    root, sets = litdata_root
    info = sets["npy_batch"]
    fmt = format_for_set(info)
    for filename, items, _dim in info["chunks"]:
        store = CountingStore()
        shard = chunk_info(root, name := "npy_batch", filename)
        records, ranges = await read_chunk(fmt, store, shard, chunk_bytes=64)
        frames = -(-items // 4)
        assert store.chunk_reads()[0] == (filename, 0, 24 + 4 * (items + 1) + 24 * frames)
        assert ranges[-1][1] == shard.size and len(ranges) >= min(frames, 2)
        assert [r.index for r in records] == list(range(items)), name


async def test_whole_file_compressed_and_arrow_chunks_are_read_whole(litdata_root):
    root, sets = litdata_root
    for name in ("text_zstd", "text"):
        if name not in sets or (name == "text" and not sets["text"]["arrow_footer"]):
            continue
        fmt = LitdataFormat()
        for filename, items, _dim in sets[name]["chunks"]:
            store = CountingStore()
            shard = chunk_info(root, name, filename)
            records, ranges = await read_chunk(fmt, store, shard, chunk_bytes=64)
            assert len(ranges) == 1 and [r.index for r in records] == list(range(items))
            if name == "text_zstd":
                assert ranges == [(0, shard.size)]
            else:   # header, the footer's length, then the Arrow IPC bytes
                assert ranges[0][1] == shard.size - 12


async def test_the_index_is_read_once_per_directory_by_the_catalog(litdata_root):
    """The source's catalog keeps the index (its chunks read it once, together); the format,
    shared by every Loader, keeps nothing, so another catalog (another Loader) reads it again."""
    root, sets = litdata_root
    size = (root / "text_plain" / "index.json").stat().st_size
    for reads in (1, 2):
        store = CountingStore()
        found = await catalog(sl.Source(str(root / "text_plain"), format="litdata"), store)
        await asyncio.gather(*(read_chunk(s.format, store, s.info) for s in found.shards))
        assert len(found.shards) == len(sets["text_plain"]["chunks"]) > 1
        assert [r for r in store.reads if r[0] == "index.json"] == [("index.json", 0, size)]
    fmt = found.shards[0].format.format
    assert set(vars(fmt)) == {"text_field", "tokens_field", "block_size"}
    store = CountingStore()   # the format alone reads the index for each call
    for s in found.shards:
        await read_chunk(fmt, store, s.info)
    assert len([r for r in store.reads if r[0] == "index.json"]) == len(found.shards)


def test_block_size_argument(litdata_root):
    """TokensLoader(block_size) blocks from the `block_size` argument as from the index key."""
    root, sets = litdata_root
    blocks = expected_records("tokens_blocks", sets["tokens_blocks"])

    async def read_all():
        fmt, store, out = LitdataFormat(block_size=8), LocalStore(), {}
        for filename, _items, _dim in sets["tokens"]["chunks"]:
            records, _ = await read_chunk(fmt, store, chunk_info(root, "tokens", filename))
            out.update({(filename, r.index): r.payload.tolist() for r in records})
        return out

    assert asyncio.run(read_all()) == blocks


# ------------------------------------------------------------------------------ bad input


def copy_set(root: Path, name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(root / name, target)
    return target


def test_missing_chunk_names_source_index_and_chunk(litdata_root, tmp_path):
    root, sets = litdata_root
    data = copy_set(root, "text_plain", tmp_path)
    chunks = sets["text_plain"]["chunks"]
    lost = chunks[2][0]
    (data / lost).unlink()
    with pytest.raises(DataError) as raised:
        run([sl.Source(str(data), name="web")])
    message = str(raised.value)
    assert "source 'web'" in message and "index.json" in message and repr(lost) in message
    # skip mode: the other chunks are read, the missing one is counted once
    got, stats = run([sl.Source(str(data), name="web")], on_error="skip")
    expected = {k: v for k, v in expected_records("text_plain", sets["text_plain"]).items()
                if k[0] != lost}
    assert_matches(got, "web", expected)
    assert stats["sources"]["web"]["skipped_shards"] == 1
    assert any(repr(lost) in reason for reason in stats["sources"]["web"]["skip_reasons"])


@pytest.mark.parametrize("name, options, listed", [
    ("text_plain", {"text_field": "body"}, ["text (str)", "id (int)"]),
    ("npy", {"tokens_field": "ids"}, ["tokens (no_header_numpy:2)", "id (int)"]),
    ("npy", {"text_field": "tokens"}, ["tokens (no_header_numpy:2)"]),
    ("text_plain", {"tokens_field": "text"}, ["not a 1-D integer array"]),
])
def test_missing_or_unusable_field_lists_the_fields(litdata_root, name, options, listed):
    root, _ = litdata_root
    with pytest.raises(DataError) as raised:
        run([sl.Source(str(root / name), format="litdata", **options)])
    message = str(raised.value)
    assert f"source {name!r}" in message and "chunk-" in message
    for part in listed:
        assert part in message


def test_missing_field_in_an_arrow_footer_dataset(litdata_root):
    root, sets = litdata_root
    with pytest.raises(DataError, match=r"'body'.*text \(str\), id \(int\)"):
        run([sl.Source(str(root / "text"), text_field="body")])


@pytest.mark.parametrize("name, options, hint", [
    ("text_plain", {"text_field": "txt"}, "did you mean text_field='text'?"),
    ("npy", {"tokens_field": "token"}, "did you mean tokens_field='tokens'?"),
    ("text", {"text_field": "texts"}, "did you mean text_field='text'?"),   # an Arrow footer
])
def test_missing_field_suggests_the_field_and_not_skipping(litdata_root, name, options, hint):
    root, _ = litdata_root
    with pytest.raises(DataError) as raised:
        run([sl.Source(str(root / name), format="litdata", **options)])
    assert str(raised.value).endswith(hint), str(raised.value)
    assert "on_error" not in str(raised.value)


async def test_bad_chunks_and_indexes(litdata_root, tmp_path):
    root, sets = litdata_root
    data = copy_set(root, "text_plain", tmp_path)
    first, items, _dim = sets["text_plain"]["chunks"][0]
    store = LocalStore()

    async def fails(filename: str, message: str, fmt=None) -> None:
        fmt = fmt or LitdataFormat()
        with pytest.raises(DataError, match=message):
            await read_chunk(fmt, store, chunk_info(tmp_path, "text_plain", filename))
        skips = Skips()
        records, _ = await read_chunk(fmt or LitdataFormat(), store,
                                      chunk_info(tmp_path, "text_plain", filename),
                                      skips=skips)
        assert records == [] and len(skips.calls) == 1 and skips.calls[0][0] is None

    # a chunk file the index does not name
    shutil.copy(data / first, data / "chunk-9-9.bin")
    await fails("chunk-9-9.bin", "not named in index.json")
    # a truncated chunk
    blob = (data / first).read_bytes()
    (data / first).write_bytes(blob[:-5])
    await fails(first, "truncated|corrupt", LitdataFormat())
    # a header that disagrees with the index
    (data / first).write_bytes(struct.pack("<I", items + 1) + blob[4:])
    await fails(first, "counts", LitdataFormat())
    # no index.json at all
    (data / first).write_bytes(blob)
    (data / "index.json").unlink()
    await fails(first, "no index.json", LitdataFormat())


async def test_corrupt_items_are_record_errors(litdata_root, tmp_path):
    root, sets = litdata_root
    data = copy_set(root, "text_plain", tmp_path)
    first, items, _dim = sets["text_plain"]["chunks"][0]
    blob = bytearray((data / first).read_bytes())
    offsets = np.frombuffer(bytes(blob[4:4 + 4 * (items + 1)]), "<u4")
    # item 1's text: invalid UTF-8; item 2's size header: too large
    text_at = int(offsets[1]) + 8
    assert struct.unpack_from("<I", blob, int(offsets[1]))[0] > 0
    blob[text_at] = 0xFF
    struct.pack_into("<I", blob, int(offsets[2]), 10_000)
    (data / first).write_bytes(bytes(blob))
    fmt = LitdataFormat()
    with pytest.raises(DataError, match="record 1.*UTF-8"):
        await read_chunk(fmt, LocalStore(), chunk_info(tmp_path, "text_plain", first))
    skips = Skips()
    records, _ = await read_chunk(fmt, LocalStore(), chunk_info(tmp_path, "text_plain", first),
                                  skips=skips)
    assert [i for i, _ in skips.calls] == [1, 2]
    assert [r.index for r in records] == [k for k in range(items) if k not in (1, 2)]


async def test_negative_token_ids_are_record_errors(litdata_root, tmp_path):
    root, sets = litdata_root
    data = copy_set(root, "npy", tmp_path)
    first, items, _dim = sets["npy"]["chunks"][0]
    blob = bytearray((data / first).read_bytes())
    offsets = np.frombuffer(bytes(blob[4:4 + 4 * (items + 1)]), "<u4")
    doc = next(k for k in range(items) if struct.unpack_from("<I", blob, int(offsets[k]))[0])
    struct.pack_into("<i", blob, int(offsets[doc]) + 8, -5)
    (data / first).write_bytes(bytes(blob))
    fmt = LitdataFormat(None, "tokens", True)
    with pytest.raises(DataError, match=f"record {doc}.*negative"):
        await read_chunk(fmt, LocalStore(), chunk_info(tmp_path, "npy", first))


def test_whole_file_compressed_token_blocks():
    """A TokensLoader chunk compressed whole (compression_level "chunk") read in blocks of
    `block_size`: the blocks as columns (it raised a TypeError: the blocks, already columns,
    were gathered again as records)."""
    import zstandard
    from streamload.formats.base import Problems
    from streamload.formats.litdata.layouts import Layout
    from streamload.formats.litdata.stream import LitdataStream, _Plan
    ids = np.arange(24, dtype=np.int32)
    header = 4 + 4 * 3   # 2 items, 3 offsets
    raw = (np.array([2, header, header + 40, header + 96], "<u4").tobytes()
           + ids.astype("<i4").tobytes())
    chunk = zstandard.ZstdCompressor().compress(raw)
    layout = Layout(tokens_loader=True, leaf_formats=("no_header_numpy:5",), leaf_names=("",),
                    leaf=0, dtype=np.dtype("<i4"), want_tokens=True, block_size=4,
                    whole_file=True, level="chunk", frame_rows=0, field_name="tokens")
    stream = LitdataStream(_Plan("whole", [(0, len(chunk))], [(0, 2)], items=2), layout,
                           problems=Problems("src", "chunk-0-0.bin"), expected_items=2, dim=24)
    records = stream.decode(chunk)
    assert [r.index for r in records] == list(range(6))
    assert [r.payload.tolist() for r in records] == ids.reshape(6, 4).tolist()


async def test_truncated_compressed_chunks_are_shard_errors(litdata_root, tmp_path):
    root, sets = litdata_root
    for name, message in (("npy_batch", "frame table is corrupt"),
                          ("text_zstd", "zstd frame is truncated")):
        if name not in sets:
            continue
        data = copy_set(root, name, tmp_path)
        first = sets[name]["chunks"][0][0]
        blob = (data / first).read_bytes()
        (data / first).write_bytes(blob[:-7])
        fmt = format_for_set(sets[name])
        with pytest.raises(DataError, match=message):
            await read_chunk(fmt, LocalStore(), chunk_info(tmp_path, name, first))
        skips = Skips()
        records, _ = await read_chunk(fmt, LocalStore(), chunk_info(tmp_path, name, first),
                                      skips=skips)
        assert records == [] and [i for i, _ in skips.calls] == [None]
