"""`streamload inspect` and `streamload plan` on every format: the detected format, the shards,
the record counts, and lengths that match what the Loader delivers (from the index where the
format has one)."""
from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest

import streamload as sl
from streamload.commands.cli import main
from test_format_litdata import litdata_root  # noqa: F401  (a fixture: litdata's own writer)

TEXTS = [f"document {i} " + "word " * (i * 37 % 300) for i in range(60)]
# MDS: a variable-shape ndarray column needs its samples read (the index gives sizes, not shapes).
FORMAT_METHOD = {"parquet": "scan", "megatron": "index", "webdataset": "scan", "mds": "scan"}


def write_parquet(root):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    for k in range(2):
        pq.write_table(pa.table({"text": TEXTS[k::2]}), root / f"part-{k}.parquet",
                       row_group_size=7)


def write_megatron(root):
    from streamload.formats.megatron import write_megatron_dataset
    for k in range(2):
        write_megatron_dataset(str(root / f"part-{k}"),
                               [np.frombuffer(t.encode(), np.uint8).astype(np.uint16)
                                for t in TEXTS[k::2]], np.uint16)


def write_webdataset(root):
    for k in range(2):
        with tarfile.open(root / f"shard-{k}.tar", "w") as tar:
            for i, text in enumerate(TEXTS[k::2]):
                data = text.encode()
                info = tarfile.TarInfo(f"{i:06d}.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def write_mds(root):
    """Token ids (fixed dtype) so the lengths come from the index."""
    from test_format_mds import reference
    MDSWriter, _ = reference()
    with MDSWriter(out=str(root), columns={"tokens": "ndarray:int32"}, size_limit=2000) as w:
        for text in TEXTS:
            w.write({"tokens": np.frombuffer(text.encode(), np.uint8).astype(np.int32)})


WRITERS = {"parquet": write_parquet, "megatron": write_megatron, "webdataset": write_webdataset,
           "mds": write_mds}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_inspect_and_plan_read_every_format(tmp_path, capsys, fmt):
    root = tmp_path / fmt
    root.mkdir()
    WRITERS[fmt](root)
    options = ["--tokens-field", "tokens"] if fmt == "mds" else []
    assert main(["inspect", str(root), "--json", *options]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == fmt
    assert report["records"] == len(TEXTS) and report["shards_listed"] >= 1
    lengths = sorted(len(t.encode()) for t in TEXTS)
    assert report["tokens"] == sum(lengths)
    # The Loader delivers the same documents.
    with sl.Loader([sl.Source(str(root), tokens_field="tokens" if fmt == "mds" else None)],
                   micro_batch_tokens=4096, micro_batches=2, epochs=1) as loader:
        delivered = sorted(int(n) for b in loader for mb in b.micro_batches
                           for n in np.diff(mb.cu_seqlens.numpy()))
    assert delivered == lengths
    config = tmp_path / "job.toml"
    field = '\ntokens_field = "tokens"' if fmt == "mds" else ""
    config.write_text(f'[loader]\nmicro_batch_tokens = 4096\nmicro_batches = 2\nepochs = 1\n'
                      f'[[source]]\nuri = "{root}"{field}\n')
    assert main(["plan", str(config), "--json", "--ranks", "2", "--steps", "50"]) == 0
    plan = json.loads(capsys.readouterr().out)
    scanned = plan["summary"]["scans"][0]
    assert scanned["format"] == fmt and scanned["documents"] == len(TEXTS)
    assert scanned["tokens"] == sum(lengths)
    assert scanned["method"] == FORMAT_METHOD[fmt]
    assert plan["summary"]["tokens"] == sum(lengths)   # the whole epoch fits in 50 steps


def test_inspect_and_plan_read_litdata(litdata_root, tmp_path, capsys):  # noqa: F811
    root = litdata_root[0] / "text_plain"   # written by litdata.optimize (test_format_litdata)
    assert main(["inspect", str(root), "--json", "--format", "litdata"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "litdata" and report["records"] > 0
    with sl.Loader([sl.Source(str(root), format="litdata")], micro_batch_tokens=1 << 16,
                   micro_batches=2, epochs=1) as loader:
        delivered = sum(mb.num_tokens for b in loader for mb in b.micro_batches)
    assert report["tokens"] == delivered
    config = tmp_path / "job.toml"
    config.write_text(f'[loader]\nmicro_batch_tokens = 65536\nepochs = 1\n'
                      f'[[source]]\nuri = "{root}"\nformat = "litdata"\n')
    assert main(["plan", str(config), "--json", "--ranks", "2", "--steps", "50"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["summary"]["scans"][0]["tokens"] == delivered
