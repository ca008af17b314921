"""The vision core: the resizing rule, header probes, patches, interleaving, the image
exchange's messages, the label mask. Real images made with Pillow; no processes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from imagecorpus import image_bytes, noise_bytes
from streamload.errors import ConfigError
from streamload.formats.images import ImageBlob, interleave, natural_key
from streamload.plan.packing import IGNORE_INDEX
from streamload.vision import Images, llava, qwen2_vl
from streamload.vision.batch import VisionMicroBatch, mask_images
from streamload.vision.decode import decode_rgb, patchify
from streamload.vision.exchange import ImageRef, decode_images, encode_images
from streamload.vision.probe import ImageProblem, probe
from streamload.vision.rule import ImageRefused, Placement

pytestmark = pytest.mark.core


@pytest.mark.parametrize("height,width", [(480, 640), (1080, 1920), (20, 30), (4000, 300),
                                          (3000, 4000)])
def test_dynamic_placement_is_a_multiple_of_the_merge_window_within_the_pixel_budget(height,
                                                                                     width):
    opts = qwen2_vl(max_pixels=1024 * 28 * 28, min_pixels=56 * 56)
    placed = opts.place(height, width)
    assert placed.height % 28 == 0 and placed.width % 28 == 0
    assert 56 * 56 <= placed.height * placed.width <= 1024 * 28 * 28
    assert placed.grid == (1, placed.height // 14, placed.width // 14)
    assert placed.tokens == placed.grid[1] * placed.grid[2] // 4
    # the aspect ratio survives (within a merge window's rounding)
    assert abs(placed.width / placed.height - width / height) <= 28 / min(placed.height,
                                                                         placed.width) * 2
    assert opts.image_tokens(placed) == placed.tokens + 2   # vision start and end


def test_fixed_placement_and_the_caps():
    opts = llava()
    assert opts.place(100, 3000) == Placement(336, 336, (1, 24, 24), 576)
    with pytest.raises(ImageRefused, match="max_source_pixels=1,000"):
        llava(max_source_pixels=1000).place(100, 100)
    with pytest.raises(ImageRefused, match="aspect ratio"):
        qwen2_vl().place(10, 5000)
    with pytest.raises(ConfigError, match="multiples of patch_size"):
        Images(image_token_id=5, resize="fixed", size=(300, 300))


def test_probe_reads_the_header_and_refuses_what_would_not_decode():
    jpeg = noise_bytes(123, 45)
    assert probe(jpeg) == ("JPEG", 123, 45)
    assert probe(image_bytes(7, 9, fmt="PNG")) == ("PNG", 7, 9)
    assert probe(image_bytes(31, 17, fmt="WEBP")) == ("WEBP", 31, 17)
    with pytest.raises(ImageProblem, match="truncated JPEG"):
        probe(jpeg[:len(jpeg) // 2])
    png = bytearray(image_bytes(20, 20, fmt="PNG"))
    png[60] ^= 0xFF   # inside the first IDAT chunk: its CRC fails
    with pytest.raises(ImageProblem, match="corrupt PNG"):
        probe(bytes(png))
    with pytest.raises(ImageProblem, match="not an image"):
        probe(b"<html>not found</html>")
    with pytest.raises(ImageProblem, match="empty"):
        probe(b"")


@pytest.mark.parametrize("merge,frames", [(1, 1), (2, 1), (2, 2)])
def test_patches_fold_back_into_the_resized_image(merge, frames):
    rng = np.random.default_rng(0)
    h, w = 2 * 14 * merge, 3 * 14 * merge
    pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    placed = Placement(h, w, (1, h // 14, w // 14), h * w // (14 * 14 * merge * merge))
    patches = patchify(pixels, placed, 14, merge)
    assert patches.shape == (h * w // 196, 3 * 196) and patches.dtype == np.uint8
    # a patch is (channel, row, column): the first one is the top-left 14 x 14 square
    assert np.array_equal(patches[0].reshape(3, 14, 14), pixels[:14, :14].transpose(2, 0, 1))
    if merge == 2:   # the merge window's second patch is the one to the right
        assert np.array_equal(patches[1].reshape(3, 14, 14),
                              pixels[:14, 14:28].transpose(2, 0, 1))
    mb = VisionMicroBatch(None, None, None, None, None, [], 0,
                          pixel_values=torch.from_numpy(patches),
                          image_grid=torch.tensor([placed.grid]),
                          vision_cu_seqlens=torch.tensor([0, patches.shape[0]]),
                          patch_size=14, merge_size=merge, temporal_patch_size=frames)
    assert np.array_equal(mb.images()[0].numpy(), pixels.transpose(2, 0, 1))
    # fed to the model: normalized, each patch's frame repeated T times (channel, frame, ...)
    fed = mb.normalized_pixels(mean=(0, 0, 0), std=(1, 1, 1))
    assert fed.shape == (patches.shape[0], 3 * frames * 196)
    framed = fed.view(-1, 3, frames, 196)
    expected = torch.from_numpy(patches).float().div(255).view(-1, 3, 196)
    for t in range(frames):
        assert torch.allclose(framed[:, :, t], expected)


def test_decode_resizes_to_the_placement():
    color = (200, 30, 90)
    pixels = decode_rgb(image_bytes(300, 200, color), 56, 84)
    assert pixels.shape == (56, 84, 3)
    assert np.abs(pixels.reshape(-1, 3).mean(0) - color).max() < 3
    assert decode_rgb(image_bytes(30, 20, color, "PNG"), 28, 28).shape == (28, 28, 3)


def test_interleave_places_images_by_placeholder_list_or_first():
    blobs = [ImageBlob(f"m{k}", b"") for k in range(2)]
    sample, problem = interleave("k", "a <image> b <image> c", blobs, "<image>")
    assert problem is None and sample.texts == ("a ", " b ", " c")
    sample, _ = interleave("k", "caption", blobs, "<image>")
    assert sample.texts == ("", "", "caption")
    sample, _ = interleave("k", ["x", None, "y", None], blobs, "<image>")
    assert sample.texts == ("x", "y", "")
    sample, _ = interleave("k", "no images", [], "<image>")
    assert sample.texts == ("no images",) and sample.images == ()
    _, problem = interleave("k", "<image> <image> <image>", blobs, "<image>")
    assert problem == "the text has 3 '<image>' placeholder(s) for 2 image(s)"
    _, problem = interleave("k", ["x", None], blobs, "<image>")
    assert "1 image slot(s) for 2" in problem
    assert sorted(["a.10.jpg", "a.9.jpg", "a.0.jpg"], key=natural_key) == \
        ["a.0.jpg", "a.9.jpg", "a.10.jpg"]


def test_the_image_message_round_trips():
    refs = (ImageRef("shard/000001.0.jpg", b"\xff\xd8abc", Placement(28, 56, (1, 2, 4), 2)),
            ImageRef("ünï.png", b"", Placement(14, 14, (1, 1, 1), 1)))
    message = encode_images([refs, (), refs[:1]])
    assert decode_images(message) == [refs, (), refs[:1]]
    assert decode_images(np.zeros(0, np.uint8)) == []


def test_no_label_targets_or_leaves_an_image_position():
    # text 10 11, begin 301, image 300 x3, end 302, text 12 13
    tokens = np.array([10, 11, 301, 300, 300, 300, 302, 12, 13])
    labels = np.append(tokens[1:], IGNORE_INDEX)
    loss = np.ones(9, np.float32)
    loss[-1] = 0
    mask = mask_images(tokens, labels, loss, (300, 301, 302), 300)
    assert mask.tolist() == [False, False, False, True, True, True, False, False, False]
    # 10 -> 11 counts; 11 -> begin, begin.., image.., end -> 12 do not; 12 -> 13 counts
    assert labels.tolist() == [11] + [IGNORE_INDEX] * 6 + [13, IGNORE_INDEX]
    assert loss.tolist() == [1, 0, 0, 0, 0, 0, 0, 1, 0]


def test_the_encoder_cost_of_a_sample_sums_its_images():
    from streamload.plan.cost import CostModel
    from streamload.vision.cost import EncoderCost, item_patches
    from streamload.vision.exchange import ImageRef
    enc = EncoderCost.transformer(600e6, 32, 1280)
    assert enc.a == 12 * 32 * 1280 and enc.b == 6 * 600e6
    costs = enc.sample_costs([[100, 300], [], [400]])
    assert costs.tolist() == [enc.a * (100 ** 2 + 300 ** 2) + enc.b * 400, 0.0,
                              enc.a * 400 ** 2 + enc.b * 400]
    # one 400-patch image costs more than two that add up to it (attention within an image)
    assert costs[2] > costs[0]
    # the same units as the backbone's CostModel.transformer (FLOPs): the parts add up
    backbone = CostModel.transformer(7e9, 32, 4096)
    assert backbone.b / enc.b == pytest.approx(7e9 / 600e6)

    class Item:   # what the fetcher buffers: an image item's images, or none
        def __init__(self, *grids):
            self.images = tuple(ImageRef("m", b"", Placement(0, 0, g, 0)) for g in grids)
    assert item_patches([Item((1, 10, 20), (1, 2, 2)).images, Item().images, ()]) == \
        [[200, 4], [], []]
