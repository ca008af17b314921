"""Hybrid balancing of image-text samples (issue 23, item 4): a sample costs encoder(images) +
backbone(fused length); the encoder's part reaches the planner for an image source by default,
and `image_cost="backbone"` leaves it out."""
from __future__ import annotations

import numpy as np
import pytest

import streamload as sl
from imagecorpus import options, write_tar
from streamload.errors import ConfigError
from streamload.plan.cost import CostModel
from streamload.plan.planner import Planner
from streamload.plan.types import Candidates, Geometry
from streamload.vision.cost import EncoderCost
from streamload.vision.hybrid import (VIT_600M, encoder_model, relative, step_report,
                                      window_costs)


@pytest.mark.core
@pytest.mark.parametrize("method", ["balanced", "lookahead"])
def test_hybrid_balancing_lowers_the_slowest_rank_where_backbone_only_does_not(method):
    # Two ranks, one row each. A and B: 1000 tokens with a 4000-patch image (encoder 500);
    # C and D: text of 1200 and 800 tokens. By length alone {A, B} | {C, D} is perfect (2000
    # each), but the rank holding A and B then takes 3000 with its encoder; hybrid pairs each
    # image sample with a text one: 2700 | 2300.
    encoder = EncoderCost(a=0.0, b=0.125)
    patches = [[[4000], []], [[4000], []]]           # [rank][item] patches per image
    lengths = [[np.array([1000, 1200])], [np.array([1000, 800])]]
    true_extra = np.concatenate([encoder.sample_costs(p) for p in patches])
    geometry, cost = Geometry(ranks=2, micro_batches=1, capacity=4096), CostModel(a=0.0, b=1.0)
    slowest = {}
    for mode in ("hybrid", "backbone"):
        extra = [[encoder.sample_costs(p) if mode == "hybrid" else np.zeros(2)]
                 for p in patches]
        c = Candidates.from_windows(lengths, extra_costs=extra)
        a = Planner(geometry, cost, method=method, lookahead=2).assign(c, np.array([4000.0]), 0)
        assert sorted(a.take.tolist()) == [0, 1, 2, 3]
        # the time each rank really takes: backbone + encoder of what it got
        true = np.bincount(a.rank, weights=c.length[a.take] + true_extra[a.take], minlength=2)
        slowest[mode] = float(true.max())
    assert slowest == {"hybrid": 2700.0, "backbone": 3000.0}


@pytest.mark.core
def test_encoder_cost_units_and_the_default_coefficients():
    # ViT-600M in FLOPs over a 7B backbone's 6*7e9 per token: the loader's defaults
    vit = relative(VIT_600M)
    config = sl.LoaderConfig(micro_batch_tokens=1024)
    assert vit.a == pytest.approx(config.encoder_cost_a) and vit.b == pytest.approx(config.encoder_cost_b)
    assert encoder_model(config) == EncoderCost(config.encoder_cost_a, config.encoder_cost_b)
    assert encoder_model(sl.LoaderConfig(micro_batch_tokens=1024, image_cost="backbone")) is None
    costs = vit.sample_costs([[100, 300], [], [400]])
    assert costs[1] == 0.0 and costs[0] < costs[2]    # a^2 term: one 400 > 100 + 300
    report = step_report([10.0, 30.0], [40.0, 20.0])
    assert report["encoder_imbalance"] == 1.5 and report["efficiency"] == 1.0


@pytest.mark.core
def test_the_switch_and_the_coefficients_are_validated():
    with pytest.raises(ConfigError, match="image_cost"):
        sl.LoaderConfig(micro_batch_tokens=1024, image_cost="encoder")
    with pytest.raises(ConfigError, match="encoder_cost_a"):
        sl.LoaderConfig(micro_batch_tokens=1024, encoder_cost_a=-1.0)



def delivered_costs(config, batch) -> tuple[float, float]:
    """This rank's (backbone, encoder) cost of what it received: its rows' documents under the
    backbone model, its images under the encoder model."""
    backbone = CostModel(config.cost_a, config.cost_b)
    encoder = EncoderCost(config.encoder_cost_a, config.encoder_cost_b)
    b = e = 0.0
    for mb in batch.micro_batches:
        b += float(backbone.doc_cost(np.diff(mb.cu_seqlens.numpy())).sum())
        if mb.num_images:
            e += float(encoder.image_costs(mb.image_grid.numpy().prod(axis=1)).sum())
    return b, e

def planned_and_measured(source: sl.Source, **kw):
    """Per step: (the planner's rank cost, backbone of the delivered documents, encoder of the
    delivered images) at R=1, with the loader's default coefficients."""
    kw = {"micro_batch_tokens": 1024, "micro_batches": 2, "epochs": 1,
          "decode_images_in": "threads", **kw}
    out = []
    with sl.Loader([source], **kw) as loader:
        for batch in loader:
            b, e = delivered_costs(loader.config, batch)
            out.append((float(batch.rank_cost[0]), b, e))
    return np.array(out)


@pytest.mark.timeout(120)
def test_the_encoder_cost_reaches_the_planner_for_an_image_source(tmp_path):
    write_tar(tmp_path / "part-0.tar", range(24))
    source = sl.Source(str(tmp_path), images=options())
    hybrid = planned_and_measured(source)
    assert hybrid[:, 2].sum() > 0                       # the corpus has images
    # the plan's cost of each step is the backbone's plus the encoder's, image by image
    np.testing.assert_allclose(hybrid[:, 0], hybrid[:, 1] + hybrid[:, 2], rtol=1e-9)
    backbone = planned_and_measured(source, image_cost="backbone")
    np.testing.assert_allclose(backbone[:, 0], backbone[:, 1], rtol=1e-9)
    assert hybrid[:, 1].sum() == pytest.approx(backbone[:, 1].sum())   # the same documents


