"""on_exhausted="restart": an endless source, pass after pass, upsampled to its weight while the
finite sources define the epoch; exact and elastic resume through its passes."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import pytest

import streamload as sl
from streamload import pieces
from corpus import base_ids, write_jsonl_source
from distributed import run_ranks
from resumecheck import flat, resume_divergence
from streamload.formats import write_jsonl
from streamload.state import SourceTracker, fresh_layout

pytestmark = pytest.mark.timeout(180)


def make_corpus(root: Path):
    small = write_jsonl_source(root, "small", shards=3, per_shard=15, median=120, seed=7)
    big = write_jsonl_source(root, "big", shards=4, per_shard=120, median=120, seed=8)
    return small, big


def loader_for(root, **kw):
    kw.setdefault("micro_batch_tokens", 1024)
    kw.setdefault("micro_batches", 2)
    kw.setdefault("epochs", 1)
    kw.setdefault("chunk_bytes", 4096)
    return sl.Loader([sl.Source(str(Path(root) / "small"), weight=0.5, on_exhausted="restart"),
                      sl.Source(str(Path(root) / "big"), weight=0.5)], **kw)


def piece_tokens(batches, prefix, epoch=None) -> Counter:
    """Tokens delivered per (document, piece) of the ids starting with `prefix`."""
    out = Counter()
    for b in batches:
        if epoch is not None and b.epoch != epoch:
            continue
        for mb in b.micro_batches:
            bounds = mb.cu_seqlens.tolist()
            for sid, lo, hi in zip(mb.sample_ids, bounds, bounds[1:]):
                if sid.startswith(prefix):
                    doc, k, _ = pieces.parse(sid)
                    out[(doc, k)] += hi - lo
    return out


def token_share(batches, prefix):
    tokens = Counter()
    for b in batches:
        for mb in b.micro_batches:
            bounds = mb.cu_seqlens.tolist()
            for sid, lo, hi in zip(mb.sample_ids, bounds, bounds[1:]):
                tokens[sid.split("/", 1)[0]] += hi - lo
    return tokens[prefix] / sum(tokens.values())


def test_restart_source_is_upsampled_to_its_weight_while_the_finite_one_sets_the_epoch(tmp_path):
    small, big = make_corpus(tmp_path)
    with loader_for(tmp_path, epochs=2) as loader:
        batches = list(loader)
        stats = loader.stats()
    ids = [i for b in batches for mb in b.micro_batches for i in mb.sample_ids]
    counts = Counter(ids)   # by sample: a chunk of a split document is its own sample
    # The finite source: every sample once per epoch, two epochs.
    assert {i for i in base_ids(counts) if i.startswith("big/")} == big
    # Twice each, by tokens: a piece cut to fill a row arrives in parts, cut where it fell.
    both, first = piece_tokens(batches, "big/"), piece_tokens(batches, "big/", epoch=0)
    assert both.keys() == first.keys() and all(both[k] == 2 * n for k, n in first.items())
    # The endless one: read pass after pass, never running out, every sample about as often
    # as the others. When the run ends, a sample can be behind by what the buffer holds
    # unoffered (about a pass here: two windows and a row of a source with ~7 steps a pass)
    # plus the deferral bound (max_deferral = 8 steps, another pass or so).
    assert {i for i in base_ids(counts) if i.startswith("small/")} == small
    passes = [n for i, n in counts.items() if i.startswith("small/")]
    assert min(passes) >= 5 and max(passes) - min(passes) <= 3, sorted(Counter(passes).items())
    # The mix holds while both sources have data; as the finite one runs short at the end of
    # its epoch, the endless one fills the steps (full steps), above its weight.
    for epoch in (0, 1):
        steps = [b for b in batches if b.epoch == epoch]
        body, tail = steps[:int(0.9 * len(steps))], steps[int(0.9 * len(steps)):]
        assert abs(token_share(body, "small") - 0.5) < 0.02
        assert token_share(tail, "small") > 0.5
    assert stats["sources"]["small"]["shards_read"] >= 5 * 3
    assert {b.epoch for b in batches} == {0, 1}


def test_a_restart_source_keeps_its_stream_across_epochs(tmp_path):
    """The finite source's epoch boundary does not rewind the endless one."""
    make_corpus(tmp_path)
    with loader_for(tmp_path, epochs=2) as loader:
        batches = list(loader)
    by_epoch = [[i for b in batches if b.epoch == e for mb in b.micro_batches
                 for i in mb.sample_ids if i.startswith("small/")] for e in (0, 1)]
    assert by_epoch[1][:10] != by_epoch[0][:10]


@pytest.mark.parametrize("stop_after", [3, 17, 40])
def test_resume_through_passes_and_epochs_is_identical(tmp_path, stop_after):
    make_corpus(tmp_path)
    with loader_for(tmp_path, epochs=2) as loader:
        full = [flat(b) for b in loader]
    assert len(full) > 45
    with loader_for(tmp_path, epochs=2) as loader:
        head = [flat(b) for _, b in zip(range(stop_after), loader)]
        state = loader.state_dict()
    blob = msgspec.json.encode(state)
    assert len(blob) < 16_000, len(blob)
    with loader_for(tmp_path, epochs=2) as loader:
        loader.load_state_dict(msgspec.json.decode(blob))
        tail = [flat(b) for b in loader]
    assert head + tail == full


def resume_job(rank, world, root, stops):
    return resume_divergence(lambda: loader_for(root, micro_batch_tokens=512, seed=3), stops)


