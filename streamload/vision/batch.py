"""The micro-batch of a multimodal step: a packed row of fused tokens, and its images' patches.

`VisionMicroBatch` is a `MicroBatch` (tokens, cu_seqlens, position_ids, labels, loss_mask,
sample_ids over the fused sequence: text tokens and each image's run of `image_token_id`) with

* `image_mask`  bool [n]: the positions that hold an image's visual tokens (where the model
  scatters the vision encoder's merged outputs, in order);
* `pixel_values` uint8 [patches, 3·p·p]: every image of the row, in the order their
  placeholders appear, packed (`vision.decode`: (channel, row, column) per patch, m x m merge
  blocks contiguous; one frame: `normalized_pixels` repeats it for a model whose patches span
  T frames);
* `image_grid`  int64 [images, 3]: each image's (t, h, w) in patches;
* `vision_cu_seqlens` int32 [images + 1]: where each image's patches start in `pixel_values`
  (the encoder's varlen attention stays inside an image);
* `image_document` int64 [images]: the row's document (segment of `cu_seqlens`) each image
  belongs to.

Labels: no position whose input or target is one of the image ids (`image_token_id`, the
begin and end markers) counts (`IGNORE_INDEX`, loss mask 0), so the loss is the text's.
A row without images has empty `pixel_values`, `image_grid` and one-entry
`vision_cu_seqlens`.

`to_qwen2_vl()` and `to_llava()` hand the row over in those models' forms (docs/guide.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ..batch import MicroBatch
from ..plan.packing import IGNORE_INDEX

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)   # CLIP's, which Qwen2-VL and LLaVA use
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class VisionMicroBatch(MicroBatch):
    image_mask: Optional[torch.Tensor] = None
    pixel_values: Optional[torch.Tensor] = None
    image_grid: Optional[torch.Tensor] = None
    vision_cu_seqlens: Optional[torch.Tensor] = None
    image_document: Optional[torch.Tensor] = None
    patch_size: int = 14
    merge_size: int = 1
    temporal_patch_size: int = 1

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid is None else int(self.image_grid.shape[0])

    def normalized_pixels(self, mean: Sequence[float] = CLIP_MEAN,
                          std: Sequence[float] = CLIP_STD, dtype: torch.dtype = torch.float32,
                          pixels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`pixel_values` (or `pixels`, e.g. them moved to the device first: uint8 is a quarter
        of float32's bytes) as (x / 255 - mean) / std per channel, with each patch's frame
        repeated `temporal_patch_size` times: [patches, 3·T·p·p], (channel, frame, row,
        column) per patch as Qwen2-VL's patch embedding reads it."""
        x = (self.pixel_values if pixels is None else pixels).to(dtype).div_(255.0)
        n, T = x.shape[0], self.temporal_patch_size
        x = x.view(n, 3, -1)
        x.sub_(torch.tensor(mean, dtype=dtype, device=x.device).view(1, 3, 1))
        x.div_(torch.tensor(std, dtype=dtype, device=x.device).view(1, 3, 1))
        return x.unsqueeze(2).expand(n, 3, T, x.shape[2]).reshape(n, -1)

    def images(self) -> list[torch.Tensor]:
        """Each image as uint8 [3, H, W], the patches folded back."""
        p, m = self.patch_size, self.merge_size
        out = []
        bounds = self.vision_cu_seqlens.tolist()
        for k, (_, gh, gw) in enumerate(self.image_grid.tolist()):
            x = self.pixel_values[bounds[k]:bounds[k + 1]]
            x = x.view(gh // m, gw // m, m, m, 3, p, p)
            x = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * p, gw * p)
            out.append(x)
        return out

    def to_qwen2_vl(self, mean: Sequence[float] = CLIP_MEAN,
                    std: Sequence[float] = CLIP_STD) -> dict:
        """Qwen2-VL's forward inputs for one packed row: input_ids, labels, position_ids
        [1, n]; pixel_values float32 [patches, 3·2·14·14] normalized, two equal frames per
        patch (`normalized_pixels`: pass `pixels=` the uint8 on the device); image_grid_thw
        [images, 3]; and the packing's cu_seqlens (the text's documents) and
        vision_cu_seqlens (the encoder's images). Qwen2-VL's 3-D rope positions are the
        model's to derive from input_ids and image_grid_thw, per document of cu_seqlens."""
        return {"input_ids": self.tokens.unsqueeze(0), "labels": self.labels.unsqueeze(0),
                "position_ids": self.position_ids.unsqueeze(0),
                "pixel_values": self.normalized_pixels(mean, std),
                "image_grid_thw": self.image_grid, "cu_seqlens": self.cu_seqlens,
                "vision_cu_seqlens": self.vision_cu_seqlens}

    def to_llava(self, mean: Sequence[float] = CLIP_MEAN,
                 std: Sequence[float] = CLIP_STD) -> dict:
        """LLaVA's: input_ids, labels, position_ids [1, n]; pixel_values float32
        [images, 3, H, W] normalized (fixed-size images: all one size); cu_seqlens."""
        if self.num_images:
            images = torch.stack(self.images()).float().div_(255.0)
            images.sub_(torch.tensor(mean).view(1, 3, 1, 1)).div_(
                torch.tensor(std).view(1, 3, 1, 1))
        else:
            images = torch.zeros(0, 3, 0, 0)
        return {"input_ids": self.tokens.unsqueeze(0), "labels": self.labels.unsqueeze(0),
                "position_ids": self.position_ids.unsqueeze(0), "pixel_values": images,
                "cu_seqlens": self.cu_seqlens}


def mask_images(tokens: np.ndarray, labels: np.ndarray, loss_mask: np.ndarray,
                structural_ids: Sequence[int], image_token_id: int) -> np.ndarray:
    """In place: no label at positions whose input or target is an image id; returns the
    image mask (the positions holding `image_token_id`)."""
    ids = np.asarray(structural_ids, dtype=tokens.dtype)
    inputs = np.isin(tokens, ids)
    masked = inputs | np.isin(labels, ids)
    labels[masked] = IGNORE_INDEX
    loss_mask[masked] = 0.0
    return tokens == image_token_id


def vision_row(row: MicroBatch, pixels: np.ndarray, grids: list[tuple],
               documents: list[int], options) -> VisionMicroBatch:
    """`row` (its arrays are written in place) with its images: `pixels` [patches, 3·p·p]
    (filled by the caller, image after image in placeholder order), `grids` per image,
    `documents` the segment each belongs to."""
    mask = mask_images(row.tokens.numpy(), row.labels.numpy(), row.loss_mask.numpy(),
                       options.structural_ids, options.image_token_id)
    counts = np.asarray([g[0] * g[1] * g[2] for g in grids], dtype=np.int64)
    cu = np.zeros(len(grids) + 1, dtype=np.int32)
    cu[1:] = np.cumsum(counts)
    fields = {f: getattr(row, f) for f in row.__dataclass_fields__}
    return VisionMicroBatch(
        **fields, image_mask=torch.from_numpy(mask), pixel_values=torch.from_numpy(pixels),
        image_grid=torch.as_tensor(np.asarray(grids, dtype=np.int64).reshape(-1, 3)),
        vision_cu_seqlens=torch.from_numpy(cu),
        image_document=torch.as_tensor(np.asarray(documents, dtype=np.int64)),
        patch_size=options.patch_size, merge_size=options.merge_size,
        temporal_patch_size=options.temporal_patch_size)
