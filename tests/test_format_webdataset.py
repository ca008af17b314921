"""WebDataset tar shards (`.tar`, `.tar.gz`, `.tgz`): written with Python's `tarfile`, read
through the format and through the public Loader (local files and the moto S3 server), and
compared sample by sample with a reference reader: `tarfile` itself (members in order, grouped
by WebDataset's key rule), and the `webdataset` package's own tar iterator where it imports."""
from __future__ import annotations

import gzip
import io
import json
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest

import formatcheck
import streamload as sl
from formatcheck import FileStore, Skips, assert_delivered, collect, info, problems
from resumecheck import stop_and_resume
from streamload.errors import DataError
from streamload.formats import format_for
from streamload.formats.webdataset import WebdatasetFormat, text_source
from streamload.formats.writers import write_webdataset_shard

pytestmark = pytest.mark.timeout(180)

try:
    from webdataset import tariterators as wds_tariterators
except Exception:   # not installed here
    wds_tariterators = None


# ------------------------------------------------------------------ reference readers, stores

_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")   # WebDataset's base_plus_ext


def tarfile_samples(path: Path) -> list[tuple[str, dict[str, bytes]]]:
    """(key, {extension: bytes}) per sample, in order: tarfile's members, regular files only,
    metadata (`__...__`) and names without an extension left out, consecutive members with the
    same key grouped (WebDataset's rules)."""
    samples: list[tuple[str, dict[str, bytes]]] = []
    with tarfile.open(path, "r:*") as tar:
        for member in tar:
            if not member.isreg() or re.match(r"__[^/]*__($|/)", member.name):
                continue
            match = _KEY_EXT.match(member.name)
            if match is None:
                continue
            key, ext = match.group(1), match.group(2).lower()
            if not samples or samples[-1][0] != key:
                samples.append((key, {}))
            samples[-1][1][ext] = tar.extractfile(member).read()
    return samples


def webdataset_samples(path: Path) -> list[tuple[str, dict[str, bytes]]] | None:
    """The same through the webdataset package's tar iterator and grouping (None if absent)."""
    if wds_tariterators is None:
        return None
    with open(path, "rb") as f:
        files = ({**entry, "__url__": str(path)}
                 for entry in wds_tariterators.tar_file_iterator(f))
        return [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
                for s in wds_tariterators.group_by_keys(files)]


def reference_texts(path: Path, text_field: str = "txt") -> list[tuple[str, str]]:
    """(key, text) of every sample, by the reference readers (which must agree)."""
    samples = tarfile_samples(path)
    other = webdataset_samples(path)
    if other is not None:
        assert other == samples
    member, field = text_source(text_field)
    out = []
    for key, members in samples:
        data = members[member]
        out.append((key, json.loads(data)[field] if field else data.decode("utf-8")))
    return out


async def read_shard(path: Path, fmt: WebdatasetFormat | None = None, **options):
    """Read one shard as the fetcher does; its planned ranges must cover it in order."""
    return await formatcheck.read_shard(fmt or WebdatasetFormat(), path, order="contiguous",
                                        **options)