def test_two_rank_resume_with_a_restart_source_is_identical(tmp_path):
    make_corpus(tmp_path)
    results = run_ranks(resume_job, 2, str(tmp_path), [4, 19, 33])
    for steps, diverged in results:
        assert steps > 33 and not diverged, diverged


def segment_job(rank, world, root, stop_after, state):
    with loader_for(root) as loader:
        if state is not None:
            loader.load_state_dict(state)
        ids = []
        for steps, batch in enumerate(loader, 1):
            ids += [i for mb in batch.micro_batches for i in mb.sample_ids]
            if stop_after is not None and steps == stop_after:
                break
        return ids, loader.state_dict()


@pytest.mark.parametrize("worlds", [(2, 3), (2, 1)])
def test_elastic_resume_keeps_the_finite_source_exactly_once(tmp_path, worlds):
    small, big = make_corpus(tmp_path)
    first, second = worlds
    part1 = run_ranks(segment_job, first, str(tmp_path), 9, None)
    assert len({msgspec.json.encode(s) for _, s in part1}) == 1
    state = part1[0][1]
    if second == 1:
        part2 = [segment_job(0, 1, str(tmp_path), None, state)]
    else:
        part2 = run_ranks(segment_job, second, str(tmp_path), None, state)
    ids = [i for ids, _ in part1 + part2 for i in ids]
    big_ids = [i for i in ids if i.startswith("big/")]
    assert len(big_ids) == len(set(big_ids)) and set(base_ids(big_ids)) == big
    passes = Counter(i for i in ids if i.startswith("small/"))
    assert set(base_ids(passes)) == small
    # Each rank reads whole passes of its own shares, at its own pace: a few passes apart.
    n = sorted(passes.values())
    assert n[-1] - n[0] <= max(3, 0.4 * np.mean(n)), n


def test_tracker_extends_an_endless_layout_pass_by_pass():
    layout = fresh_layout(3, seed=0, epoch=0, source_index=0, world=2, endless=True)
    # pass p deals pass-wide shard ids p*3 + shard, rotating which rank starts.
    stream = layout.stream(1)
    first = [next(stream).shard for _ in range(6)]
    assert all(0 <= s < 3 for s in first[:len(layout.base[1])])
    assert first == sorted(first, key=lambda s: s // 3) and first[-1] >= 3
    tracker = SourceTracker(layout)
    later = first[-1]
    ids = np.array([[later, 0, -1]])
    tracker.observe(1, ids, np.zeros(1, np.int64), np.array([True]))
    progress, _ = tracker.progress(tuple(tracker.ranks), "s", 0, 3)
    assert progress.passes[1] == later // 3 and progress.passes[0] == 0


def test_every_pass_together_covers_every_shard_once_per_pass():
    layout = fresh_layout(5, seed=1, epoch=0, source_index=2, world=3, endless=True)
    for p in range(4):
        dealt = np.concatenate([layout.pass_shards(q, p) for q in range(3)])
        assert sorted(dealt.tolist()) == list(range(5 * p, 5 * p + 5))


def test_a_restart_source_with_no_samples_fails_naming_it(tmp_path):
    for i in range(2):
        write_jsonl(tmp_path / "void" / f"part-{i}.jsonl", ["", ""])
    write_jsonl_source(tmp_path, "big", shards=2, per_shard=50, seed=1)
    with sl.Loader([sl.Source(str(tmp_path / "void"), on_exhausted="restart"),
                    sl.Source(str(tmp_path / "big"))], micro_batch_tokens=512, epochs=1) as loader:
        with pytest.raises(sl.DataError, match=r"source 'void'.*without a single sample.*restart"):
            list(loader)


def long_run_loader(root, **kw):
    """A finite source that lasts a few hundred steps beside a tiny endless one (a pass or more
    per step), so the tracker goes through many passes."""
    return sl.Loader([sl.Source(str(Path(root) / "tiny"), weight=0.3, on_exhausted="restart"),
                      sl.Source(str(Path(root) / "long"), weight=0.7)],
                     micro_batch_tokens=1024, micro_batches=2, epochs=1, chunk_bytes=4096, **kw)


def test_a_long_run_keeps_the_endless_tracker_small_and_resumes_exactly(tmp_path):
    write_jsonl_source(tmp_path, "tiny", shards=2, per_shard=3, median=40, seed=5)
    write_jsonl_source(tmp_path, "long", shards=4, per_shard=400, median=200, seed=6)
    # The loop may run ahead as far as it can (its queue full: the trainer's state is the
    # oldest in flight); the tracker still keeps what those states need, and no more.
    with long_run_loader(tmp_path, prefetch_steps=16) as loader:
        full = [flat(b) for b in loader]
        tracker = loader._runtime.job.trackers[0]
        units_read = tracker.offsets[0] + len(tracker.unit_lists[0])
    steps = len(full)
    # Hundreds of passes, but the tracker holds only the recent ones.
    # (What it keeps: about the units of the last 64 steps, plus up to 256 waiting to go.)
    assert steps > 300 and units_read > 3000, (steps, units_read)
    assert tracker.offsets[0] > 0 and len(tracker.unit_lists[0]) < 1000, len(tracker.unit_lists[0])
    assert len(tracker.unit_index) == len(tracker.unit_lists[0])
    # States taken after the tracker dropped units resume exactly.
    for stop in (steps // 2, steps - 20):
        with long_run_loader(tmp_path, prefetch_steps=16) as loader:
            head = [flat(b) for _, b in zip(range(stop), loader)]
            time.sleep(0.5)
            state = loader.state_dict()
        with long_run_loader(tmp_path, prefetch_steps=16) as loader:
            loader.load_state_dict(state)
            assert head + [flat(b) for b in loader] == full, stop
