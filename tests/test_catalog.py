"""A source's catalog (`formats.catalog`): objects of no known format are announced, not silently
left out, and `.json` files holding JSON Lines are read (issue 21, item 2). On local files and
on the moto S3 server."""
from __future__ import annotations

import asyncio
import bz2
import gzip
import json
import logging
import lzma
from pathlib import Path

import pytest

import streamload as sl
from streamload.commands.inspection import format_report, inspect_source
from streamload.formats.catalog import SNIFF_BYTES, catalog, is_json_lines
from streamload.storage import open_store

pytestmark = pytest.mark.timeout(60)

PER_FILE = 30


def lines(k: int) -> bytes:
    return b"".join(json.dumps({"text": f"file {k} document {i} " * 4}).encode() + b"\n"
                    for i in range(PER_FILE))


# The folder: one .jsonl, one .json holding JSON Lines (a Hugging Face name), one .bz2 and
# one .xz; with a JSON document beside them, an index and a hidden file (neither is reported).
FOLDER = {
    "part-000.jsonl": lines(0),
    "part-001.json": lines(1),
    "part-002.jsonl.bz2": bz2.compress(lines(2)),
    "part-003.jsonl.xz": lzma.compress(lines(3)),
    "part-004.json.gz": gzip.compress(lines(4), mtime=0),
    "dataset_info.json": json.dumps({"description": "a card", "splits": ["train"]}).encode(),
    "index.json": b'{"shards": []}',
    "_SUCCESS": b"",
}
READ = {"part-000.jsonl", "part-001.json", "part-004.json.gz"}


def write_folder(directory: Path) -> Path:
    directory.mkdir(parents=True)
    for name, data in FOLDER.items():
        (directory / name).write_bytes(data)
    return directory


def check_left_out(found) -> None:
    assert [s.name for s in found.shards] == sorted(READ)
    left = {o.name: o.hint for o in found.left_out}
    assert sorted(left) == ["dataset_info.json", "part-002.jsonl.bz2", "part-003.jsonl.xz"]
    assert left["part-002.jsonl.bz2"] == (".bz2 compression is not supported; recompress as "
                                          ".zst or .gz")
    assert left["part-003.jsonl.xz"].startswith(".xz compression is not supported")
    assert 'format="jsonl" reads .json files as JSON Lines' in left["dataset_info.json"]
    warning = found.warning()
    assert "3 object(s) of no format this source reads are left out" in warning
    assert "'part-002.jsonl.bz2'" in warning and "recompress as .zst or .gz" in warning
    assert "'dataset_info.json'" in warning


def run_loader(source: sl.Source, **options) -> list[str]:
    with sl.Loader([source], micro_batch_tokens=512, micro_batches=2, epochs=1,
                   **options) as loader:
        return [i for b in loader for mb in b.micro_batches for i in mb.sample_ids]


def test_a_local_folder_reads_json_lines_and_warns_of_the_rest(tmp_path, caplog):
    folder = write_folder(tmp_path / "data")
    check_left_out(asyncio.run(catalog(sl.Source(str(folder)), open_store(str(folder)))))
    caplog.set_level(logging.WARNING, logger="streamload")
    ids = run_loader(sl.Source(str(folder)))
    assert len(ids) == len(set(ids)) == len(READ) * PER_FILE
    assert {i.split("/")[1] for i in ids} == READ
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "left out" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "source 'data'" in warnings[0] and "3 object(s)" in warnings[0]
    assert "part-003.jsonl.xz" in warnings[0]


def test_an_s3_prefix_reads_json_lines_and_warns_of_the_rest(s3_bucket, storage_options, caplog):
    client, bucket = s3_bucket
    for name, data in FOLDER.items():
        client.put_object(Bucket=bucket, Key=f"data/{name}", Body=data)
    uri = f"s3://{bucket}/data/"

    async def listed():
        store = open_store(uri, storage_options)
        try:
            return await catalog(sl.Source(uri), store)
        finally:
            await store.aclose()

    check_left_out(asyncio.run(listed()))
    caplog.set_level(logging.WARNING, logger="streamload")
    ids = run_loader(sl.Source(uri), storage_options=storage_options)
    assert len(set(ids)) == len(READ) * PER_FILE
    assert any("recompress as .zst or .gz" in r.getMessage() for r in caplog.records)


def test_inspect_lists_what_is_left_out(tmp_path):
    folder = write_folder(tmp_path / "data")
    report = asyncio.run(inspect_source(str(folder)))
    assert report.shards_total == len(READ) and report.records == len(READ) * PER_FILE
    text = format_report(report, 4096)
    assert "3 object(s) left out, of no format this source reads:" in text
    assert "part-002.jsonl.bz2: .bz2 compression is not supported" in text
    assert [o["name"] for o in report.to_dict(4096)["left_out"]] == [
        "dataset_info.json", "part-002.jsonl.bz2", "part-003.jsonl.xz"]


def test_a_named_format_says_which_format_the_other_files_are(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    sl.formats.write_token_shard(folder / "a", [[1, 2, 3], [4, 5]])
    (folder / "b.jsonl").write_bytes(lines(0))
    found = asyncio.run(catalog(sl.Source(str(folder), format="tokens"), open_store(str(folder))))
    assert [s.name for s in found.shards] == ["a.tokens.npy"]
    assert [(o.name, o.hint) for o in found.left_out] == [
        ("b.jsonl", "jsonl files; this source reads format='tokens' only (a source per format "
                    "reads both)")]


def test_a_folder_with_nothing_left_out_says_nothing(tmp_path, caplog):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(lines(0))
    caplog.set_level(logging.WARNING, logger="streamload")
    assert len(run_loader(sl.Source(str(folder)))) == PER_FILE
    assert not [r for r in caplog.records if "left out" in r.getMessage()]


@pytest.mark.parametrize("start,expected", [
    (b'{"text": "a"}\n{"text": "b"}\n', True),
    (b'\xef\xbb\xbf{"text": "a"}', True),                     # one line, a byte order mark
    (b'{"body": "a"}\n', False),                               # no text field
    (b'{"text": 3}\n', False),                                 # not a string
    (b'[{"text": "a"}]', False),                               # a JSON document, an array
    (b'{\n  "text": "pretty-printed"\n}\n', False),            # a JSON document over lines
    (b'{"text": "' + b"x" * SNIFF_BYTES, True),                # a first line longer than read
    (b'{"id": 1, "text": "' + b"x" * SNIFF_BYTES, False),      # ... whose first key is another
])
def test_json_lines_are_told_from_a_json_document(start, expected):
    assert is_json_lines(start[:SNIFF_BYTES], "text") is expected