@pytest.mark.core
def test_window_costs_of_items_with_and_without_images():
    class Placement:
        def __init__(self, grid):
            self.grid = grid

    class Ref:
        def __init__(self, grid):
            self.placement = Placement(grid)

    class Item:
        def __init__(self, *grids):
            self.images = tuple(Ref(g) for g in grids)

    encoder = EncoderCost(a=1.0, b=2.0)
    costs = window_costs([Item((1, 2, 3), (1, 4, 4)).images, (), Item().images], encoder)
    assert costs.tolist() == [6 * 6 + 2 * 6 + 16 * 16 + 2 * 16, 0.0, 0.0]
    assert window_costs([], encoder).shape == (0,)


def split_per_step(rank, world, root, control_plane="all_gather"):
    """Per step on this rank: (Batch.encoder_cost, Batch.backbone_cost, the encoder and the
    backbone of what this rank got, measured from its rows), and stats() / the step records."""
    records = []
    sources = [sl.Source(f"{root}/pics", name="pics", images=options()),
               sl.Source(f"{root}/text", name="text")]
    with sl.Loader(sources, micro_batch_tokens=512, micro_batches=2, epochs=1, seed=3,
                   decode_images_in="threads", control_plane=control_plane,
                   on_step=records.append) as loader:
        out = []
        for batch in loader:
            b, e = delivered_costs(loader.config, batch)
            out.append((batch.encoder_cost.tolist(), batch.backbone_cost.tolist(), e, b,
                        batch.encoder_imbalance, batch.backbone_imbalance))
        stats = loader.stats()
    return out, stats, records


def write_mixed(root):
    from corpus import write_jsonl_source
    (root / "pics").mkdir()
    write_tar(root / "pics" / "part-0.tar", range(40))
    write_jsonl_source(root, "text", shards=2, per_shard=15, median=120, seed=4)


def check_split(outs, world, own_only=False):
    """Each rank's Batch.encoder_cost / backbone_cost are what it got, and every rank sees the
    same job-wide figures. `own_only` (control_plane="gather"): a rank other than 0 holds its
    own rank's costs alone; rank 0 every rank's."""
    steps = list(zip(*[o[0] for o in outs]))
    assert steps
    for per_rank in steps:
        enc, bb = per_rank[0][0], per_rank[0][1]   # rank 0's: every rank's
        assert len(enc) == len(bb) == world
        for r in range(world):
            mine = per_rank[r]
            if own_only and r:
                assert (mine[0], mine[1]) == ([enc[r]], [bb[r]])
            else:
                assert (mine[0], mine[1]) == (enc, bb)
            assert enc[r] == pytest.approx(mine[2], rel=1e-9)
            assert bb[r] == pytest.approx(mine[3], rel=1e-9)
            assert (mine[4], mine[5]) == (per_rank[0][4], per_rank[0][5])   # on every rank
        mean = float(np.mean(enc))
        assert per_rank[0][4] == pytest.approx(max(enc) / mean if mean > 0 else 1.0)
        mean = float(np.mean(bb))
        assert per_rank[0][5] == pytest.approx(max(bb) / mean if mean > 0 else 1.0)
    assert sum(sum(s[0][0]) for s in steps) > 0   # images were delivered
    return steps


@pytest.mark.timeout(240)
@pytest.mark.parametrize("control_plane", ["all_gather", "gather"])
def test_encoder_and_backbone_costs_apart_in_batch_stats_and_records(tmp_path, control_plane):
    """An image source and a text source at R=2: each rank's predicted encoder part is the
    encoder cost of the images it got, its backbone part the cost of its fused rows; the
    imbalance of each is in the Batch, stats() and the step records (under either control
    plane: under gather, rank 0 sends them with the step's totals)."""
    from distributed import run_ranks
    write_mixed(tmp_path)
    outs = run_ranks(split_per_step, 2, str(tmp_path), control_plane)
    steps = check_split(outs, 2, own_only=control_plane == "gather")
    for out, stats, records in outs:
        assert len(records) == len(steps)
        for record, step in zip(records, out):
            assert record["encoder_imbalance"] == pytest.approx(step[4])
            assert record["backbone_imbalance"] == pytest.approx(step[5])
        last = out[-1]
        assert stats["encoder_cost"] == pytest.approx(last[0])
        assert stats["backbone_cost"] == pytest.approx(last[1])
        assert stats["encoder_imbalance"] == pytest.approx(last[4])
        assert stats["encoder_imbalance_mean"] == pytest.approx(np.mean([s[4] for s in out]))
        assert stats["backbone_imbalance_mean"] == pytest.approx(np.mean([s[5] for s in out]))


@pytest.mark.timeout(120)
def test_no_encoder_part_when_balancing_by_the_backbone_only(tmp_path):
    (tmp_path / "pics").mkdir()
    write_tar(tmp_path / "pics" / "part-0.tar", range(16))
    with sl.Loader([sl.Source(str(tmp_path / "pics"), images=options())],
                   micro_batch_tokens=1024, epochs=1, image_cost="backbone",
                   decode_images_in="threads") as loader:
        for batch in loader:
            assert batch.encoder_cost.tolist() == [0.0] and batch.encoder_imbalance == 1.0
            assert batch.backbone_cost.tolist() == batch.rank_cost.tolist()
