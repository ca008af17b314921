"""Single-process loader behaviour: local and S3 sources, exactly-once, determinism, packing."""
from __future__ import annotations

import numpy as np
import pytest

import streamload as sl
from streamload import pieces
from corpus import base_ids, upload_dir, write_jsonl_source, write_token_source

pytestmark = pytest.mark.timeout(60)


def collect(loader):
    batches = list(loader)
    ids = [i for b in batches for mb in b.micro_batches for i in mb.sample_ids]
    return batches, ids


@pytest.fixture
def local_corpus(tmp_path):
    ids = write_jsonl_source(tmp_path, "web", shards=4, per_shard=60, compression="zst", seed=1)
    ids |= write_jsonl_source(tmp_path, "code", shards=3, per_shard=40, median=600, compression="gz", seed=2)
    ids |= write_token_source(tmp_path, "math", shards=2, per_shard=30, seed=3)
    return tmp_path, ids


def sources(root, web_weight=0.5):
    return [sl.Source(str(root / "web"), weight=web_weight),
            sl.Source(str(root / "code" / "*.jsonl.gz"), weight=0.3),
            sl.Source(f"file://{root / 'math'}/", weight=0.2)]


def test_one_epoch_delivers_every_sample_exactly_once(local_corpus):
    root, expected = local_corpus
    with sl.Loader(sources(root), micro_batch_tokens=1024, micro_batches=3, epochs=1) as loader:
        batches, ids = collect(loader)
        stats = loader.stats()
    assert len(ids) == len(set(ids)), "a sample was delivered twice"
    assert set(base_ids(ids)) == expected
    # Every split document arrives whole: pieces 0..k-1, each once (a piece cut to fill a row
    # arrives as ":k" and ":k+offset" parts).
    chunks: dict[str, set[int]] = {}
    for i in ids:
        doc, k, _ = pieces.parse(i)
        if k >= 0:
            chunks.setdefault(doc, set()).add(k)
    assert chunks, "the corpus should contain documents longer than a row"
    for base, ks in chunks.items():
        assert sorted(ks) == list(range(len(ks))), base
    assert [b.step for b in batches] == list(range(len(batches)))
    assert stats["sources"]["web"]["delivered_samples"] + stats["sources"]["code"]["delivered_samples"] \
        + stats["sources"]["math"]["delivered_samples"] == len(ids)


def test_rows_respect_capacity_and_metadata_is_consistent(local_corpus):
    root, _ = local_corpus
    with sl.Loader(sources(root), micro_batch_tokens=512, micro_batches=2, epochs=1) as loader:
        for batch in loader:
            assert len(batch.micro_batches) == 2
            for mb in batch.micro_batches:
                assert mb.num_tokens <= 512
                assert mb.tokens.dtype == np.int64 or str(mb.tokens.dtype) == "torch.int64"
                cu = mb.cu_seqlens.numpy()
                assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == mb.num_tokens
                assert len(cu) == len(mb.sample_ids) + 1
                pos = mb.position_ids.numpy()
                for start, end in zip(cu[:-1], cu[1:]):
                    assert (pos[start:end] == np.arange(end - start)).all()
                assert mb.max_seqlen == (int(np.diff(cu).max()) if len(cu) > 1 else 0)


def test_tokens_are_the_documents_bytes(tmp_path):
    from streamload.formats import write_jsonl
    docs = ["héllo wörld", "second doc", "x" * 50]
    write_jsonl(tmp_path / "a.jsonl", docs)
    with sl.Loader([sl.Source(str(tmp_path / "a.jsonl"))], micro_batch_tokens=64,
                   micro_batches=1, epochs=1) as loader:
        got = {}
        for b in loader:
            mb = b.micro_batches[0]
            cu = mb.cu_seqlens.numpy()
            for k, sid in enumerate(mb.sample_ids):
                got[sid] = bytes(mb.tokens.numpy()[cu[k]:cu[k + 1]].astype(np.uint8)).decode()
    assert got == {f"a/a.jsonl/{i}": d for i, d in enumerate(docs)}


def fingerprint(batches):
    return [[(tuple(mb.sample_ids), mb.tokens.sum().item()) for mb in b.micro_batches] for b in batches]


def test_same_seed_same_batches_different_seed_different_order(local_corpus):
    root, _ = local_corpus
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        with sl.Loader(sources(root), micro_batch_tokens=1024, micro_batches=2, epochs=1,
                       seed=seed, shard_prefetch=3, chunk_bytes=4096) as loader:
            runs[name] = fingerprint(list(loader))
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]


