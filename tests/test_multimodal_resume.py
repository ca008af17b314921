"""Exactly-once and resume on an image corpus: 2 gloo ranks (whose plans move samples, and so
their images, between ranks) stop after a few steps; one rank resumes from their state; every
sample comes once over both runs, with its own images (their colours name the sample)."""
from __future__ import annotations

import numpy as np
import pytest

import streamload as sl
from distributed import run_ranks
from imagecorpus import color_of, images_in, options, write_tar

STOP_AFTER = 3


def loader_for(root: str) -> sl.Loader:
    return sl.Loader([sl.Source(root, name="pics", images=options())], micro_batch_tokens=256,
                     micro_batches=1, epochs=1, seed=5, decode_images_in="threads")


def check_images(mb) -> list[str]:
    """The row's images are its samples' own (each image's colour names its sample)."""
    images = mb.images() if mb.num_images else []
    for d, sample_id in enumerate(mb.sample_ids):
        sample = int(sample_id.rsplit("/", 1)[1]) + 1000 * ("part-1" in sample_id)
        mine = [images[k] for k in range(mb.num_images) if int(mb.image_document[k]) == d]
        assert len(mine) == images_in(sample), sample_id
        for k, image in enumerate(mine):
            mean = image.float().mean((1, 2)).numpy()
            assert np.abs(mean - color_of(sample, k)).max() < 4, (sample_id, k, mean)
    return mb.sample_ids


def head_job(rank, world, root):
    with loader_for(root) as loader:
        ids, exchanged = [], 0
        for batch in loader:
            ids += [i for mb in batch.micro_batches for i in check_images(mb)]
            exchanged += batch.exchanged_tokens
            if batch.step + 1 == STOP_AFTER:
                return ids, loader.state_dict(), exchanged


@pytest.mark.timeout(240)
def test_an_image_corpus_resumes_exactly_once_at_another_world_size(tmp_path):
    write_tar(tmp_path / "part-0.tar", range(0, 40))
    write_tar(tmp_path / "part-1.tar", range(1000, 1040))
    heads = run_ranks(head_job, 2, str(tmp_path))
    assert heads[0][1] == heads[1][1]                      # every rank saves the same state
    assert heads[0][2] > 0                                  # samples moved between ranks
    with loader_for(str(tmp_path)) as loader:               # one rank resumes
        loader.load_state_dict(heads[0][1])
        tail = [i for b in loader for mb in b.micro_batches for i in check_images(mb)]
    ids = [i for head_ids, _, _ in heads for i in head_ids] + tail
    assert len(ids) == len(set(ids)), "a sample delivered twice"
    assert len(ids) == 80                                   # none lost


def gather_job(rank, world, root):
    with sl.Loader([sl.Source(root, name="pics", images=options())], micro_batch_tokens=256,
                   micro_batches=1, epochs=1, seed=5, decode_images_in="threads",
                   control_plane="gather") as loader:
        ids, exchanged = [], 0
        for batch in loader:
            ids += [i for mb in batch.micro_batches for i in check_images(mb)]
            exchanged += batch.exchanged_tokens
        return ids, exchanged


@pytest.mark.timeout(240)
def test_images_follow_their_samples_when_rank_0_plans_alone(tmp_path):
    """control_plane="gather": each rank holds and numbers only its own part of the plan; the
    images still reach the rank their samples go to (matched by order, not by entry)."""
    write_tar(tmp_path / "part-0.tar", range(0, 40))
    write_tar(tmp_path / "part-1.tar", range(1000, 1040))
    out = run_ranks(gather_job, 2, str(tmp_path))
    ids = out[0][0] + out[1][0]
    assert len(ids) == len(set(ids)) == 80 and out[0][1] > 0


@pytest.mark.parametrize("rule, field, saved, now", [
    (dict(max_pixels=56 * 56), "max_pixels", 12544, 3136),
    (dict(patch_size=16, merge_size=1, min_pixels=16 * 16), "merge_size", 2, 1),
    (dict(resize="fixed", size=(56, 56)), "resize", "'dynamic'", "'fixed'"),
])
def test_a_resume_with_another_image_rule_is_refused_naming_source_and_field(
        tmp_path, rule, field, saved, now):
    """The image rule decides every sample's token count, so the saved positions would name
    other items under another rule: the Loader refuses the state, naming source and field."""
    write_tar(tmp_path / "part-0.tar", range(0, 12))
    with loader_for(str(tmp_path)) as loader:
        state = next(iter(loader)) and loader.state_dict()
    other = sl.Loader([sl.Source(str(tmp_path), name="pics", images=options(**rule))],
                      micro_batch_tokens=256, micro_batches=1, epochs=1, seed=5,
                      decode_images_in="threads")
    with other, pytest.raises(sl.ConfigError) as err:
        other.load_state_dict(state)
        next(iter(other))
    assert err.value.key == f"images.{field}"
    assert f"source 'pics' images.{field}: saved with {saved}, this loader has {now}" \
        in str(err.value)
    # The memory budget's estimate is not data: that resume goes on.
    with sl.Loader([sl.Source(str(tmp_path), name="pics",
                              images=options(encoded_bytes_per_token=999))],
                   micro_batch_tokens=256, micro_batches=1, epochs=1, seed=5,
                   decode_images_in="threads") as same:
        same.load_state_dict(state)
        assert sum(1 for _ in same) > 0
