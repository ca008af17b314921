"""Image-text records: what a multimodal source's formats hand the fetcher.

A record of a source with `images` is an `ImageText`: the sample's text cut at its images,
`texts[0] image[0] texts[1] ... image[n-1] texts[n]` (n >= 0; a sample without images is one
text), and each image's encoded bytes with the member (WebDataset) or cell (Parquet) it came
from, so that a problem with it later names it. Formats find the images; pixels are the
pipeline's business (`pipeline/images.py` reads headers, the delivery decodes).

Where the images go in the text (`interleave`):

* a text with placeholders ("<image>", `Images.placeholder`): one per image, in order;
* a text without any: the images go first, in order, then the text (LLaVA's convention);
* a list (a JSON member's or column's field holding ["text", null, "more", ...]): each null
  takes the next image (OBELICS-style interleaved documents).

Any other count (3 placeholders for 2 images) is a record problem, never a guess.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence, Union

_NUMBER = re.compile(r"(\d+)")


@dataclass(frozen=True)
class ImageBlob:
    member: str     # where it came from: the tar member's name, or "column[row][k]"
    data: bytes


@dataclass(frozen=True)
class ImageText:
    key: str                    # the sample's key (a tar's sample key; a Parquet row number)
    texts: tuple[str, ...]      # len(images) + 1
    images: tuple[ImageBlob, ...]


def natural_key(name: str) -> list:
    """'img.10.jpg' after 'img.9.jpg': the members of a sample in the order their names count."""
    return [int(p) if p.isdigit() else p for p in _NUMBER.split(name)]


def interleave(key: str, text: Union[str, Sequence[Optional[str]]], images: Sequence[ImageBlob],
               placeholder: str) -> tuple[Optional[ImageText], Optional[str]]:
    """(ImageText, None), or (None, what is wrong): see the module for the three layouts."""
    images = tuple(images)
    if isinstance(text, str):
        parts = text.split(placeholder)
        if len(parts) == 1:   # no placeholder: the images first
            return ImageText(key, ("",) * len(images) + (text,), images), None
        if len(parts) - 1 != len(images):
            return None, (f"the text has {len(parts) - 1} {placeholder!r} placeholder(s) for "
                          f"{len(images)} image(s)")
        return ImageText(key, tuple(parts), images), None
    texts, current, slots = [], [], 0
    for k, part in enumerate(text):
        if part is None:
            texts.append("".join(current))
            current, slots = [], slots + 1
        elif isinstance(part, str):
            current.append(part)
        else:
            return None, (f"interleaved list item {k} is {type(part).__name__}; expected a "
                          f"string or null (an image)")
    texts.append("".join(current))
    if slots != len(images):
        return None, f"the interleaved list has {slots} image slot(s) for {len(images)} image(s)"
    return ImageText(key, tuple(texts), images), None


def member_text(data: bytes, member: str, field: Optional[str]
                ) -> tuple[Union[str, list, None], Optional[str]]:
    """(text or interleaved list, None) or (None, what is wrong) of a tar's text member: its
    UTF-8 text, or with `field` the field of its JSON object (a string, or a list of strings
    and nulls)."""
    import msgspec
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, f"member {member!r} is not valid UTF-8"
    if field is None:
        return text, None
    try:
        record = msgspec.json.decode(data)
    except msgspec.MsgspecError as exc:
        return None, f"member {member!r}: invalid JSON: {exc}"
    if not isinstance(record, dict):
        return None, f"member {member!r}: not a JSON object"
    if field not in record:
        fields = ", ".join(repr(f) for f in list(record)[:12]) or "none"
        return None, f"member {member!r}: missing field {field!r}; fields present: {fields}"
    value = record[field]
    if not isinstance(value, (str, list)):
        return None, (f"member {member!r}: field {field!r} is {type(value).__name__}; expected "
                      f"a string or a list of strings and nulls")
    return value, None


def measure_image_records(records: list, tokenizer, images, problems,
                          with_patches: bool = False) -> list:
    """The length of each image-text record as the loader counts it (`document_lengths` of a
    source with images): its text pieces' tokens (UTF-8 bytes without a tokenizer) plus each
    image's tokens, from its header (`Images.place`). An image that does not probe is reported
    to `problems` and its record left out, as the loader leaves it out. `with_patches`: each
    record as (index, sample key, length, its images' patches) instead (the dry run's encoder cost and
    caps per row)."""
    import numpy as np
    from ..vision.probe import ImageProblem, probe
    from ..vision.rule import ImageRefused
    out = []
    for record in records:
        sample, visual, problem, patches = record.payload, 0, None, []
        for blob in sample.images:
            try:
                header = probe(blob.data)
                placement = images.place(header.height, header.width)
            except (ImageProblem, ImageRefused) as exc:
                problem = f"sample {sample.key!r}: image member {blob.member!r}: {exc}"
                break
            visual += images.image_tokens(placement)
            patches.append(placement.grid[0] * placement.grid[1] * placement.grid[2])
        if problem is not None:
            problems.record(record.index, problem)
            continue
        texts = [t for t in sample.texts if t]
        if tokenizer is None:
            text = sum(len(t.encode("utf-8")) for t in texts)
        else:
            text = sum(int(np.size(ids)) for ids in tokenizer.encode_texts(texts)) if texts else 0
        out.append((record.index, sample.key, text + visual, tuple(patches)) if with_patches
                   else text + visual)
    return out
