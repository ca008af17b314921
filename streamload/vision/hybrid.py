"""Hybrid balancing (issue 23, item 4): the encoder's part of an image sample's cost, as the
planner sees it.

A sample costs `encoder(images) + backbone(fused length)`. The backbone's part is the loader's
`CostModel` (cost_a·L² + cost_b·L over the fused sequence: text plus visual tokens, the item's
length). The encoder's is encoder_cost_a·P² + encoder_cost_b·P per image of P patches
(`cost.EncoderCost`), summed over the sample's images. Both are in the same units.

The schedule modelled: within one rank, the encoder runs over the step's images, then the
backbone over the fused rows (the usual FSDP/DDP VLM step; the encoder's backward follows the
backbone's). A rank's step time is then the sum of both parts over its samples, so the planner's
objective (max over ranks of the summed row costs) is the step's time when each image sample
carries its encoder cost as its extra cost (`Candidates.extra_cost`); no change to the
balancer. Encoder and backbone on separate pipeline stages (the step waits on the larger of
the two per rank) are not modelled.

The patches per image come from each image's header (a buffer block's `images[k][j].placement.grid`,
fixed before any pixel is decoded), so the encoder's cost is known when the head window is
summarised. `LoaderConfig.image_cost = "backbone"` leaves it out (balance by the fused length
only). Pure NumPy.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np

from .cost import EncoderCost, item_patches

# FLOPs of the reference shapes (forward + backward: 6 per parameter per token)
VIT_600M = EncoderCost.transformer(600e6, 32, 1280)
BACKBONE_7B_B = 6.0 * 7e9


def relative(encoder: EncoderCost, backbone_b_flops: float = BACKBONE_7B_B,
             cost_b: float = 1.0) -> EncoderCost:
    """`encoder` (in FLOPs) in the units of a backbone cost model whose linear coefficient is
    `cost_b` for `backbone_b_flops` FLOPs per token (the loader's default cost_b = 1 for a 7B
    decoder: 6·7e9 FLOPs)."""
    scale = cost_b / backbone_b_flops
    return EncoderCost(a=encoder.a * scale, b=encoder.b * scale)


def encoder_model(config) -> Optional[EncoderCost]:
    """The encoder cost the planner adds to image samples: None under image_cost="backbone"."""
    if getattr(config, "image_cost", "hybrid") != "hybrid":
        return None
    return EncoderCost(a=float(config.encoder_cost_a), b=float(config.encoder_cost_b))


def window_costs(images: Sequence, encoder: EncoderCost) -> np.ndarray:
    """Each buffered item's encoder cost from its images (per item, its `ImageRef`s; () for
    an item without images: 0), float64 [n]."""
    return encoder.sample_costs(item_patches(images)) if len(images) else np.zeros(0)


def split_costs(fused_lengths: Sequence[int], patches: Sequence[Sequence[int]],
                backbone, encoder: EncoderCost) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: (backbone cost of the fused length, encoder cost of its images)."""
    lengths = np.asarray(fused_lengths, dtype=np.int64)
    return backbone.doc_cost(lengths).astype(np.float64), encoder.sample_costs(patches)


def imbalance(rank_costs: np.ndarray) -> float:
    """max / mean over ranks (1.0: even; an empty step counts as even)."""
    rank_costs = np.asarray(rank_costs, dtype=np.float64)
    mean = float(rank_costs.mean()) if rank_costs.size else 0.0
    return float(rank_costs.max() / mean) if mean > 0 else 1.0


def step_report(rank_encoder: np.ndarray, rank_backbone: np.ndarray) -> dict:
    """One step's encoder and backbone imbalance apart, and the step's efficiency under the
    sequential schedule (a rank's time = encoder + backbone): balanced time / actual time."""
    enc = np.asarray(rank_encoder, np.float64)
    bb = np.asarray(rank_backbone, np.float64)
    total = enc + bb
    return {"encoder_imbalance": imbalance(enc), "backbone_imbalance": imbalance(bb),
            "imbalance": imbalance(total),
            "efficiency": float(total.mean() / total.max()) if total.max() > 0 else 1.0}


def total_patches(images: Iterable) -> np.ndarray:
    """Each item's patches over all its images (per item, its `ImageRef`s), int64 [n]."""
    return np.array([sum(p) for p in item_patches(images)], dtype=np.int64)