def test_epochs_reshuffle_and_repeat(local_corpus):
    root, expected = local_corpus
    with sl.Loader(sources(root), micro_batch_tokens=1024, micro_batches=2, epochs=2) as loader:
        batches, _ = collect(loader)
    by_epoch = {0: [], 1: []}
    for b in batches:
        by_epoch[b.epoch] += [i for mb in b.micro_batches for i in mb.sample_ids]
    for epoch in (0, 1):
        assert sorted(by_epoch[epoch]) == sorted(set(by_epoch[epoch]))
        assert set(base_ids(by_epoch[epoch])) == expected
    assert by_epoch[0] != by_epoch[1], "the second epoch should be reshuffled"


def test_infinite_epochs_keep_going(local_corpus):
    root, expected = local_corpus
    with sl.Loader(sources(root), micro_batch_tokens=4096, micro_batches=2, epochs=None) as loader:
        seen = 0
        epochs = set()
        for batch in loader:
            seen += sum(len(mb.sample_ids) for mb in batch.micro_batches)
            epochs.add(batch.epoch)
            if seen > 2.5 * len(expected):
                break
    assert epochs >= {0, 1, 2}


def test_weights_are_followed_by_tokens(tmp_path):
    write_jsonl_source(tmp_path, "a", shards=2, per_shard=400, median=100, seed=1)
    write_jsonl_source(tmp_path, "b", shards=2, per_shard=400, median=100, seed=2)
    with sl.Loader([sl.Source(str(tmp_path / "a"), weight=3), sl.Source(str(tmp_path / "b"), weight=1)],
                   micro_batch_tokens=1024, micro_batches=2, epochs=1) as loader:
        tokens = {"a": 0, "b": 0}
        for step, batch in enumerate(loader):
            for mb in batch.micro_batches:
                cu = mb.cu_seqlens.numpy()
                for k, sid in enumerate(mb.sample_ids):
                    tokens[sid.split("/")[0]] += int(cu[k + 1] - cu[k])
            if step == 20:
                break
    share = tokens["a"] / (tokens["a"] + tokens["b"])
    assert abs(share - 0.75) < 0.03, tokens


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_long_document_policies(tmp_path, policy):
    from streamload.formats import write_jsonl
    write_jsonl(tmp_path / "d.jsonl", ["a" * 10, "b" * 300, "c" * 20])
    with sl.Loader([sl.Source(str(tmp_path / "d.jsonl"))], micro_batch_tokens=100, micro_batches=1,
                   epochs=1, long_documents=policy) as loader:
        _, ids = collect(loader)
        stats = loader.stats()["sources"]["d"]
    if policy == "truncate":
        assert sorted(ids) == ["d/d.jsonl/0", "d/d.jsonl/1", "d/d.jsonl/2"]
        assert stats["truncated_documents"] == 1
    else:
        assert sorted(ids) == ["d/d.jsonl/0", "d/d.jsonl/2"]
        assert stats["dropped_documents"] == 1


def test_custom_tokenizer(tmp_path):
    from streamload.formats import write_jsonl
    write_jsonl(tmp_path / "t.jsonl", ["one two three", "four five"])
    vocab = {}

    def words(text):
        return [vocab.setdefault(w, len(vocab) + 1000) for w in text.split()]

    with sl.Loader([sl.Source(str(tmp_path / "t.jsonl"))], micro_batch_tokens=16, micro_batches=1,
                   epochs=1, tokenizer=words) as loader:
        (batch,) = list(loader)
    assert batch.micro_batches[0].num_tokens == 5
    assert batch.micro_batches[0].tokens.min().item() >= 1000


def test_s3_and_local_sources_together(tmp_path, s3_bucket, storage_options):
    client, bucket = s3_bucket
    s3_ids = write_jsonl_source(tmp_path / "s3", "web", shards=3, per_shard=50, compression="zst")
    upload_dir(client, bucket, tmp_path / "s3" / "web", "corpus/web")
    local_ids = write_token_source(tmp_path, "math", shards=2, per_shard=20)
    with sl.Loader([sl.Source(f"s3://{bucket}/corpus/web/", weight=0.7),
                    sl.Source(str(tmp_path / "math" / "*.tokens.npy"), weight=0.3)],
                   micro_batch_tokens=1024, micro_batches=2, epochs=1,
                   storage_options=storage_options, chunk_bytes=2048) as loader:
        _, ids = collect(loader)
        stats = loader.stats()
    assert len(ids) == len(set(ids))
    assert set(base_ids(ids)) == s3_ids | local_ids
    assert stats["sources"]["web"]["bytes_fetched"] > 0
    assert stats["sources"]["web"]["requests"] >= 3


