"""Bad input gets a clear error naming the source, the URI or shard, and the record."""
from __future__ import annotations

import gzip

import pytest

import streamload as sl
from streamload.formats import write_jsonl

pytestmark = pytest.mark.timeout(60)


def run(sources, **options):
    options.setdefault("micro_batch_tokens", 256)
    options.setdefault("micro_batches", 1)
    options.setdefault("epochs", 1)
    with sl.Loader(sources, **options) as loader:
        ids = [i for b in loader for mb in b.micro_batches for i in mb.sample_ids]
        return ids, loader.stats()


def test_missing_bucket_names_bucket_and_uri(s3_server, storage_options):
    with pytest.raises(sl.StorageError, match=r"no-such-bucket-x.*s3://no-such-bucket-x/web/"):
        run([sl.Source("s3://no-such-bucket-x/web/")], storage_options=storage_options)


def test_missing_prefix_names_source_and_uri(s3_bucket, storage_options):
    _, bucket = s3_bucket
    with pytest.raises(sl.StorageError, match=rf"s3://{bucket}/nothing-here/"):
        run([sl.Source(f"s3://{bucket}/nothing-here/", name="web")], storage_options=storage_options)


def test_no_local_files_match(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "README.txt").write_text("not a shard")
    with pytest.raises(sl.StorageError, match=r"source 'd'.*no shards match"):
        run([sl.Source(str(tmp_path / "d"))])
    with pytest.raises(sl.StorageError, match=r"\*\.jsonl"):
        run([sl.Source(str(tmp_path / "d" / "*.jsonl"))])


@pytest.fixture
def corrupt_source(tmp_path):
    path = tmp_path / "src" / "part-0.jsonl"
    path.parent.mkdir()
    path.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n{"text": "last"}\n')
    return tmp_path / "src"


def test_corrupt_record_raises_with_source_shard_record(corrupt_source):
    with pytest.raises(sl.DataError, match=r"source 'src'.*shard 'part-0.jsonl'.*record 2"):
        run([sl.Source(str(corrupt_source))])


def test_corrupt_record_skipped_and_counted(corrupt_source):
    ids, stats = run([sl.Source(str(corrupt_source))], on_error="skip")
    assert sorted(ids) == ["src/part-0.jsonl/0", "src/part-0.jsonl/1", "src/part-0.jsonl/3"]
    assert stats["sources"]["src"]["skipped_records"] == 1
    assert "src/part-0.jsonl/2" in stats["sources"]["src"]["skip_reasons"][0]


def test_missing_text_field(tmp_path):
    write_jsonl(tmp_path / "body.jsonl", ["a", "b"], text_field="body")
    with pytest.raises(sl.DataError, match=r"record 0.*'text'"):
        run([sl.Source(str(tmp_path / "body.jsonl"))])
    ids, _ = run([sl.Source(str(tmp_path / "body.jsonl"), text_field="body")])
    assert len(ids) == 2


def test_unreadable_shard_raises_or_is_skipped(tmp_path):
    (tmp_path / "z").mkdir()
    write_jsonl(tmp_path / "z" / "good.jsonl.gz", ["ok"] * 5, compression="gz")
    (tmp_path / "z" / "bad.jsonl.gz").write_bytes(b"this is not gzip at all" * 10)
    with pytest.raises(sl.DataError, match=r"shard 'bad.jsonl.gz'"):
        run([sl.Source(str(tmp_path / "z"))])
    ids, stats = run([sl.Source(str(tmp_path / "z"))], on_error="skip")
    assert len(ids) == 5
    assert stats["sources"]["z"]["skipped_shards"] == 1


def test_truncated_gzip_is_not_silently_short(tmp_path):
    data = gzip.compress(b"".join(b'{"text": "doc %d"}\n' % i for i in range(1000)))
    (tmp_path / "t.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(sl.DataError, match=r"t.jsonl.gz"):
        run([sl.Source(str(tmp_path / "t.jsonl.gz"))])


@pytest.mark.parametrize("weight", [-1, -0.5, float("nan"), float("inf"), "heavy"])
def test_bad_weight(weight):
    with pytest.raises(sl.ConfigError, match=r"source 'web'.*weight") as info:
        sl.Source("s3://bucket/web/", weight=weight)
    assert info.value.key == "weight"


def test_weight_zero_follows_the_mixture_rule(tmp_path):
    """A Source weight of 0 is allowed, as in a Mixture's weights: the source sits the mix out
    while the others have data, then drains; every document still comes once."""
    for name, count in (("main", 30), ("extra", 10)):
        (tmp_path / name).mkdir()
        write_jsonl(tmp_path / name / "a.jsonl", [f"{name} document {i}" for i in range(count)])
    ids, _ = run([sl.Source(str(tmp_path / "main")), sl.Source(str(tmp_path / "extra"), weight=0)],
                 micro_batch_tokens=64)
    assert sorted(ids) == sorted([f"main/a.jsonl/{i}" for i in range(30)]
                                 + [f"extra/a.jsonl/{i}" for i in range(10)])
    first_extra = min(k for k, i in enumerate(ids) if i.startswith("extra/"))
    assert first_extra >= 25   # only once main's window runs dry (about its last step)


def test_every_source_weight_zero_is_one_error(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["x"])
    write_jsonl(tmp_path / "b.jsonl", ["y"])
    with pytest.raises(sl.ConfigError, match=r"^sources: every source's weight is 0; at least "
                                             r"one must be positive") as info:
        run([sl.Source(str(tmp_path / "a.jsonl"), weight=0),
             sl.Source(str(tmp_path / "b.jsonl"), weight=0.0)])
    assert info.value.key == "sources"


@pytest.mark.parametrize("key,value", [("micro_batch_tokens", 0), ("micro_batch_tokens", -5),
                                       ("micro_batches", 0), ("epochs", 0)])
def test_bad_geometry(key, value):
    with pytest.raises(sl.ConfigError, match=key) as info:
        sl.Loader([sl.Source("/tmp/x")], **{key: value})
    assert info.value.key == key


def test_unknown_option_and_bad_choice():
    with pytest.raises(sl.ConfigError, match="unknown option"):
        sl.Loader([sl.Source("/tmp/x")], micro_batch_tokenz=5)
    with pytest.raises(sl.ConfigError, match="on_error"):
        sl.Loader([sl.Source("/tmp/x")], on_error="ignore")
    with pytest.raises(sl.ConfigError, match="names must be unique"):
        sl.Loader([sl.Source("/a/web/"), sl.Source("/b/web/")])


def test_one_shard_in_two_encodings_is_refused_unless_a_glob_picks_one(tmp_path):
    from streamload.formats import write_jsonl
    write_jsonl(tmp_path / "web" / "part-0.jsonl", ["a", "b"])
    write_jsonl(tmp_path / "web" / "part-0.jsonl.zst", ["a", "b"])
    write_jsonl(tmp_path / "web" / "part-1.jsonl", ["c"])
    with pytest.raises(sl.ConfigError, match=r"'part-0.jsonl' and 'part-0.jsonl.zst' hold the "
                                             r"same shard in two encodings") as info:
        with sl.Loader([sl.Source(str(tmp_path / "web"))], micro_batch_tokens=64) as loader:
            next(iter(loader))
    assert info.value.key == "uri"
    with sl.Loader([sl.Source(str(tmp_path / "web" / "*.jsonl"))], micro_batch_tokens=64,
                   epochs=1) as loader:
        ids = sorted(i for b in loader for mb in b.micro_batches for i in mb.sample_ids)
    assert ids == ["web/part-0.jsonl/0", "web/part-0.jsonl/1", "web/part-1.jsonl/0"]
