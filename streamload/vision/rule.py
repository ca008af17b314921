"""The resizing rule: an image's size on the encoder, and so its visual tokens, from its header.

Pure arithmetic, no pixels: the fetcher knows an image's width and height from its header
(`vision.probe`), and this module turns them into what planning needs, before anything is
decoded:

* `fixed`: every image resized to `size` = (height, width) (LLaVA's 336 x 336 for CLIP
  ViT-L/14), a grid of (1, height / p, width / p) patches;
* `dynamic`: the image keeps its aspect ratio and about its size, rounded to a multiple of
  f = p·m (patch size p, merge m, NaViT / Qwen2-VL style), then scaled down to at most
  `max_pixels` or up to at least `min_pixels` (keeping the aspect ratio, and the multiple of
  f). The grid is (1, h / p, w / p).

An image of grid (t, h, w) gives the encoder t·h·w patches of 3·T·p·p values (T: the temporal
patch, 2 in Qwen2-VL, whose still images are two equal frames), and the language model
t·h·w / m² visual tokens (the merger joins m x m neighbouring patches into one). Those tokens,
plus the text's, are a sample's length for planning.

An image whose aspect ratio is past `MAX_ASPECT` has no sensible grid (Qwen2-VL refuses them
too) and is refused; so is a source image of more than `max_source_pixels` (a decompression
bomb's defence: decoding it would need that many pixels in memory before the resize).
"""
from __future__ import annotations

import math
from typing import NamedTuple

MAX_ASPECT = 200   # longest side / shortest side


class ImageRefused(ValueError):
    """The rule cannot place this image (too large a source, too extreme an aspect ratio)."""


class Placement(NamedTuple):
    height: int          # resized, in pixels
    width: int
    grid: tuple          # (t, h, w) in patches
    tokens: int          # visual tokens on the language model's side


def _round_to(value: float, factor: int) -> int:
    return max(factor, int(round(value / factor)) * factor)


def place(height: int, width: int, *, mode: str, patch_size: int, merge_size: int,
          size: tuple | None = None, min_pixels: int = 0, max_pixels: int = 1 << 62,
          max_source_pixels: int = 1 << 62) -> Placement:
    """Where an image of `height` x `width` pixels goes on the encoder (see the module)."""
    if height < 1 or width < 1:
        raise ImageRefused(f"image of {width}x{height} pixels has no area")
    if height * width > max_source_pixels:
        raise ImageRefused(f"image of {width}x{height} = {width * height:,} pixels is larger "
                           f"than max_source_pixels={max_source_pixels:,} (decoding it would "
                           f"hold them all); raise the cap or resize the corpus")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageRefused(f"image of {width}x{height} has an aspect ratio over {MAX_ASPECT}")
    p, m = patch_size, merge_size
    factor = p * m
    if mode == "fixed":
        h, w = size
    else:
        h, w = _round_to(height, factor), _round_to(width, factor)
        if h * w > max_pixels:
            scale = math.sqrt(height * width / max_pixels)
            h = max(factor, math.floor(height / scale / factor) * factor)
            w = max(factor, math.floor(width / scale / factor) * factor)
        elif h * w < min_pixels:
            scale = math.sqrt(min_pixels / (height * width))
            h = math.ceil(height * scale / factor) * factor
            w = math.ceil(width * scale / factor) * factor
    grid = (1, h // p, w // p)
    return Placement(h, w, grid, grid[0] * grid[1] * grid[2] // (m * m))
