"""`Images`: a source's image options (which members or columns hold images, the resizing rule,
the placeholder tokens). Validated once, where the Source is made."""
from __future__ import annotations

from typing import Literal, Optional

import msgspec

from ..errors import ConfigError
from .rule import Placement, place

# WebDataset member extensions, and Parquet columns (the first a file has), holding images
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "image", "images")


class Images(msgspec.Struct, kw_only=True, frozen=True):
    """What makes a source multimodal (`Source(images=Images(...))`, or a dict of these).

    * `image_token_id`: the model's image placeholder id (LLaVA's `<image>`, Qwen2-VL's
      `<|image_pad|>`); each image becomes that many of it as it has visual tokens, between
      `image_begin_ids` and `image_end_ids` (Qwen2-VL: `<|vision_start|>`, `<|vision_end|>`).
    * `placeholder`: where an image goes in the text ("<image>"); an image the text does not
      place goes before the text, in order (LLaVA's convention).
    * `fields`: WebDataset member extensions that hold images (`0.jpg`, `1.png`, ... too: any
      extension ending in one of them), or the Parquet column of images (a Hugging Face
      `datasets` Image: a struct of `bytes` and `path`, or a list of them).
    * the rule (`vision.rule`): `resize` "dynamic" (Qwen2-VL: `min_pixels`..`max_pixels`,
      multiples of patch_size·merge_size) or "fixed" (`size` = [height, width]);
      `temporal_patch_size` frames per patch (Qwen2-VL: 2); `max_source_pixels` refuses larger
      source images.
    * `encoded_bytes_per_token`: what the memory budget counts for each buffered token of this
      source on top of the token itself: the encoded image bytes a buffered item holds per token
      of its fused sequence (JPEG at Qwen2-VL's 28 px per merged token: ~150-250; more for PNG
      or large sources shrunk a lot). An estimate fixed up front (the windows must be alike on
      every rank), not a limit the buffer enforces.
    """
    image_token_id: int
    image_begin_ids: tuple[int, ...] = ()
    image_end_ids: tuple[int, ...] = ()
    placeholder: str = "<image>"
    fields: tuple[str, ...] = IMAGE_EXTENSIONS
    resize: Literal["dynamic", "fixed"] = "dynamic"
    size: Optional[tuple[int, int]] = None
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 1
    min_pixels: int = 56 * 56
    max_pixels: int = 1024 * 28 * 28
    max_source_pixels: int = 89_478_485   # Pillow's decompression-bomb limit
    max_images: int = 64                  # per sample
    encoded_bytes_per_token: int = 256    # the memory budget's estimate (see above)

    def __post_init__(self):
        def fail(key, problem):
            raise ConfigError.at(key, problem)
        for key in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels",
                    "max_pixels", "max_source_pixels", "max_images"):
            if getattr(self, key) < 1:
                fail(key, f"must be an integer >= 1, got {getattr(self, key)!r}")
        if self.encoded_bytes_per_token < 0:
            fail("encoded_bytes_per_token",
                 f"must be an integer >= 0, got {self.encoded_bytes_per_token!r}")
        ids = (self.image_token_id, *self.image_begin_ids, *self.image_end_ids)
        if any(not 0 <= i < 2 ** 31 for i in ids):
            fail("image_token_id", f"token ids must be in 0..2**31-1, got {ids}")
        if not self.placeholder:
            fail("placeholder", "must be a non-empty string")
        if not self.fields or not all(self.fields):
            fail("fields", "must name at least one member extension or column")
        factor = self.patch_size * self.merge_size
        if self.resize == "fixed":
            if self.size is None or any(s < factor or s % factor for s in self.size):
                fail("size", f"resize='fixed' needs size=[height, width], multiples of "
                             f"patch_size*merge_size={factor}, got {self.size!r}")
        elif self.min_pixels > self.max_pixels or self.max_pixels < factor * factor:
            fail("max_pixels", f"must be >= min_pixels ({self.min_pixels}) and >= "
                               f"(patch_size*merge_size)**2 = {factor * factor}")

    @property
    def patch_values(self) -> int:
        """Values per patch as batches carry it: 3 channels x p x p (one frame; the model's T
        frames are repeated where it is fed)."""
        return 3 * self.patch_size * self.patch_size

    @property
    def structural_ids(self) -> tuple[int, ...]:
        """The ids the loader puts around and for images (no label targets them)."""
        return (self.image_token_id, *self.image_begin_ids, *self.image_end_ids)

    def place(self, height: int, width: int) -> Placement:
        """The image's resized size, grid and visual tokens (`vision.rule.place`)."""
        return place(height, width, mode=self.resize, patch_size=self.patch_size,
                     merge_size=self.merge_size, size=self.size, min_pixels=self.min_pixels,
                     max_pixels=self.max_pixels, max_source_pixels=self.max_source_pixels)

    def image_tokens(self, placement: Placement) -> int:
        """Tokens an image takes in the fused sequence: its visual tokens and the markers."""
        return placement.tokens + len(self.image_begin_ids) + len(self.image_end_ids)

    def is_image(self, extension: str) -> bool:
        """A WebDataset member extension that holds an image ("jpg", "0.jpg", "left.png")."""
        last = extension.rsplit(".", 1)[-1]
        return last in self.fields


def qwen2_vl(image_token_id: int = 151655, vision_start_id: int = 151652,
             vision_end_id: int = 151653, **options) -> Images:
    """Qwen2-VL's processor settings: dynamic resolution, patch 14, merge 2, two frames."""
    return Images(image_token_id=image_token_id, image_begin_ids=(vision_start_id,),
                  image_end_ids=(vision_end_id,), temporal_patch_size=2, **options)


def llava(image_token_id: int = 32000, **options) -> Images:
    """LLaVA-1.5's: every image 336 x 336 for CLIP ViT-L/14 (576 tokens), no merge."""
    return Images(image_token_id=image_token_id, resize="fixed", size=(336, 336),
                  patch_size=14, merge_size=1, **options)
