"""Image-text samples read in place, end to end through a Loader: a real WebDataset tar of
JPEGs and PNGs, a real Parquet file in `datasets`' Image layout, an Energon-prepared folder.
Each sample's fused tokens, its images' grids, patches and colours, and its labels are checked
against what was written."""
from __future__ import annotations

import numpy as np
import pytest

import streamload as sl
from imagecorpus import (BEGIN_ID, END_ID, IMAGE_ID, color_of, images_in, options, size_of,
                         visual_tokens, write_parquet, write_tar)
from streamload.plan.packing import IGNORE_INDEX
from streamload.vision.batch import VisionMicroBatch


def read_all(source: sl.Source, **kw) -> list[VisionMicroBatch]:
    kw = {"micro_batch_tokens": 1024, "micro_batches": 2, "epochs": 1,
          "decode_images_in": "threads", **kw}
    with sl.Loader([source], **kw) as loader:
        return [mb for batch in loader for mb in batch.micro_batches]


def documents(rows: list[VisionMicroBatch]):
    """(sample id, tokens, labels, loss mask, [(grid, patches, image)]) of every document."""
    for mb in rows:
        assert isinstance(mb, VisionMicroBatch)
        cu = mb.cu_seqlens.tolist()
        bounds = mb.vision_cu_seqlens.tolist()
        images = mb.images() if mb.num_images else []
        for d, sample_id in enumerate(mb.sample_ids):
            a, b = cu[d], cu[d + 1]
            mine = [(tuple(mb.image_grid[k].tolist()),
                     mb.pixel_values[bounds[k]:bounds[k + 1]], images[k])
                    for k in range(mb.num_images) if int(mb.image_document[k]) == d]
            assert int(mb.image_mask[a:b].sum()) == sum(g[1] * g[2] for g, _, _ in mine) // 4
            yield (sample_id, mb.tokens[a:b].numpy(), mb.labels[a:b].numpy(),
                   mb.loss_mask[a:b].numpy(), mine)


def check_sample(sample: int, tokens, labels, loss, images, opts) -> None:
    expected = visual_tokens(sample, opts)
    assert len(images) == images_in(sample) == len(expected)
    assert int((tokens == IMAGE_ID).sum()) == sum(expected)
    assert int((tokens == BEGIN_ID).sum()) == int((tokens == END_ID).sum()) == len(expected)
    # each image's run of placeholders, between its markers, as long as its visual tokens
    starts = np.flatnonzero(tokens == BEGIN_ID)
    for start, n in zip(starts, expected):
        assert (tokens[start + 1:start + 1 + n] == IMAGE_ID).all()
        assert tokens[start + 1 + n] == END_ID
    for k, (grid, patches, image) in enumerate(images):
        w, h = size_of(sample, k)
        placed = opts.place(h, w)
        assert grid == placed.grid
        assert patches.shape == (grid[1] * grid[2], opts.patch_values)
        assert tuple(image.shape) == (3, placed.height, placed.width)
        assert np.abs(image.float().mean((1, 2)).numpy() - color_of(sample, k)).max() < 4
    text = ~np.isin(tokens, (IMAGE_ID, BEGIN_ID, END_ID))
    assert not np.isin(labels, (IMAGE_ID, BEGIN_ID, END_ID)).any()
    assert (loss[~text] == 0).all() and (labels[~text] == IGNORE_INDEX).all()
    # every text token that has a text successor is learned
    follows = text[:-1] & text[1:]
    assert (loss[:-1][follows] == 1).all()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_webdataset_tar_of_image_text_samples(tmp_path, fmt):
    write_tar(tmp_path / "part-0.tar", range(14), fmt=fmt)
    opts = options()
    rows = read_all(sl.Source(str(tmp_path), images=opts))
    seen = set()
    for sample_id, tokens, labels, loss, images in documents(rows):
        sample = int(sample_id.rsplit("/", 1)[1])
        check_sample(sample, tokens, labels, loss, images, opts)
        seen.add(sample)
    assert seen == set(range(14))


