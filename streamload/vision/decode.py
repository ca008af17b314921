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
import mmap
import os
import warnings
from typing import Optional

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


def patchify(pixels: np.ndarray, placement: Placement, patch_size: int, merge_size: int,
             out: Optional[np.ndarray] = None) -> np.ndarray:
    """uint8 [t·h·w, 3·p·p] patches of `pixels` [h·p, w·p, 3] (see the module), written into
    `out` (that shape) when given: one strided copy, no intermediate."""
    p, m = patch_size, merge_size
    _, gh, gw = placement.grid
    x = pixels.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    if out is None:
        return np.ascontiguousarray(x).reshape(gh * gw, 3 * p * p)
    out.reshape(x.shape)[...] = x
    return out


def decode_patches(data: bytes, placement: Placement, patch_size: int, merge_size: int,
                   out: Optional[np.ndarray] = None) -> np.ndarray:
    pixels = decode_rgb(data, placement.height, placement.width)
    return patchify(pixels, placement, patch_size, merge_size, out)


def decode_one(data: bytes, placement: tuple, patch_size: int, merge_size: int,
               into=None):
    """Run in a worker: one image's patches, or the text of the exception it raised (the
    caller names the sample and member). `into`: where to write them instead of returning
    them: an array (a thread of this process), or (path, byte offset) of a shared-memory
    file (`SharedPixels`, a worker process), then None comes back."""
    placement = Placement(*placement)
    try:
        if into is None:
            return decode_patches(data, placement, patch_size, merge_size)
        if isinstance(into, np.ndarray):
            decode_patches(data, placement, patch_size, merge_size, into)
            return None
        path, offset = into
        shape = (placement.grid[0] * placement.grid[1] * placement.grid[2],
                 3 * patch_size * patch_size)
        with open(path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), offset + shape[0] * shape[1])
        try:
            out = np.frombuffer(mapped, np.uint8, shape[0] * shape[1], offset).reshape(shape)
            decode_patches(data, placement, patch_size, merge_size, out)
            del out
        finally:
            mapped.close()
        return None
    except Exception as exc:   # Pillow raises OSError, SyntaxError, ValueError, ...
        return f"{type(exc).__name__}: {exc}"


class SharedPixels:
    """A step's pixels in a file of /dev/shm that the worker processes write the patches into
    (`decode_one`), so that they cross no pipe: no pickling there, no unpickling and no copy
    here. `array` maps it; the file is removed (`unlink`) once the step's images are written,
    and the memory goes back when the last tensor viewing it is gone. `create` returns None
    where /dev/shm is missing or cannot hold it (its space is reserved up front: a tmpfs that
    runs out kills the writer with SIGBUS); then the patches come back pickled."""

    DIRECTORY = "/dev/shm"

    def __init__(self, path: str, array: np.ndarray):
        self.path, self.array = path, array

    @classmethod
    def create(cls, size: int) -> "Optional[SharedPixels]":
        import tempfile
        if size <= 0 or not os.path.isdir(cls.DIRECTORY):
            return None
        try:
            fd, path = tempfile.mkstemp(prefix="streamload-pixels-", dir=cls.DIRECTORY)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)
            mapped = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            os.unlink(path)
            return None
        os.close(fd)
        return cls(path, np.frombuffer(mapped, np.uint8))

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