def word_tokenizer(text):
    """A pure-Python tokenizer (holds the GIL); module-level so processes can use it."""
    return [len(w) for w in text.split()]


def test_tokenizing_in_processes_gives_the_same_batches(tmp_path):
    write_jsonl_source(tmp_path, "a", shards=3, per_shard=50, seed=4)
    runs = []
    for where in ("threads", "processes"):
        with sl.Loader([sl.Source(str(tmp_path / "a"))], micro_batch_tokens=256, epochs=1,
                       tokenizer=word_tokenizer, tokenize_in=where, tokenizer_processes=2) as loader:
            runs.append(fingerprint(list(loader)))
    assert runs[0] == runs[1] and runs[0]


def test_repeat_and_stop_policies(tmp_path):
    small = write_jsonl_source(tmp_path, "small", shards=2, per_shard=20, seed=7)
    big = write_jsonl_source(tmp_path, "big", shards=4, per_shard=200, seed=8)
    # repeat=3: every sample of "small" three times per epoch, "big" once.
    with sl.Loader([sl.Source(str(tmp_path / "small"), repeat=3), sl.Source(str(tmp_path / "big"))],
                   micro_batch_tokens=1024, epochs=1) as loader:
        _, ids = collect(loader)
    from collections import Counter
    counts = Counter(ids)   # by sample (a chunk of a split document is its own sample)
    assert set(base_ids(ids)) == small | big
    assert all(n == 3 for i, n in counts.items() if i.startswith("small/"))
    assert all(n == 1 for i, n in counts.items() if i.startswith("big/"))
    # on_exhausted="stop": the run ends when "small" runs out, before "big" does.
    with sl.Loader([sl.Source(str(tmp_path / "small"), weight=1, on_exhausted="stop"),
                    sl.Source(str(tmp_path / "big"), weight=1)],
                   micro_batch_tokens=1024, epochs=None) as loader:
        _, ids = collect(loader)
    assert set(i for i in base_ids(ids) if i.startswith("small/")) == small
    assert len([i for i in ids if i.startswith("big/")]) < len(big)


def test_mixture_schedule_from_a_config_file(tmp_path):
    write_jsonl_source(tmp_path, "a", shards=2, per_shard=300, median=100, seed=1)
    write_jsonl_source(tmp_path, "b", shards=2, per_shard=300, median=100, seed=2)
    config = tmp_path / "job.toml"
    config.write_text(f"""
[loader]
micro_batch_tokens = 1024
micro_batches = 2
epochs = 1

[mixture]
interpolate = "step"
[[mixture.schedule]]
at = 0
weights = {{ a = 0.9, b = 0.1 }}
[[mixture.schedule]]
at = 10
weights = {{ a = 0.1, b = 0.9 }}

[[source]]
name = "a"
uri = "{tmp_path / 'a'}"
[[source]]
name = "b"
uri = "{tmp_path / 'b'}"
""")
    shares = []
    with sl.Loader.from_config(config) as loader:
        for batch in loader:
            tokens = {"a": 0, "b": 0}
            for mb in batch.micro_batches:
                cu = mb.cu_seqlens.numpy()
                for k, sid in enumerate(mb.sample_ids):
                    tokens[sid.split("/")[0]] += int(cu[k + 1] - cu[k])
            shares.append(tokens["a"] / max(1, tokens["a"] + tokens["b"]))
            if batch.step == 19:
                break
    assert np.mean(shares[1:10]) > 0.8 and np.mean(shares[11:20]) < 0.2, shares


def test_sample_cost_hook_reaches_the_plan(tmp_path):
    write_jsonl_source(tmp_path, "text", shards=2, per_shard=100, seed=11)
    write_jsonl_source(tmp_path, "images", shards=2, per_shard=100, seed=12)
    per_image = 5000.0

    def run(sample_costs):
        with sl.Loader([sl.Source(str(tmp_path / "text")), sl.Source(str(tmp_path / "images"))],
                       micro_batch_tokens=1024, epochs=1, sample_costs=sample_costs) as loader:
            batch = next(iter(loader))
            images = sum(i.startswith("images/") for mb in batch.micro_batches for i in mb.sample_ids)
            return float(batch.rank_cost.sum()), images

    plain, _ = run(None)
    with_hook, images = run({"images": lambda lengths: np.full(lengths.shape, per_image)})
    assert images > 0
    assert with_hook == pytest.approx(plain + images * per_image, rel=0.2)
    with pytest.raises(sl.ConfigError, match="no source named"):
        sl.Loader([sl.Source(str(tmp_path / "text"))], sample_costs={"video": len})