@pytest.mark.timeout(120)
def test_interleaved_json_and_qwen2_vl_frames(tmp_path):
    """A JSON member's list of strings and nulls places the images; two frames per patch."""
    import json
    import tarfile
    from imagecorpus import add_member, image_bytes
    with tarfile.open(tmp_path / "part-0.tar", "w") as tar:
        for s in range(4):
            key = f"{s:04d}"
            parts = ["look:", None, "and", None, "done"] if s % 2 else ["text only"]
            add_member(tar, f"{key}.json", json.dumps({"texts": parts}).encode())
            for k in range(parts.count(None)):
                add_member(tar, f"{key}.{k}.webp" if k else f"{key}.{k}.jpg",
                           image_bytes(*size_of(s, k), color_of(s, k),
                                       "WEBP" if k else "JPEG"))
    opts = options(temporal_patch_size=2)
    rows = read_all(sl.Source(str(tmp_path), text_field="json.texts", images=opts))
    docs = {sid: (tokens, images) for sid, tokens, _, _, images in documents(rows)}
    assert len(docs) == 4
    tokens, images = docs[f"{tmp_path.name}/part-0.tar/1"]
    assert bytes(tokens[:5].astype(np.uint8)) == b"look:"
    assert len(images) == 2 and images[0][1].shape[1] == 3 * 14 * 14
    fed = [mb.to_qwen2_vl() for mb in rows if mb.num_images]
    assert all(f["pixel_values"].shape[1] == 3 * 2 * 14 * 14 for f in fed)
    assert sum(f["image_grid_thw"].shape[0] for f in fed) == 4
    for k, (_, _, image) in enumerate(images):
        assert np.abs(image.float().mean((1, 2)).numpy() - color_of(1, k)).max() < 4
    tokens, images = docs[f"{tmp_path.name}/part-0.tar/0"]
    assert bytes(tokens.astype(np.uint8)) == b"text only" and images == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("listed", [True, False])
def test_a_parquet_file_in_the_datasets_image_layout(tmp_path, listed):
    samples = list(range(12)) if listed else [s for s in range(16) if images_in(s) <= 1]
    write_parquet(tmp_path / "train-0.parquet", samples, listed=listed)
    opts = options()
    rows = read_all(sl.Source(str(tmp_path), images=opts))
    seen = set()
    for sample_id, tokens, labels, loss, images in documents(rows):
        sample = samples[int(sample_id.rsplit("/", 1)[1])]
        check_sample(sample, tokens, labels, loss, images, opts)
        seen.add(sample)
    assert seen == set(samples)


@pytest.mark.timeout(180)
def test_an_energon_prepared_dataset_reads_in_place(tmp_path):
    """Prepared by Megatron-Energon itself (its index beside the tars, its .nv-meta), read by
    streamload without it: the split's tars, the caption and image fields of its field_map."""
    prepare = pytest.importorskip("megatron.energon.flavors.webdataset.prepare")
    import yaml
    root = tmp_path / "energon"
    root.mkdir()
    write_tar(root / "part-000.tar", range(0, 8))
    write_tar(root / "part-001.tar", range(8, 16))
    prepare.WebdatasetPreparator.prepare_dataset(
        root, ["part-000.tar", "part-001.tar"], split_parts_ratio=[("train", 1.0)],
        shuffle_seed=None, workers=1)
    (root / ".nv-meta" / "dataset.yaml").write_text(yaml.safe_dump(
        {"__module__": "megatron.energon", "__class__": "CaptioningWebdataset",
         "field_map": {"image": "jpg", "caption": "txt"}}))
    assert (root / "part-000.tar.idx").exists()
    from streamload.formats.energon import energon_source
    source = energon_source(str(root), images=options())
    assert source.images.fields == ("jpg",) and source.text_field == "txt"
    rows = read_all(source)
    seen = set()
    for sample_id, tokens, labels, loss, images in documents(rows):
        sample = int(sample_id.rsplit("/", 1)[1]) + (8 if "part-001" in sample_id else 0)
        check_sample(sample, tokens, labels, loss, images, source.images)
        seen.add(sample)
    assert seen == set(range(16))
    (root / "part-002.tar").write_bytes((root / "part-000.tar").read_bytes())
    with pytest.raises(sl.ConfigError, match="holds 2 of its 3 tars"):
        energon_source(str(root), images=options())


@pytest.mark.timeout(120)
def test_decoding_in_worker_processes_gives_the_same_batches(tmp_path, monkeypatch):
    """Threads write the patches in place; processes through the step's shared-memory file,
    or, where /dev/shm cannot be had, sent back pickled: the same batches every way, and no
    shared-memory file left behind."""
    import os
    from streamload.vision.decode import SharedPixels
    write_tar(tmp_path / "part-0.tar", range(10))
    source = sl.Source(str(tmp_path), images=options())
    before = set(os.listdir(SharedPixels.DIRECTORY))
    shared = read_all(source, decode_images_in="processes")
    assert not {f for f in set(os.listdir(SharedPixels.DIRECTORY)) - before
                if f.startswith("streamload-pixels-")}
    threads = read_all(source, decode_images_in="threads")
    monkeypatch.setattr(SharedPixels, "DIRECTORY", str(tmp_path / "no-shm"))
    pickled = read_all(source, decode_images_in="processes")
    for other in (threads, pickled):
        assert [m.sample_ids for m in shared] == [m.sample_ids for m in other]
        for x, y in zip(shared, other):
            assert x.pixel_values.equal(y.pixel_values) and x.tokens.equal(y.tokens)
            assert x.image_grid.equal(y.image_grid)
    assert sum(m.num_images for m in shared) == sum(images_in(s) for s in range(10))