def sample_dicts(n: int, seed: int = 0) -> list[dict]:
    """Samples with a text, a JSON document, sometimes binary data (sizes around the 512-byte
    block), texts with multi-byte UTF-8, some empty."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "béta", "γάμμα", "日本語", "🙂", "x" * 50, "line\nbreak", ""]
    out = []
    for k in range(n):
        text = " ".join(words[int(i)] for i in rng.integers(0, len(words), int(rng.integers(0, 90))))
        sample = {"txt": text, "json": json.dumps({"text": text.upper(), "id": k})}
        if k % 3 == 0:
            sample["jpg"] = rng.integers(0, 256, int(rng.integers(0, 2000)), dtype=np.uint8).tobytes()
        if k % 4 == 1:
            sample["meta.json"] = json.dumps({"body": f"body {k}", "n": [1, 2]})
        out.append(sample)
    return out


def assert_records(records, expected: list[tuple[str, str]], indices=None):
    indices = list(range(len(expected))) if indices is None else indices
    assert [r.index for r in records] == indices
    assert [r.payload for r in records] == [expected[i][1] for i in indices]


# ------------------------------------------------------------------ reading shards


@pytest.mark.parametrize("name", ["a.tar", "a.tar.gz", "a.tgz"])
@pytest.mark.parametrize("tar_format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT,
                                        tarfile.USTAR_FORMAT])
# 7: a range boundary at every offset modulo the 512-byte block over a shard, inside every
# header and member (1 proved no more at 7x the ranges: 14 of the suite's seconds).
@pytest.mark.parametrize("chunk_bytes", [7, 100, 511, 512, 513, 5000, 1 << 20])
async def test_round_trip_against_tarfile(tmp_path, name, tar_format, chunk_bytes):
    samples = sample_dicts(30)
    keys = [f"dir{k % 2}/sub.d/{k:05d}" for k in range(30)]
    path = write_webdataset_shard(tmp_path / name, samples, keys=keys, format=tar_format)
    expected = reference_texts(path)
    assert [k for k, _ in expected] == keys
    assert_records(await read_shard(path, chunk_bytes=chunk_bytes), expected)


@pytest.mark.parametrize("text_field,make", [
    ("json.text", lambda s: json.loads(s["json"])["text"]),
    ("meta.json.body", None),
    ("JSON", lambda s: s["json"]),      # a whole member; extensions are matched lower-cased
])
async def test_text_fields(tmp_path, text_field, make):
    samples = sample_dicts(12, seed=1)
    if make is None:   # every sample needs the member: give it one
        samples = [{**s, "meta.json": json.dumps({"body": f"b{k}"})} for k, s in enumerate(samples)]
        make = lambda s: json.loads(s["meta.json"])["body"]   # noqa: E731
    path = write_webdataset_shard(tmp_path / "f.tar", samples)
    expected = reference_texts(path, text_field)
    assert [t for _, t in expected] == [make(s) for s in samples]
    for chunk_bytes in (7, 1 << 20):
        assert_records(await read_shard(path, WebdatasetFormat(text_field), chunk_bytes=chunk_bytes),
                       expected)


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, ">u4"])
async def test_tokens_field_reads_npy_members(tmp_path, dtype):
    rng = np.random.default_rng(8)
    arrays = [rng.integers(0, 50_000, int(n)).astype(dtype) for n in rng.integers(0, 700, 20)]
    samples = [{"txt": "text", "ids.npy": npy(a)} for a in arrays]
    path = write_webdataset_shard(tmp_path / "t.tar", samples)
    expected = [np.load(io.BytesIO(m["ids.npy"])) for _, m in tarfile_samples(path)]
    fmt = WebdatasetFormat(None, "ids.npy")
    for chunk_bytes in (100, 1 << 20):
        records = await read_shard(path, fmt, chunk_bytes=chunk_bytes)
        assert [r.index for r in records] == list(range(20))
        for r, ref in zip(records, expected):
            assert r.payload.dtype.isnative
            np.testing.assert_array_equal(r.payload, ref)
    lengths, _ = await fmt.document_lengths(FileStore(), info(path), problems=problems("t.tar"))
    assert lengths.tolist() == [a.size for a in arrays]


@pytest.mark.parametrize("data,message", [
    (npy(np.array([3, -1, 2])), "negative token id -1"),
    (npy(np.zeros((2, 2), np.int32)), r"must hold a 1-D integer array, found int32 \(2, 2\)"),
    (npy(np.zeros(3, np.float32)), "must hold a 1-D integer array, found float32"),
    (b"not npy", "is not a .npy array"),
])
async def test_tokens_field_bad_members(tmp_path, data, message):
    path = tar_of(tmp_path / "b.tar", [("0.ids", npy(np.arange(3))), ("1.ids", data),
                                       ("2.ids", npy(np.arange(2)))])
    with pytest.raises(DataError, match=rf"record 1: sample '1': member 'ids'.*{message}"):
        await read_shard(path, WebdatasetFormat(None, "ids"))
    skips = Skips()
    records = await read_shard(path, WebdatasetFormat(None, "ids"), skips=skips)
    assert [r.index for r in records] == [0, 2] and [i for i, _ in skips.calls] == [1]


def test_text_source_rule():
    assert text_source("txt") == ("txt", None)
    assert text_source("en.txt") == ("en.txt", None)
    assert text_source("json") == ("json", None)
    assert text_source("json.text") == ("json", "text")
    assert text_source("meta.json.body") == ("meta.json", "body")
    assert text_source("Json.Text") == ("json", "Text")
    assert WebdatasetFormat().text_field == "txt"


def add_member(tar: tarfile.TarFile, name: str, data: bytes = b"", kind=tarfile.REGTYPE) -> None:
    member = tarfile.TarInfo(name)
    member.type, member.mtime = kind, 0
    member.size = len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(member, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def conventions_tar(path: Path, tar_format=tarfile.PAX_FORMAT) -> None:
    """What WebDataset leaves out or groups: directories, links, metadata, names without an
    extension, upper-case extensions, a key that comes back later (a new sample), long names."""
    long_key = "deep/" + "d" * 120 + "/" + "k" * 150
    with tarfile.open(path, "w", format=tar_format) as tar:
        add_member(tar, "shard", kind=tarfile.DIRTYPE)
        add_member(tar, "__meta__", b"not a sample")
        add_member(tar, "__info__/x.txt", b"metadata too")
        add_member(tar, "shard/a.txt", "first".encode())
        add_member(tar, "shard/a.JSON", b"{}")
        add_member(tar, "shard/README", b"no extension")
        add_member(tar, "shard/link.txt", kind=tarfile.SYMTYPE)
        add_member(tar, "shard/b.TXT", "second ü".encode())
        add_member(tar, "shard/a.txt", "a again".encode())
        add_member(tar, f"{long_key}.txt", "long name".encode())
        add_member(tar, f"{long_key}.cls", b"3")
        add_member(tar, "shard/c.txt", b"")


@pytest.mark.parametrize("tar_format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
async def test_webdataset_conventions(tmp_path, tar_format):
    conventions_tar(tmp_path / "c.tar", tar_format)
    expected = reference_texts(tmp_path / "c.tar")
    assert [t for _, t in expected] == ["first", "second ü", "a again", "long name", ""]
    for chunk_bytes in (1, 300, 1 << 20):
        assert_records(await read_shard(tmp_path / "c.tar", chunk_bytes=chunk_bytes), expected)


@pytest.mark.skipif(shutil.which("tar") is None, reason="no tar command")
@pytest.mark.parametrize("tar_format", ["gnu", "posix", "ustar", "v7"])
async def test_archives_made_by_the_tar_command(tmp_path, tar_format):
    src = tmp_path / "src"
    samples = sample_dicts(20, seed=2)
    for k, sample in enumerate(samples):
        for ext, data in sample.items():
            target = src / "part" / f"{k:04d}.{ext}"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data.encode() if isinstance(data, str) else data)
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    path = tmp_path / f"{tar_format}.tar"
    subprocess.run(["tar", f"--format={tar_format}", "-cf", str(path), "-C", str(src), *names],
                   check=True)
    expected = reference_texts(path)
    assert len(expected) == 20
    for chunk_bytes in (333, 1 << 20):
        assert_records(await read_shard(path, chunk_bytes=chunk_bytes), expected)


async def test_large_members_are_passed_over_in_many_ranges(tmp_path):
    rng = np.random.default_rng(3)
    samples = [{"txt": f"text {k}", "bin": rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes()}
               for k in range(5)]
    path = write_webdataset_shard(tmp_path / "big.tar", samples)
    store = FileStore()
    records = await read_shard(path, chunk_bytes=4096, store=store)
    assert_records(records, reference_texts(path))
    assert len(store.reads) == -(-path.stat().st_size // 4096)


async def test_empty_archive(tmp_path):
    path = write_webdataset_shard(tmp_path / "e.tar", [])
    assert await read_shard(path) == []
    path = write_webdataset_shard(tmp_path / "e.tar.gz", [])
    assert await read_shard(path) == []


async def test_archive_without_end_blocks_is_read_like_tarfile_reads_it(tmp_path):
    path = write_webdataset_shard(tmp_path / "n.tar", sample_dicts(6, seed=4))
    expected = reference_texts(path)
    data = path.read_bytes().rstrip(b"\0")
    data += bytes(-len(data) % 512)            # the last member's padding stays
    path.write_bytes(data)
    assert reference_texts(path) == expected
    assert_records(await read_shard(path, chunk_bytes=1000), expected)


async def test_document_lengths_scan(tmp_path):
    path = write_webdataset_shard(tmp_path / "d.tar.gz", sample_dicts(25, seed=5))
    fmt = WebdatasetFormat()
    expected = [len(t.encode()) for _, t in reference_texts(path)]
    for limit in (None, 0, 3, 25, 99):
        lengths, method = await fmt.document_lengths(FileStore(), info(path),
                                                     problems=problems("d.tar.gz"),
                                                     limit=limit, chunk_bytes=777)
        assert lengths.tolist() == expected[:limit] and method == "scan"


# ------------------------------------------------------------------ detection


@pytest.mark.parametrize("uri,expected", [
    ("s3://b/wds/shard-000001.tar", True),
    ("/d/x.tar.gz", True),
    ("/d/x.TGZ", True),
    ("/d/x.tar.zst", False),
    ("/d/.tar", False),
    ("/d/x.tar.idx", False),
    ("/d/x.txt", False),
])
def test_matches(uri, expected):
    assert WebdatasetFormat().matches(uri) is expected
    assert isinstance(format_for(uri), WebdatasetFormat) is expected


# ------------------------------------------------------------------ bad input


def tar_of(path: Path, members: list[tuple[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz" if path.name.endswith("gz") else "w") as tar:
        for name, data in members:
            add_member(tar, name, data)
    return path


@pytest.mark.parametrize("members,fmt,bad,message", [
    ([("0.txt", b"ok"), ("1.json", b"{}"), ("1.jpg", b"x"), ("2.txt", b"fine")], "txt", 1,
     r"sample '1': no member with the extension 'txt' \(the sample has 'json', 'jpg'\); set "
     r"the source's text_field to the field that holds the text"),
    ([("0.txt", b"ok"), ("1.text", b"x"), ("2.txt", b"fine")], "txt", 1,
     r"sample '1': no member with the extension 'txt' \(the sample has 'text'\); did you mean "
     r"text_field='text'\?"),
    ([("0.txt", b"ok"), ("1.txt", b"\xff\xfe"), ("2.txt", b"fine")], "txt", 1,
     "sample '1': member 'txt' is not valid UTF-8"),
    ([("0.txt", b"ok"), ("1.txt", b"a"), ("1.txt", b"b"), ("2.txt", b"fine")], "txt", 1,
     r"sample '1': member '1.txt' repeats the extension 'txt'"),
    ([("0.json", b'{"text": "ok"}'), ("1.json", b'{"body": 1}'), ("2.json", b'{"text": "x"}')],
     "json.text", 1, "sample '1': member 'json': missing field 'text'; fields present: 'body'; "
     r"did you mean text_field='json.body'\?"),
    ([("0.json", b'{"text": "ok"}'), ("1.json", b'{"txt": "a", "id": 1}'),
      ("2.json", b'{"text": "x"}')], "json.text", 1,
     r"sample '1': member 'json': missing field 'text'; fields present: 'txt', 'id'; did you mean "
     r"text_field='json.txt'\?"),
    ([("0.json", b'{"text": "ok"}'), ("1.json", b'{"text": 5}'), ("2.json", b'{"text": "x"}')],
     "json.text", 1, r"sample '1': member 'json': field 'text' is not a string \(got int\)"),
    ([("0.json", b'{"text": "ok"}'), ("1.json", b'[1]'), ("2.json", b'{"text": "x"}')],
     "json.text", 1, r"sample '1': member 'json': not a JSON object \(got array\)"),
    ([("0.json", b'{"text": "ok"}'), ("1.json", b'{"text'), ("2.json", b'{"text": "x"}')],
     "json.text", 1, "sample '1': member 'json': invalid JSON"),
])
@pytest.mark.parametrize("name", ["bad.tar", "bad.tar.gz"])
async def test_bad_samples_are_record_errors(tmp_path, members, fmt, bad, message, name):
    path = tar_of(tmp_path / name, members)
    with pytest.raises(DataError, match=rf"source 'src', shard '{name}', record {bad}: {message}") \
            as err:
        await read_shard(path, WebdatasetFormat(fmt), chunk_bytes=100)
    assert (err.value.source, err.value.shard, err.value.record) == ("src", name, bad)
    skips = Skips()
    records = await read_shard(path, WebdatasetFormat(fmt), chunk_bytes=100, skips=skips)
    assert [r.index for r in records] == [0, 2]
    assert [i for i, _ in skips.calls] == [bad]


def corrupt_header(path: Path) -> str:
    data = bytearray(path.read_bytes())
    data[1536 + 10] ^= 0xFF   # the name in the second member's header
    path.write_bytes(bytes(data))
    return r"corrupt tar header at byte 1536 \(bad checksum\)"


def truncate(cut: int):
    def make(path: Path) -> str:
        path.write_bytes(path.read_bytes()[:cut])
        return "truncated"
    return make


# A ustar archive of three samples of one 600-byte member each: member k's header at 1536 k,
# its data in the two blocks after. A sample is complete when the next one starts, so the one
# being read when the damage shows is not delivered.
@pytest.mark.parametrize("damage,delivered", [
    (corrupt_header, 0),
    (truncate(1536 + 100), 0),            # inside the second member's header
    (truncate(3072 + 512 + 10), 2),       # inside the third member's data
])
async def test_damaged_tar_is_a_shard_error(tmp_path, damage, delivered):
    samples = [{"txt": f"{k}" * 600} for k in range(3)]
    path = write_webdataset_shard(tmp_path / "d.tar", samples, format=tarfile.USTAR_FORMAT)
    message = damage(path)
    with pytest.raises(DataError, match=rf"source 'src', shard 'd.tar': .*{message}") as err:
        await read_shard(path, chunk_bytes=700)
    assert err.value.record is None
    skips = Skips()
    records = await read_shard(path, chunk_bytes=700, skips=skips)
    assert [r.payload for r in records] == [f"{k}" * 600 for k in range(delivered)]
    assert len(skips.calls) == 1 and skips.calls[0][0] is None


async def test_cut_inside_the_end_blocks_is_no_damage(tmp_path):
    samples = [{"txt": f"{k}" * 600} for k in range(3)]
    path = write_webdataset_shard(tmp_path / "d.tar", samples, format=tarfile.USTAR_FORMAT)
    path.write_bytes(path.read_bytes()[:3 * 1536 + 100])
    assert [r.payload for r in await read_shard(path, chunk_bytes=700)] == \
        [t for _, t in reference_texts(path)]


async def test_damaged_gzip_is_a_shard_error(tmp_path):
    path = write_webdataset_shard(tmp_path / "g.tar.gz", sample_dicts(10, seed=6))
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(DataError, match="shard 'g.tar.gz': .*truncated"):
        await read_shard(path, chunk_bytes=200)
    path.write_bytes(data[:10] + bytes(b ^ 0x5A for b in data[10:40]) + data[40:])
    with pytest.raises(DataError, match="shard 'g.tar.gz': corrupt gzip data"):
        await read_shard(path, chunk_bytes=200)
    path.write_bytes(gzip.compress(b"not a tar archive at all" * 100))
    with pytest.raises(DataError, match="shard 'g.tar.gz': corrupt tar header at byte 0"):
        await read_shard(path)


# ------------------------------------------------------------------ through the Loader


def write_source(root: Path, shards: int = 3, per_shard: int = 30, seed: int = 0,
                 text_field: str = "txt") -> dict[str, np.ndarray]:
    """Shards under `root` (plain and gzip); {sample id: UTF-8 bytes} by the reference reader."""
    expected = {}
    for k in range(shards):
        name = f"shard-{k:04d}.tar" + (".gz" if k % 2 else "")
        path = write_webdataset_shard(root / name, sample_dicts(per_shard, seed=seed + k),
                                      keys=[f"s{k}/{j:05d}" for j in range(per_shard)])
        for d, (_, text) in enumerate(reference_texts(path, text_field)):
            if text:   # empty documents are counted, not delivered
                expected[f"wds/{name}/{d}"] = np.frombuffer(text.encode(), np.uint8).astype(np.int64)
    return expected


@pytest.mark.parametrize("text_field", [None, "json.text"])
def test_loader_delivers_every_sample_once(tmp_path, text_field):
    expected = write_source(tmp_path / "wds", text_field=text_field or "txt")
    with sl.Loader([sl.Source(str(tmp_path / "wds"), name="wds", text_field=text_field)],
                   micro_batch_tokens=1024, micro_batches=2, epochs=1, chunk_bytes=1500) as loader:
        steps, docs = collect(loader)
    ids = [i for step in steps for mb in step for i in mb[0]]
    assert len(ids) == len(set(ids))
    assert_delivered(docs, expected)


def test_loader_splits_long_samples(tmp_path):
    expected = write_source(tmp_path / "wds", shards=2, seed=7)
    with sl.Loader([sl.Source(str(tmp_path / "wds"), name="wds", format="webdataset")],
                   micro_batch_tokens=96, micro_batches=2, epochs=1, chunk_bytes=999) as loader:
        _, docs = collect(loader)
    assert_delivered(docs, expected)


def test_loader_over_s3(tmp_path, s3_bucket, storage_options):
    client, bucket = s3_bucket
    expected = write_source(tmp_path / "wds", shards=3, seed=10)
    for path in sorted((tmp_path / "wds").iterdir()):
        client.upload_file(str(path), bucket, f"corpus/wds/{path.name}")
    with sl.Loader([sl.Source(f"s3://{bucket}/corpus/wds/", name="wds")],
                   micro_batch_tokens=1024, micro_batches=2, epochs=1, chunk_bytes=2000,
                   storage_options=storage_options) as loader:
        _, docs = collect(loader)
        stats = loader.stats()
    assert_delivered(docs, expected)
    assert stats["sources"]["wds"]["requests"] > 3


@pytest.mark.parametrize("stop_after", [1, 3])
def test_exact_resume(tmp_path, stop_after):
    expected = write_source(tmp_path / "wds", shards=3, per_shard=30, seed=20)

    def loader():
        return sl.Loader([sl.Source(str(tmp_path / "wds"), name="wds")], micro_batch_tokens=512,
                         micro_batches=2, epochs=1, chunk_bytes=1200)

    with loader() as full_loader:
        full, docs = collect(full_loader)
        stats = full_loader.stats()
    assert_delivered(docs, expected)
    assert len(full) > stop_after + 2
    run = stop_and_resume(loader, stop_after, (full, stats))
    assert run.head + run.tail == run.full


def test_loader_sample_without_text_raises_or_skips(tmp_path):
    root = tmp_path / "wds"
    tar_of(root / "a.tar", [("0.txt", b"zero"), ("1.jpg", b"\x00"), ("2.txt", b"two")])
    with pytest.raises(DataError, match=r"source 'wds', shard 'a.tar', record 1: sample '1': "
                                        r"no member with the extension 'txt'"):
        with sl.Loader([sl.Source(str(root), name="wds")], micro_batch_tokens=64,
                       epochs=1) as loader:
            collect(loader)
    with sl.Loader([sl.Source(str(root), name="wds")], micro_batch_tokens=64, epochs=1,
                   on_error="skip") as loader:
        _, docs = collect(loader)
        stats = loader.stats()
    assert sorted(docs) == ["wds/a.tar/0", "wds/a.tar/2"]
    assert stats["sources"]["wds"]["skipped_records"] == 1
    assert "wds/a.tar/1: sample '1'" in stats["sources"]["wds"]["skip_reasons"][0]


def test_loader_reads_token_members(tmp_path):
    rng = np.random.default_rng(9)
    expected = {}
    for k in range(2):
        arrays = [rng.integers(0, 30_000, int(n)).astype(np.uint16)
                  for n in rng.integers(1, 400, 25)]
        path = write_webdataset_shard(tmp_path / "wds" / f"t{k}.tar",
                                      [{"ids.npy": npy(a), "txt": "unused"} for a in arrays])
        for d, (_, members) in enumerate(tarfile_samples(path)):
            expected[f"wds/t{k}.tar/{d}"] = np.load(io.BytesIO(members["ids.npy"])).astype(np.int64)
    with sl.Loader([sl.Source(str(tmp_path / "wds"), name="wds", tokens_field="ids.npy")],
                   micro_batch_tokens=256, micro_batches=2, epochs=1, chunk_bytes=3000) as loader:
        _, docs = collect(loader)
    assert_delivered(docs, expected)
