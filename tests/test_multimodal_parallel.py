"""Image sources with a parallel topology, on real gloo groups: TP peers get the same images
(under broadcast delivery they travel with the step, `peers.py`), a pipeline's first stage gets
them and its other stages do not (`stage_view`), every sample comes once over the DP ranks; CP
is refused by name."""
from __future__ import annotations

import hashlib

import pytest

import streamload as sl
from distributed import run_ranks
from imagecorpus import options, write_tar
from streamload.collective.topology import Parallel
from test_multimodal_resume import check_images

pytestmark = pytest.mark.timeout(240)


def digest(tensor):
    return None if tensor is None else hashlib.sha256(tensor.numpy().tobytes()).hexdigest()[:16]


def job(rank, world, root, layout):
    with sl.Loader([sl.Source(root, name="pics", images=options())], micro_batch_tokens=256,
                   micro_batches=2, epochs=1, seed=5, decode_images_in="threads",
                   parallel=Parallel(**layout)) as loader:
        t = loader.topology
        rows = []
        for batch in loader:
            for mb in batch.micro_batches:
                ids = check_images(mb) if t.first_stage else mb.sample_ids   # colours: own images
                rows.append({"ids": ids, "pixels": digest(getattr(mb, "pixel_values", None)),
                             "grid": digest(getattr(mb, "image_grid", None)),
                             "tokens": digest(mb.tokens), "labels": digest(mb.labels)})
        return {"dp": t.dp_rank, "tp": t.tp_rank, "pp": t.pp_rank, "rows": rows}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmpar")
    write_tar(root / "part-0.tar", range(0, 30))
    write_tar(root / "part-1.tar", range(1000, 1030))
    return root


@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 2, "delivery": "replicate"}],
                         ids=["broadcast", "replicate"])
def test_tp_peers_get_the_same_images(corpus, layout):
    out = run_ranks(job, 4, str(corpus), layout)
    by = {(r["dp"], r["tp"]): r["rows"] for r in out}
    for dp in (0, 1):
        assert by[(dp, 0)] == by[(dp, 1)]                       # identical, images included
    assert any(row["pixels"] for row in by[(0, 0)])
    ids = [i for dp in (0, 1) for row in by[(dp, 0)] for i in row["ids"]]
    assert len(ids) == len(set(ids)) == 60


@pytest.mark.parametrize("delivery", ["broadcast", "replicate"])
def test_only_the_first_pipeline_stage_gets_the_images(corpus, delivery):
    out = run_ranks(job, 4, str(corpus), {"pp": 2, "delivery": delivery})
    by = {(r["dp"], r["pp"]): r["rows"] for r in out}
    for dp in (0, 1):
        first, last = by[(dp, 0)], by[(dp, 1)]
        assert any(row["pixels"] for row in first)
        assert all(row["pixels"] is None and row["grid"] is None for row in last)
        assert all(row["labels"] is None for row in first)      # the last stage's field
        assert [row["ids"] for row in first] == [row["ids"] for row in last]
    ids = [i for dp in (0, 1) for row in by[(dp, 0)] for i in row["ids"]]
    assert len(ids) == len(set(ids)) == 60


def cp_job(rank, world, root):
    try:
        sl.Loader([sl.Source(root, name="pics", images=options())], micro_batch_tokens=256,
                  parallel=Parallel(cp=2))
    except sl.ConfigError as exc:
        return exc.key, str(exc)
    return None, None


def test_context_parallelism_is_refused_naming_the_option(corpus):
    (key, message), _ = run_ranks(cp_job, 2, str(corpus))
    assert key == "parallel.cp" and "context parallelism (cp=2)" in message, message