@pytest.mark.timeout(120)
def test_a_text_source_and_an_image_source_in_one_loader(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "text").mkdir()
    write_tar(tmp_path / "pics" / "part-0.tar", range(10))
    from streamload.formats import write_jsonl
    write_jsonl(tmp_path / "text" / "part-0.jsonl", [f"document {k} " * (k + 1)
                                                     for k in range(10)])
    opts = options()
    with sl.Loader([sl.Source(str(tmp_path / "pics"), images=opts),
                    sl.Source(str(tmp_path / "text"))], micro_batch_tokens=512,
                   micro_batches=2, epochs=1, decode_images_in="threads") as loader:
        rows = [mb for b in loader for mb in b.micro_batches]
    seen = {"pics": set(), "text": set()}
    for sample_id, tokens, labels, loss, images in documents(rows):
        name, _, record = sample_id.split("/")
        seen[name].add(int(record))
        if name == "pics":
            check_sample(int(record), tokens, labels, loss, images, opts)
        else:
            assert images == [] and not np.isin(tokens, (IMAGE_ID, BEGIN_ID, END_ID)).any()
    assert seen == {"pics": set(range(10)), "text": set(range(10))}


def test_image_sources_must_share_the_encoder_geometry(tmp_path):
    write_tar(tmp_path / "part-0.tar", range(2))
    with pytest.raises(sl.ConfigError, match="differ in images.patch_size"):
        sl.Loader([sl.Source(str(tmp_path), name="a", images=options()),
                   sl.Source(str(tmp_path), name="b", images=options(patch_size=16))])
    with pytest.raises(sl.ConfigError, match="holds no images"):
        read_all(sl.Source(str(tmp_path), format="jsonl", images=options()))


@pytest.mark.timeout(120)
def test_document_lengths_count_what_the_loader_delivers(tmp_path):
    """`streamload plan` measures an image source as the loader counts it: text plus each
    image's visual tokens and markers, from the headers."""
    import asyncio
    from formatcheck import FileStore, info, problems
    from streamload.formats.webdataset import WebdatasetFormat
    write_tar(tmp_path / "part-0.tar", range(9))
    opts = options()
    lengths, method = asyncio.run(WebdatasetFormat(images=opts).document_lengths(
        FileStore(), info(tmp_path / "part-0.tar"), problems=problems("part-0.tar")))
    rows = read_all(sl.Source(str(tmp_path), images=opts))
    delivered = {int(sid.rsplit("/", 1)[1]): len(tokens)
                 for sid, tokens, _, _, _ in documents(rows)}
    assert method == "scan" and lengths.tolist() == [delivered[s] for s in range(9)]


def shifted(text: str) -> list[int]:
    """A tokenizer: one id per character, 1000 + its code point (a module-level function, so
    the Loader can name it)."""
    return [1000 + ord(c) for c in text]


@pytest.mark.timeout(120)
def test_a_tokenizer_encodes_each_text_piece_between_the_images(tmp_path):
    import tarfile
    from imagecorpus import add_member, image_bytes
    with tarfile.open(tmp_path / "part-0.tar", "w") as tar:
        add_member(tar, "a.txt", b"ab<image>cd")
        add_member(tar, "a.jpg", image_bytes(56, 56))
        add_member(tar, "b.txt", b"x\x00y")   # shifted: 1000 + 0 ... not the image id
    opts = options(image_token_id=300, image_begin_ids=(), image_end_ids=())
    rows = read_all(sl.Source(str(tmp_path), images=opts), tokenizer=shifted)
    docs = {sid.rsplit("/", 1)[1]: tokens.tolist() for sid, tokens, _, _, _ in documents(rows)}
    visual = opts.place(56, 56).tokens
    assert docs["0"] == [1097, 1098] + [300] * visual + [1099, 1100]
    assert docs["1"] == [1120, 1000, 1121]
    # a tokenizer whose ids for the text hold the image id is refused by name
    with pytest.raises(sl.DataError, match="the text's tokens hold image_token_id 1098"):
        read_all(sl.Source(str(tmp_path), images=options(image_token_id=1098)),
                 tokenizer=shifted)
