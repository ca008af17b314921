"""What the trainer receives: one Batch per step, holding exactly M MicroBatches."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class MicroBatch:
    tokens: torch.Tensor          # int64 [n], n <= micro_batch_tokens
    cu_seqlens: torch.Tensor      # int32 [docs + 1], document boundaries (for varlen attention)
    position_ids: torch.Tensor    # int64 [n], restarting at 0 in every document
    sample_ids: list[str]         # "source/shard/record", ":k" for the k-th piece of a split doc,
                                  # ":k+o" for its rest from token o after a cut (`pieces`)
    max_seqlen: int               # longest document in the row

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class Batch:
    step: int
    epoch: int
    micro_batches: list[MicroBatch]
    rank_tokens: np.ndarray = field(repr=False)  # tokens planned for each rank this step
    rank_cost: np.ndarray = field(repr=False)    # predicted cost of each rank this step
    max_deferral: int = 0      # steps the longest-waiting sample of this step was deferred

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)

    @property
    def imbalance(self) -> float:
        """Predicted max rank cost / mean rank cost (1.0 is perfect)."""
        mean = float(self.rank_cost.mean())
        return float(self.rank_cost.max() / mean) if mean > 0 else 1.0
