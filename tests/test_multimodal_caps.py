"""Caps per row on what a row feeds the vision encoder (max images, max patches; OmniBal's
caps per packed group): every planning method's plan obeys them, a Loader's rows obey them on
gloo ranks with every sample delivered once, and a sample that alone exceeds a cap is refused
by name (or skipped and counted), never dropped silently."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamload as sl
from distributed import run_ranks
from imagecorpus import add_member, image_bytes, options, write_tar
from streamload.errors import ConfigError
from streamload.plan.caps import RowCaps, enforce, row_visual
from streamload.plan.cost import CostModel
from streamload.plan.planner import Planner
from streamload.plan.types import Candidates, Geometry
from test_multimodal_formats import read_all
from test_plan_properties import _with_overdue, check_plan

SOURCE = "pics"


def image_candidates(seed: int, ranks: int, per_window: int):
    """Windows of image samples (0-8 images of 64-512 patches: none alone over the caps) and text samples."""
    rng = np.random.default_rng(seed)
    lengths, images, patches, extra = [], [], [], []
    for _ in range(ranks):
        n_images = rng.integers(0, 9, per_window)
        n_patches = np.array([int(rng.integers(64, 513, k).sum()) for k in n_images])
        lengths.append([np.minimum(n_patches // 4 + rng.integers(10, 1500, per_window), 4000)])
        images.append([n_images])
        patches.append([n_patches])
        extra.append([n_patches * 0.5])
    return Candidates.from_windows(lengths, extra_costs=extra, images=images, patches=patches)


@pytest.mark.core
@pytest.mark.parametrize("method", ["naive", "balanced", "lookahead"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_no_row_of_any_plan_exceeds_the_caps(method, ranks):
    geometry = Geometry(ranks=ranks, micro_batches=2, capacity=4096)
    caps = RowCaps(images=9, patches=4096)
    over_without = 0
    for seed in range(6):
        c = image_candidates(seed, ranks, 24)
        targets = np.array([float(geometry.step_tokens)])
        capped = Planner(geometry, CostModel(a=1e-4, b=1.0), method=method, lookahead=2,
                         caps=caps).assign(c, targets, 0)
        free = Planner(geometry, CostModel(a=1e-4, b=1.0), method=method,
                       lookahead=2).assign(c, targets, 0)
        load = row_visual(c, capped.take, capped.rank, capped.row, geometry)
        assert (load[..., 0] <= 9).all() and (load[..., 1] <= 4096).all(), (seed, load)
        assert len(set(capped.take.tolist())) == len(capped.take) > 0   # each item once
        tokens = np.bincount(capped.rank * 2 + capped.row, capped.length, minlength=ranks * 2)
        assert (tokens <= 4096).all()
        free_load = row_visual(c, free.take, free.rank, free.row, geometry)
        over_without += int(((free_load[..., 0] > 9) | (free_load[..., 1] > 4096)).sum())
    assert over_without > 0   # the caps bite on this data: without them rows go over


@pytest.mark.core
def test_enforce_moves_an_item_to_a_row_with_room_before_leaving_it_out():
    # One rank, two rows: row 0 holds three image samples (3 + 3 + 3 images), row 1 text only.
    c = Candidates.from_windows([[np.array([100, 100, 100, 100])]],
                                images=[[np.array([3, 3, 3, 0])]],
                                patches=[[np.array([300, 300, 300, 0])]])
    geometry = Geometry(ranks=1, micro_batches=2, capacity=1000)
    take, rank, row, length = enforce(c, np.arange(4), np.zeros(4, np.int32),
                                      np.array([0, 0, 0, 1], np.int32), c.length,
                                      geometry, RowCaps(images=6))
    assert sorted(take.tolist()) == [0, 1, 2, 3]             # moved, none left out
    load = row_visual(c, take, rank, row, geometry)
    assert load[0, :, 0].tolist() == [6, 3]
    # With no row that takes it, the item stays in its buffer (left out of this step), and
    # the row takes the text item of the window instead (the step stays as full).
    one_row = Geometry(ranks=1, micro_batches=1, capacity=1000)
    take, rank, row, length = enforce(c, np.arange(3), np.zeros(3, np.int32),
                                      np.zeros(3, np.int32), c.length[:3], one_row,
                                      RowCaps(images=6))
    assert len(take) == 3 and 3 in take.tolist() and int(length.sum()) == 300
    assert row_visual(c, take, rank, row, one_row)[0, 0, 0] == 6


@pytest.mark.core
def test_summaries_carry_each_image_items_images_and_patches():
    from streamload.collective.messages import SourceWindow, decode_summaries, encode_summary
    ids = lambda n: np.stack([np.zeros(n), np.arange(n), np.full(n, -1)], 1).astype(np.int64)
    text = SourceWindow(np.array([5, 6]), np.zeros(2, np.int64), ids(2), False)
    pics = SourceWindow(np.array([7, 8, 9]), np.zeros(3, np.int64), ids(3), True,
                        np.array([1.0, 0.0, 2.5]), np.array([[2, 0, 3], [40, 0, 96]]))
    out = decode_summaries([encode_summary([text, pics]), encode_summary([text, pics])], 2)
    c = out.candidates
    assert c.images.tolist() == [0, 0, 0, 0, 2, 0, 3, 2, 0, 3]   # by source, then rank
    assert c.patches.tolist() == [0, 0, 0, 0, 40, 0, 96, 40, 0, 96]
    assert c.extra_cost.tolist()[4:7] == [1.0, 0.0, 2.5]
    assert out.exhausted.tolist() == [[False, True], [False, True]]
    plain = decode_summaries([encode_summary([text])], 1).candidates
    assert plain.images is None and plain.patches is None   # a text job carries none


def test_the_caps_are_validated():
    with pytest.raises(ConfigError, match="max_images_per_row"):
        sl.LoaderConfig(micro_batch_tokens=1024, max_images_per_row=0)
    with pytest.raises(ConfigError, match="max_patches_per_row"):
        sl.LoaderConfig(micro_batch_tokens=1024, max_patches_per_row=-4)


CAPS = dict(max_images_per_row=5, max_patches_per_row=200)


def capped_job(rank, world, root, control_plane="all_gather"):
    with sl.Loader([sl.Source(root, name=SOURCE, images=options())], micro_batch_tokens=512,
                   micro_batches=2, epochs=1, seed=3, decode_images_in="threads",
                   planner="balanced", control_plane=control_plane, **CAPS) as loader:
        ids, rows = [], []
        for batch in loader:
            for mb in batch.micro_batches:
                ids += mb.sample_ids
                patches = int(mb.image_grid.numpy().prod(axis=1).sum()) if mb.num_images else 0
                rows.append((mb.num_images, patches, int(mb.pixel_values.shape[0])))
        return ids, rows


@pytest.mark.timeout(240)
@pytest.mark.parametrize("control_plane", ["all_gather", "gather"])
def test_a_loaders_rows_obey_the_caps_and_every_sample_comes_once(tmp_path, control_plane):
    # 0-3 images per sample of up to 16 patches each (imagecorpus): rows of 512 tokens hold
    # up to ~8 samples, so uncapped rows go past 5 images (and 200 patches).
    write_tar(tmp_path / "part-0.tar", range(0, 40))
    write_tar(tmp_path / "part-1.tar", range(1000, 1040))
    out = run_ranks(capped_job, 2, str(tmp_path), control_plane)
    ids = out[0][0] + out[1][0]
    assert len(ids) == len(set(ids)) == 80
    rows = out[0][1] + out[1][1]
    assert all(images <= 5 and patches <= 200 and patches == values
               for images, patches, values in rows), rows
    assert max(images for images, _, _ in rows) >= 3   # rows do hold images up to the cap


@pytest.mark.timeout(120)
def test_a_sample_over_a_cap_alone_is_refused_by_name_or_skipped_and_counted(tmp_path):
    # Sample 6 has 2 images of 108 patches (imagecorpus, placed before its text) and two more
    # of 64: 4 images and 236 patches, past max_images_per_row=3 and max_patches_per_row=200
    # on its own (the other samples: at most 3 images and 116 patches).
    def extra(tar, key, s):
        if s == 6:
            for k in (8, 9):
                add_member(tar, f"{key}.{k}.jpg", image_bytes(112, 112))
    write_tar(tmp_path / "part-0.tar", range(8), extra=extra)
    src = sl.Source(str(tmp_path), name=SOURCE, images=options())
    with pytest.raises(sl.DataError) as error:
        read_all(src, max_images_per_row=3)
    message = str(error.value)
    for part in (f"source {SOURCE!r}", "shard 'part-0.tar'", "record 6", "sample '000006'",
                 "4 images, more than max_images_per_row=3"):
        assert part in message, message
    with pytest.raises(sl.DataError, match=r"sample '000006': \d+ encoder patches in 4 "
                                           r"image\(s\), more than max_patches_per_row=200"):
        read_all(src, max_patches_per_row=200, max_images_per_row=None)
    with sl.Loader([src], micro_batch_tokens=1024, micro_batches=1, epochs=1,
                   max_images_per_row=3, on_error="skip", max_skip_fraction=0.5,
                   decode_images_in="threads") as loader:
        ids = [i for b in loader for mb in b.micro_batches for i in mb.sample_ids]
        stats = loader.stats()["sources"][SOURCE]
    assert sorted(int(i.rsplit("/", 1)[1]) for i in ids) == [0, 1, 2, 3, 4, 5, 7]
    assert stats["skipped_records"] == 1
    assert "max_images_per_row=3" in " ".join(stats["skip_reasons"])


@st.composite
def capped_problems(draw):
    """Windows of image samples under tight caps per row (every item within them alone), with
    targets that often ask for more than the rows take: many rows go over a cap."""
    R = draw(st.integers(1, 4))
    M = draw(st.integers(1, 3))
    C = draw(st.sampled_from([256, 1024]))
    cap_images = draw(st.integers(2, 6))
    cap_patches = draw(st.sampled_from([cap_images * 32, cap_images * 96]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    lengths, images, patches, extra = [], [], [], []
    for _ in range(R):
        n = int(rng.integers(0, 10))
        k = rng.integers(0, cap_images + 1, n)
        p = np.minimum([int(rng.integers(16, 129, j).sum()) for j in k], cap_patches)
        lengths.append([np.clip(p // 4 + rng.integers(1, C // 3, n), 1, C).astype(np.int64)])
        images.append([k]), patches.append([np.asarray(p, np.int64)])
        extra.append([np.asarray(p, np.float64)])
    c = Candidates.from_windows(lengths, extra_costs=extra, images=images, patches=patches)
    geometry = Geometry(R, M, C)
    targets = np.array([geometry.step_tokens * draw(st.sampled_from([0.5, 1.0, 1.6]))])
    return geometry, c, targets, RowCaps(images=cap_images, patches=cap_patches)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=capped_problems(), method=st.sampled_from(["naive", "balanced", "lookahead"]),
       seed=st.integers(0, 2 ** 16))
@pytest.mark.core
def test_overdue_items_keep_their_place_under_tight_caps(problem, method, seed):
    """The deferral bound holds under caps: up to R*M overdue items (each within the caps, as
    every item is) are all taken, young items giving up their place where a row is over."""
    geometry, c, targets, caps = problem
    cost = CostModel(a=1 / 4096, b=1.0)
    planner = Planner(geometry, cost, method=method, max_age=2, lookahead=3, caps=caps)
    c = _with_overdue(c, geometry, targets, planner.force_age, np.random.default_rng(seed),
                      max_items=geometry.ranks * geometry.micro_batches)
    a = planner.assign(c, targets, step=0)
    check_plan(c, geometry, cost, a)
    load = row_visual(c, a.take, a.rank, a.row, geometry)
    assert (load[..., 0] <= caps.images).all() and (load[..., 1] <= caps.patches).all()
    overdue = np.flatnonzero(c.age >= planner.force_age)
    assert np.isin(overdue, a.take).all(), "an overdue item was left out under the caps"


@pytest.mark.core
def test_a_row_gives_up_young_items_for_an_overdue_one_no_row_takes():
    # One rank, one row, cap 6 images: the plan holds an overdue item (4 images) and two young
    # ones (3 + 3) - over the cap. Giving up the young ones first makes it obey, and the
    # overdue item stays. With two overdue items of 4 (8 > 6), one waits: the documented bound.
    c = Candidates.from_windows([[np.array([100, 100, 100])]], ages=[[np.array([5, 0, 0])]],
                                images=[[np.array([4, 3, 3])]], patches=[[np.zeros(3, np.int64)]])
    one_row = Geometry(ranks=1, micro_batches=1, capacity=1000)
    take, *_ = enforce(c, np.arange(3), np.zeros(3, np.int32), np.zeros(3, np.int32), c.length,
                       one_row, RowCaps(images=6), force_age=5)
    assert 0 in take.tolist() and int(row_visual(c, take, *_[:2], one_row)[0, 0, 0]) <= 6
    # Two rows: row 0 holds two overdue items (4 + 4 images), row 1 is full of young ones
    # (3 + 3). Row 0 gives one overdue item up; no row takes it as it is, so row 1 gives up a
    # young item for it.
    c = Candidates.from_windows([[np.array([100, 100, 100, 100])]],
                                ages=[[np.array([5, 6, 0, 0])]],
                                images=[[np.array([4, 4, 3, 3])]],
                                patches=[[np.zeros(4, np.int64)]])
    two_rows = Geometry(ranks=1, micro_batches=2, capacity=1000)
    take, rank, row, length = enforce(c, np.arange(4), np.zeros(4, np.int32),
                                      np.array([0, 0, 1, 1], np.int32), c.length, two_rows,
                                      RowCaps(images=6), force_age=5)
    assert {0, 1} <= set(take.tolist())
    assert (row_visual(c, take, rank, row, two_rows)[..., 0] <= 6).all()
    assert row[take.tolist().index(0)] != row[take.tolist().index(1)]
