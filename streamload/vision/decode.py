"""Image bytes -> the resized image's encoder patches (uint8), in a worker.

`decode_patches(data, placement, p, m)` decodes with the decoder chosen by measurement
(`benchmarks/multimodal.py`, docs/benchmarks.md): a JPEG with simplejpeg (libjpeg-turbo, 1.3x
Pillow's decode rate here) when it is installed (the `vision` extra), else with Pillow, each
at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling) when the image is to shrink that much; PNG
and WebP with Pillow; then Pillow's bicubic resize to the placement's size (the larger part
of the work: a 2-megapixel photo takes ~4 ms to decode and ~9 ms to resize). The two JPEG
decoders differ by a fraction of a grey level (different chroma upsampling): the ranks of a
job share an environment, and so a decoder. Pillow releases the GIL inside its decoder
and its resampler, so threads decode in parallel too; the loader runs it in worker
processes (`image_workers`), so the trainer's interpreter does none of it.

Patches (`patchify`): the resized image's (h·p) x (w·p) pixels cut into p x p patches, each
flattened as (channel, row, column), and ordered so that each m x m block the merger joins is
contiguous: (h/m, w/m, m, m), Qwen2-VL's order. A still image is one frame: a model whose
patches span T frames (Qwen2-VL: 2 equal frames) gets them repeated where it is fed
(`VisionMicroBatch.to_qwen2_vl`, on its device), not T copies moved and held here. With m = 1 that is plain
row-major order, which `batch.images()` folds back into [3, H, W] images for a CLIP encoder.
Values stay uint8 0..255: a quarter of float32's bytes in flight; the trainer normalizes on
its device.
"""
from __future__ import annotations

import io
import warnings

import numpy as np

from .rule import Placement


def _simplejpeg():
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


_JPEG_START = b"\xff\xd8"


def decode_rgb(data: bytes, height: int, width: int) -> np.ndarray:
    """uint8 [height, width, 3]: the image decoded, converted to RGB and resized (bicubic)."""
    from PIL import Image
    simplejpeg = _simplejpeg() if data[:2] == _JPEG_START else None
    if simplejpeg is not None:
        try:   # libjpeg-turbo's scaled decode, never below the target
            pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=height,
                                            min_width=width)
        except ValueError:   # a JPEG it does not read (CMYK, ...): Pillow's turn
            simplejpeg = None
        else:
            image = Image.fromarray(pixels)
    if simplejpeg is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format == "JPEG":
                image.draft("RGB", (width, height))   # scaled decode, never below the target
            if image.mode != "RGB":   # (convert copies even when the mode is the same)
                image = image.convert("RGB")
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(image)


def patchify(pixels: np.ndarray, placement: Placement, patch_size: int,
             merge_size: int) -> np.ndarray:
    """uint8 [t·h·w, 3·p·p] patches of `pixels` [h·p, w·p, 3] (see the module)."""
    p, m = patch_size, merge_size
    _, gh, gw = placement.grid
    x = pixels.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    return np.ascontiguousarray(x).reshape(gh * gw, 3 * p * p)


def decode_patches(data: bytes, placement: Placement, patch_size: int,
                   merge_size: int) -> np.ndarray:
    pixels = decode_rgb(data, placement.height, placement.width)
    return patchify(pixels, placement, patch_size, merge_size)


def decode_many(jobs: list) -> list:
    """Run in a worker: each job (data, placement, p, m) -> its patches, or the text of the
    exception it raised (the caller names the sample and member)."""
    out = []
    for data, placement, p, m in jobs:
        try:
            out.append(decode_patches(data, Placement(*placement), p, m))
        except Exception as exc:   # Pillow raises OSError, SyntaxError, ValueError, ...
            out.append(f"{type(exc).__name__}: {exc}")
    return out
