"""The vision encoder's part of an image-text sample's cost (issue 23, item 4). The runtime
adds it to each image item's extra cost for the planner (`vision/hybrid.py`, under
image_cost="hybrid"), and the Batch and stats() report it apart from the backbone's part
(`Batch.encoder_cost`).

A sample costs `encoder(images) + backbone(fused length)`. The backbone's part is the loader's
`CostModel` over the fused sequence (text plus visual tokens: the item's length). The encoder's
is its own a·n² + b·n per image of n patches, summed over the sample's images: a ViT attends
within each image (varlen over `vision_cu_seqlens`), bidirectionally, so a = 12·layers·d_model
(the full square, forward and backward) and b = 6·params, in FLOPs like
`CostModel.transformer`, so that the two parts add up in the same units.

Under the schedule where a rank runs its encoder then its backbone (the usual FSDP/DDP VLM
step), a rank's time is the sum of both over its samples, so the planner's objective stays
what it is with the encoder's cost as each sample's extra cost (`Candidates.extra_cost`).
Where encoder and backbone run on separate stages, the step waits on the larger of the two per
rank, which needs a two-part objective in the balancer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class EncoderCost:
    a: float   # per image: a·n² + b·n over its n patches
    b: float

    @classmethod
    def transformer(cls, n_params: float, n_layers: int, d_model: int) -> "EncoderCost":
        """A ViT's forward-plus-backward FLOPs: bidirectional attention within each image."""
        return cls(a=12.0 * n_layers * d_model, b=6.0 * float(n_params))

    @classmethod
    def vit_600m(cls) -> "EncoderCost":
        """Qwen2-VL's ViT shape: ~600M parameters, 32 layers, width 1280."""
        return cls.transformer(600e6, 32, 1280)

    def image_costs(self, patches) -> np.ndarray:
        n = np.asarray(patches, dtype=np.float64)
        return self.a * n * n + self.b * n

    def sample_costs(self, patches_per_sample: Sequence[Sequence[int]]) -> np.ndarray:
        """Each sample's encoder cost: the sum over its images (0 for a text sample)."""
        return np.array([float(self.image_costs(p).sum()) if len(p) else 0.0
                         for p in patches_per_sample], dtype=np.float64)


def item_patches(images: Iterable) -> list[list[int]]:
    """Each buffered item's patches per image, from its images (a buffer block's `images`:
    per item, its `ImageRef`s, each `.placement.grid`; () for a text item): what
    `hybrid.window_costs` hands `EncoderCost.sample_costs`."""
    return [[g[0] * g[1] * g[2] for g in (ref.placement.grid for ref in refs)]
            for refs in images]
