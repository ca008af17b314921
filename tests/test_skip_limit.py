"""on_error="skip" with a limit (issue 21, item 3): a source that skips everything, or more than
`max_skip_fraction` of its records, raises a DataError naming the source, the count and the first
error, instead of training on the other sources (or nothing) in silence; skips show in
`summary()` and in the step records."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import zstandard

import streamload as sl
from distributed import run_ranks
from streamload.formats import write_jsonl
from streamload.pipeline.skips import SKIP_LIMIT_RECORDS

pytestmark = pytest.mark.timeout(60)


def texts(n: int, tag: str = "doc") -> list[str]:
    return [f"{tag} {i} " * 5 for i in range(n)]


def folder(root: Path, name: str, shards: int, per_shard: int) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    for k in range(shards):
        write_jsonl(directory / f"part-{k}.jsonl", texts(per_shard, f"{name} {k}"))
    return directory


def run(sources, **options):
    options.setdefault("micro_batch_tokens", 256)
    options.setdefault("micro_batches", 2)
    options.setdefault("epochs", 1)
    records = []
    with sl.Loader(sources, on_step=records.append, **options) as loader:
        ids = [i for b in loader for mb in b.micro_batches for i in mb.sample_ids]
        return ids, loader.stats(), loader.summary(), records


def test_a_misspelt_text_field_stops_the_source_after_its_first_records(tmp_path):
    """The issue's run: text_field="body" on a folder of "text" records, next to a good source
    at 0.9/0.1. It trained 170 steps on the good source and said nothing."""
    short = folder(tmp_path, "short", shards=3, per_shard=80)
    good = folder(tmp_path, "good", shards=2, per_shard=200)
    with pytest.raises(sl.DataError) as caught:
        run([sl.Source(str(good), weight=0.9),
             sl.Source(str(short), weight=0.1, text_field="body")], on_error="skip")
    message = str(caught.value)
    assert caught.value.source == "short"
    first = re.match(r"source 'short': on_error='skip' skipped all of the first (\d+) "
                     r"record\(s\) it read \(this rank", message)
    assert first and SKIP_LIMIT_RECORDS <= int(first.group(1)) <= 240, message
    assert "missing field 'body'; fields present: 'text'; did you mean text_field='text'?" \
        in message
    assert "The first error: shard 'part-" in message and "max_skip_fraction=1.0" in message
    assert "set on_error=\"skip\"" not in message   # it is on: no hint to turn it on


def test_a_small_source_skipping_everything_fails_at_the_end_of_its_epoch(tmp_path):
    short = folder(tmp_path, "short", shards=1, per_shard=30)
    with pytest.raises(sl.DataError, match=r"source 'short': on_error='skip' skipped every one of "
                                           r"the 30 record\(s\) it read"):
        run([sl.Source(str(short), text_field="body")], on_error="skip")


def test_more_than_the_share_of_skips_raises_and_a_higher_share_accepts_it(tmp_path):
    web = tmp_path / "web"
    web.mkdir()
    lines = [json.dumps({"text": t}) if i % 5 else json.dumps({"body": t})   # 1 in 5 is bad
             for i, t in enumerate(texts(300))]
    (web / "a.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(sl.DataError, match=r"source 'web': on_error='skip' skipped (\d+) of the "
                                           r"(\d+) records it read, more than "
                                           r"max_skip_fraction=0\.1") as caught:
        run([sl.Source(str(web))], on_error="skip")
    assert "The first error: shard 'a.jsonl', record 0: missing field 'text'" in str(caught.value)
    ids, stats, summary, records = run([sl.Source(str(web))], on_error="skip",
                                       max_skip_fraction=0.25)
    assert len(ids) == 240 and stats["sources"]["web"]["skipped_records"] == 60
    assert "skipped (on_error='skip'): web 60 record(s), 0 shard(s) (first: shard 'a.jsonl', " \
           "record 0: missing field 'text'" in summary
    assert records[-1]["skipped_records/web"] == 60 and records[-1]["skipped_shards/web"] == 0
    assert [r["skipped_records/web"] for r in records] == \
        sorted(r["skipped_records/web"] for r in records)   # running totals


def test_every_shard_skipped_raises(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for k in range(2):
        (bad / f"part-{k}.jsonl.zst").write_bytes(b"\x00\x01\x02\x03 not a zstd frame")
    with pytest.raises(sl.DataError, match=r"source 'bad': on_error='skip' skipped every one of "
                                           r"the 2 shard\(s\) it read.*The first error: "
                                           r"shard 'part-0.jsonl.zst': corrupt zstd data"):
        run([sl.Source(str(bad))], on_error="skip")


def test_a_limit_of_one_counts_every_skip_and_raises_none(tmp_path):
    short = folder(tmp_path, "short", shards=2, per_shard=80)
    good = folder(tmp_path, "good", shards=1, per_shard=50)
    ids, stats, summary, records = run(
        [sl.Source(str(good)), sl.Source(str(short), text_field="body")], on_error="skip",
        max_skip_fraction=1.0)
    assert len(ids) == 50
    assert stats["sources"]["short"]["skipped_records"] == 160
    assert stats["sources"]["short"]["records"] == 0
    assert "short 160 record(s), 0 shard(s) (first: shard 'part-" in summary
    assert "good" not in summary.split("skipped (on_error='skip'):")[1].split("\n")[0]
    assert records[-1]["skipped_records/short"] == 160 and records[-1]["skipped_records/good"] == 0


def test_a_few_bad_records_stay_under_the_limit(tmp_path):
    web = folder(tmp_path, "web", shards=2, per_shard=100)
    with open(web / "part-0.jsonl", "a") as f:
        f.write("{not json\n" * 5)
    ids, stats, summary, _ = run([sl.Source(str(web))], on_error="skip")
    assert len(ids) == 200 and stats["sources"]["web"]["skipped_records"] == 5
    assert stats["sources"]["web"]["first_skip"].startswith("shard 'part-0.jsonl', record 100: "
                                                            "invalid JSON")


@pytest.mark.parametrize("value,problem", [
    (-0.1, "must be a number in 0..1"), (1.5, "must be a number in 0..1"),
    (float("nan"), "must be a number in 0..1"), ("a lot", "Expected float, got str"),
])
def test_max_skip_fraction_is_checked(tmp_path, value, problem):
    with pytest.raises(sl.ConfigError, match=rf"^max_skip_fraction: {problem}") as caught:
        sl.Loader([sl.Source(str(tmp_path))], max_skip_fraction=value)
    assert caught.value.key == "max_skip_fraction"


def skip_job(rank, world, root):
    try:
        with sl.Loader([sl.Source(str(Path(root) / "good")),
                        sl.Source(str(Path(root) / "short"), text_field="body")],
                       micro_batch_tokens=256, micro_batches=2, epochs=1,
                       on_error="skip") as loader:
            return [i for b in loader for mb in b.micro_batches for i in mb.sample_ids]
    except sl.StreamloadError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_the_limit_fails_the_job_on_every_rank(tmp_path):
    """The rank that reads the skipped shards raises; the others do not hang."""
    folder(tmp_path, "short", shards=2, per_shard=120)
    folder(tmp_path, "good", shards=2, per_shard=200)
    results = run_ranks(skip_job, 2, str(tmp_path), timeout=60)
    assert all(isinstance(r, str) for r in results), results
    assert any("source 'short': on_error='skip' skipped all of the first" in r
               for r in results), results
