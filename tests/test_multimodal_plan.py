"""`streamload plan` (the dry run) on an image corpus: the samples' lengths and their images'
patches come from the headers of real JPEGs in real WebDataset tars; the plan balances the
two-part cost (encoder + backbone) under image_cost="hybrid", reports the encoder's and the
backbone's imbalance apart, and keeps the caps per row."""
from __future__ import annotations

import json

import numpy as np
import pytest

from imagecorpus import images_in, options, size_of, write_tar
from streamload.commands.cli import main
from streamload.configfile import load_config
from streamload.commands.dryrun import scan
from streamload.vision.cost import EncoderCost

SAMPLES = [range(k * 24, (k + 1) * 24) for k in range(4)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmplan")
    for k, samples in enumerate(SAMPLES):
        write_tar(root / f"part-{k}.tar", samples)
    return root


def config(root, image_cost="hybrid", caps="") -> str:
    o = options()
    path = root / f"plan-{image_cost}{len(caps)}.toml"
    path.write_text(f"""
[loader]
micro_batch_tokens = 512
micro_batches = 2
planner = "balanced"
epochs = 1
image_cost = "{image_cost}"
encoder_cost_a = 0.01
encoder_cost_b = 0.5
{caps}

[[source]]
uri = "{root}/"
name = "pics"
images = {{ image_token_id = {o.image_token_id}, image_begin_ids = [{o.image_begin_ids[0]}], \
image_end_ids = [{o.image_end_ids[0]}], max_pixels = {o.max_pixels}, min_pixels = {o.min_pixels} }}
""")
    return str(path)


def plan(capsys, path) -> dict:
    rc = main(["plan", path, "--steps", "200", "--ranks", "2", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


def expected_patches(sample: int) -> tuple:
    o = options()
    return tuple(int(np.prod(o.place(size_of(sample, k)[1], size_of(sample, k)[0]).grid))
                 for k in range(images_in(sample)))


def test_the_scan_reads_each_samples_patches_from_its_headers(corpus):
    spec = load_config(config(corpus))
    (s,) = scan(spec)
    assert s.image_patches == [expected_patches(n) for r in SAMPLES for n in r]
    assert s.to_dict()["images"] == sum(images_in(n) for r in SAMPLES for n in r)


def test_plan_reports_encoder_and_backbone_apart_and_the_encoder_cost_is_the_samples(corpus,
                                                                                     capsys):
    out = plan(capsys, config(corpus))
    summary, steps = out["summary"], out["steps"]
    assert summary["steps_per_epoch"]["exact"]            # the whole epoch was planned
    images = summary["images"]
    encoder = EncoderCost(0.01, 0.5)
    want = sum(float(encoder.image_costs(expected_patches(n)).sum())
               for r in SAMPLES for n in r)
    got = sum(sum(step["encoder_cost"]) for step in steps)
    assert got == pytest.approx(want)                      # every sample's images, once
    # under hybrid the planned rank cost is encoder + backbone
    for step in steps:
        assert np.allclose(np.add(step["encoder_cost"], step["backbone_cost"]),
                           step["rank_cost"])
    assert 0 < images["encoder_share"] < 1 and images["image_cost"] == "hybrid"
    assert images["encoder_imbalance_mean"] >= 1 and images["backbone_imbalance_mean"] >= 1
    assert 0 < images["efficiency"] <= 1


def test_plan_under_backbone_only_still_measures_the_encoder(corpus, capsys):
    hybrid = plan(capsys, config(corpus))["summary"]["images"]
    backbone_out = plan(capsys, config(corpus, "backbone"))
    backbone = backbone_out["summary"]["images"]
    steps = backbone_out["steps"]
    # the planner saw no encoder cost: the planned rank cost is the backbone's alone
    for step in steps:
        assert np.allclose(step["backbone_cost"], step["rank_cost"])
    assert backbone["encoder_share"] == pytest.approx(hybrid["encoder_share"], rel=0.05)
    assert backbone["image_cost"] == "backbone"


def test_plan_keeps_the_caps_per_row_and_refuses_a_sample_over_one(corpus, capsys):
    free = plan(capsys, config(corpus))["summary"]["images"]
    assert free["row_images_max"] > 4 and free["row_patches_max"] > 200
    assert free["max_images_per_row"] is None
    capped = plan(capsys, config(corpus, caps="max_images_per_row = 4\n"
                                              "max_patches_per_row = 200"))
    images = capped["summary"]["images"]
    assert images["row_images_max"] <= 4 and images["row_patches_max"] <= 200
    assert all(s["row_images_max"] <= 4 for s in capped["steps"])
    assert capped["summary"]["sources"]["pics"]["samples"] == 96   # none left behind
    rc = main(["plan", config(corpus, caps="max_images_per_row = 2"), "--ranks", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and "3 images, more than max_images_per_row=2" in err, err
    assert "source 'pics'" in err and "sample '0000" in err
