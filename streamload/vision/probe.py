"""An image's format and size from its header, and a cheap check that the rest is all there.

`probe(data)` opens the bytes with Pillow's lazy `Image.open`, which parses the header and
decodes no pixels, so the fetcher learns an image's size (and, through the rule, its visual
tokens) at a small fraction of a decode's cost. It also refuses what a decode would fail on
later, after the sample was planned: bytes that are no image Pillow reads, a JPEG cut short
(no end-of-image marker in its tail), a PNG whose chunks do not verify (Pillow's `verify`
checks each chunk's CRC up to IEND without decompressing). A bit flipped inside a JPEG's
entropy-coded data passes: libjpeg decodes it, with a damaged block, as every loader does.
"""
from __future__ import annotations

import io
import warnings
from typing import NamedTuple

FORMATS = ("JPEG", "PNG", "WEBP")
_JPEG_END = b"\xff\xd9"
_JPEG_TAIL = 4096   # trailing bytes searched for the end marker (some writers pad after it)


class ImageProblem(ValueError):
    """What is wrong with an image's bytes (the caller names the sample and member)."""


class Header(NamedTuple):
    format: str     # "JPEG", "PNG", "WEBP"
    width: int
    height: int


def probe(data: bytes) -> Header:
    from PIL import Image, UnidentifiedImageError
    if not data:
        raise ImageProblem("empty image member")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise ImageProblem(f"image too large to open: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageProblem(f"not an image Pillow can read ({type(exc).__name__}: {exc})") \
            from None
    fmt = image.format
    if fmt not in FORMATS:
        raise ImageProblem(f"unsupported image format {fmt} (expected JPEG, PNG or WebP)")
    width, height = image.size
    if fmt == "JPEG" and _JPEG_END not in data[-_JPEG_TAIL:]:
        raise ImageProblem("truncated JPEG (no end-of-image marker)")
    if fmt == "PNG":
        try:
            image.verify()
        except Exception as exc:   # Pillow raises SyntaxError, OSError, struct.error, ...
            raise ImageProblem(f"corrupt PNG ({type(exc).__name__}: {exc})") from None
    return Header(fmt, width, height)
