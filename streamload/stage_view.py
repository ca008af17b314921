"""What one rank receives of its DP rank's step: its context-parallel part of every row, and the
fields its pipeline stage uses.

- CP: the CP group shares each packed row. Each CP rank gets, per document, chunks r and
  2·cp−1−r of 2·cp (documents padded to a multiple of 2·cp), with local cu_seqlens and the
  kept tokens' positions (`plan.context_parallel`, Megatron's THD split).
- PP: the first stage gets tokens and positions, the last labels and the loss mask; every stage
  keeps the attention metadata (cu_seqlens, max_seqlen), which middle stages receive alone, or
  not at all (`Parallel(pipeline_middle="nothing")`). A field a stage does not receive is None.
- TP peers of a DP rank get the identical view.
- Images (a multimodal row): the first stage keeps them (its vision encoder's output goes into
  the image positions of its tokens); the others get None. Context parallelism is refused for
  image sources (`Loader._use_images`).

Runs on the loop's thread, after delivery, so the trainer's thread only takes the result.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from .batch import Batch
from .collective.topology import Topology
from .plan.context_parallel import cp_split

PER_TOKEN = ("tokens", "position_ids", "labels", "loss_mask")
# A multimodal row's images (`vision.batch.VisionMicroBatch`): the vision encoder runs on the
# first stage, which scatters its output into the image positions; later stages get None.
IMAGE_FIELDS = ("image_mask", "pixel_values", "image_grid", "vision_cu_seqlens",
                "image_document")
FIRST_STAGE = ("tokens", "position_ids")
LAST_STAGE = ("labels", "loss_mask")


def needs_view(topology: Optional[Topology]) -> bool:
    return topology is not None and (topology.cp > 1 or topology.pp > 1)


def stage_view(batch: Batch, topology: Topology, pad_token_id: int = 0) -> Batch:
    fill = {"tokens": pad_token_id, "position_ids": 0, "labels": -100, "loss_mask": 0}
    keep = set()
    if topology.first_stage:
        keep.update(FIRST_STAGE)
    if topology.last_stage:
        keep.update(LAST_STAGE)
    metadata = bool(keep) or topology.pipeline_middle == "metadata"
    views = []
    for mb in batch.micro_batches:
        # Only the fields this stage keeps are split (a middle stage splits none).
        present = {name: getattr(mb, name).numpy() for name in PER_TOKEN if name in keep}
        cu_seqlens, max_seqlen, padding = mb.cu_seqlens, mb.max_seqlen, mb.padding
        if topology.cp > 1:
            n = int(mb.cu_seqlens[-1])
            if "tokens" in present:   # which row token each local slot holds (-1: none)
                present["slot"] = np.arange(n)
            local, local_cu, max_seqlen = cp_split(present, mb.cu_seqlens.numpy(), topology.cp,
                                                   topology.cp_rank, {**fill, "slot": -1})
            slot = local.pop("slot", None)
            if slot is not None:   # this part's padding: the split's, and its share of the row's
                padding = int((slot < 0).sum() + (slot >= n - padding).sum())
            present = local
            cu_seqlens = torch.from_numpy(np.asarray(local_cu, dtype=np.int32))
        changes = {name: (torch.from_numpy(np.ascontiguousarray(present[name]))
                          if name in present else None) for name in PER_TOKEN}
        changes["cu_seqlens"] = cu_seqlens if metadata else None
        changes["max_seqlen"] = int(max_seqlen) if metadata else 0
        changes["padding"] = padding if "tokens" in present else 0   # what num_tokens leaves out
        if not topology.first_stage and hasattr(mb, "pixel_values"):
            changes.update(dict.fromkeys(IMAGE_FIELDS))
        views.append(dataclasses.replace(mb, **changes))
    return dataclasses.replace(batch, micro_batches=views)

