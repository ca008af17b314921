"""Real image-text corpora for the multimodal tests: JPEG/PNG files made with Pillow, written
into real WebDataset tars and Parquet files (Hugging Face `datasets`' Image layout)."""
from __future__ import annotations

import io
import tarfile

import numpy as np

from streamload.vision import Images

IMAGE_ID, BEGIN_ID, END_ID = 300, 301, 302


def options(**kw) -> Images:
    """Small dynamic images (at most 4 x 4 merged tokens of 28 px) keep rows short."""
    base = dict(image_token_id=IMAGE_ID, image_begin_ids=(BEGIN_ID,), image_end_ids=(END_ID,),
                max_pixels=112 * 112, min_pixels=28 * 28)
    return Images(**{**base, **kw})


def color_of(sample: int, image: int) -> tuple[int, int, int]:
    """A flat colour that names (sample, image), readable back from decoded pixels."""
    return (20 + (sample * 37) % 200, 20 + (image * 53) % 200, 128)


def image_bytes(width: int, height: int, color=(128, 64, 32), fmt: str = "JPEG") -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, fmt, **({"quality": 95}
                                                             if fmt == "JPEG" else {}))
    return out.getvalue()


def size_of(sample: int, image: int) -> tuple[int, int]:
    return 40 + (sample * 13 + image * 29) % 120, 30 + (sample * 7 + image * 17) % 90


def images_in(sample: int) -> int:
    return sample % 4   # 0..3


def caption(sample: int) -> str:
    words = " ".join(f"w{sample}_{k}" for k in range(1 + sample % 5))
    n = images_in(sample)
    if n and sample % 2:   # placeholders, interleaved
        return " ".join(f"<image> part{k}" for k in range(n)) + f" {words}"
    return f"caption {sample}: {words}"   # none: the images go first


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tar(path, samples: range, *, fmt: str = "JPEG", extra=None) -> None:
    """A WebDataset tar: per sample `KEY.txt` and `KEY.{k}.jpg` (or .png) members."""
    ext = "jpg" if fmt == "JPEG" else "png"
    with tarfile.open(path, "w") as tar:
        for s in samples:
            key = f"{s:06d}"
            add_member(tar, f"{key}.txt", caption(s).encode())
            for k in range(images_in(s)):
                w, h = size_of(s, k)
                add_member(tar, f"{key}.{k}.{ext}", image_bytes(w, h, color_of(s, k), fmt))
            if extra is not None:
                extra(tar, key, s)


def write_parquet(path, samples: range, *, listed: bool = True) -> None:
    """`datasets`' layout: a text column and an image column of struct<bytes, path> (a list of
    them per row with `listed`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    texts, cells = [], []
    for s in samples:
        texts.append(caption(s))
        blobs = [{"bytes": image_bytes(*size_of(s, k), color_of(s, k)), "path": f"{s}_{k}.jpg"}
                 for k in range(images_in(s))]
        cells.append(blobs if listed else (blobs[0] if blobs else None))
    type_ = pa.list_(image) if listed else image
    pq.write_table(pa.table({"text": texts, "images" if listed else "image":
                             pa.array(cells, type=type_)}), path, row_group_size=4)


def visual_tokens(sample: int, opts: Images) -> list[int]:
    return [opts.place(size_of(sample, k)[1], size_of(sample, k)[0]).tokens
            for k in range(images_in(sample))]


def noise_bytes(width: int, height: int, seed: int = 0, fmt: str = "JPEG") -> bytes:
    """An image of random pixels: its encoded data is mostly entropy-coded pixels, so a cut in
    the middle falls after the header."""
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()
