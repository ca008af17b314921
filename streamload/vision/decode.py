"""Image bytes -> the resized image's encoder patches (uint8), in a worker.

`decode_patches(data, placement, options)` decodes with the decoder chosen by measurement
(`benchmarks/multimodal.py`, docs/benchmarks.md): Pillow, with JPEG "draft" mode, which lets
libjpeg decode at 1/2, 1/4 or 1/8 scale (DCT scaling) when the image is to shrink that much,
then a bicubic resize to the placement's size. Pillow releases the GIL inside its decoder
and its resampler, so threads decode in parallel too; the loader runs it in worker
processes (`image_workers`), so the trainer's interpreter does none of it.

Patches (`patchify`): the resized image's (h·p) x (w·p) pixels cut into p x p patches, each
flattened as (channel, frame, row, column) with the frame repeated T times (`temporal_patch_
size`: Qwen2-VL feeds still images as two equal frames), and ordered so that each m x m block
the merger joins is contiguous: (h/m, w/m, m, m), Qwen2-VL's order. With m = 1 that is plain
row-major order, which `batch.images()` folds back into [3, H, W] images for a CLIP encoder.
Values stay uint8 0..255: a quarter of float32's bytes in flight; the trainer normalizes on
its device.
"""
from __future__ import annotations

import io
import warnings

import numpy as np

from .rule import Placement


def decode_rgb(data: bytes, height: int, width: int) -> np.ndarray:
    """uint8 [height, width, 3]: the image decoded, converted to RGB and resized (bicubic)."""
    from PIL import Image
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = Image.open(io.BytesIO(data))
        if image.format == "JPEG":
            image.draft("RGB", (width, height))   # scaled decode, never below the target
        image = image.convert("RGB")
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(image)


def patchify(pixels: np.ndarray, placement: Placement, patch_size: int, merge_size: int,
             temporal_patch_size: int) -> np.ndarray:
    """uint8 [t·h·w, 3·T·p·p] patches of `pixels` [h·p, w·p, 3] (see the module)."""
    p, m, T = patch_size, merge_size, temporal_patch_size
    _, gh, gw = placement.grid
    x = pixels.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    x = x.reshape(gh * gw, 3, 1, p, p)
    if T > 1:
        x = np.broadcast_to(x, (gh * gw, 3, T, p, p))
    return np.ascontiguousarray(x).reshape(gh * gw, 3 * T * p * p)


def decode_patches(data: bytes, placement: Placement, patch_size: int, merge_size: int,
                   temporal_patch_size: int) -> np.ndarray:
    pixels = decode_rgb(data, placement.height, placement.width)
    return patchify(pixels, placement, patch_size, merge_size, temporal_patch_size)


def decode_many(jobs: list) -> list:
    """Run in a worker: each job (data, placement, p, m, T) -> its patches, or the text of the
    exception it raised (the caller names the sample and member)."""
    out = []
    for data, placement, p, m, T in jobs:
        try:
            out.append(decode_patches(data, Placement(*placement), p, m, T))
        except Exception as exc:   # Pillow raises OSError, SyntaxError, ValueError, ...
            out.append(f"{type(exc).__name__}: {exc}")
    return out
