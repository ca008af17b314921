"""What the trainer receives: one Batch per step, holding exactly M MicroBatches.

Every MicroBatch is one packed row, ready for a causal LM loss: `labels` (the next token within
the row's segment, -100 at each segment's last token and on padding) and `loss_mask` (1.0 where
a label counts). With `pad_to="capacity"` every row holds exactly C = micro_batch_tokens
tokens; the padding is the row's last segment of `cu_seqlens` (see `plan/packing.py`).

`Batch.to_megatron()` and `Batch.to_torchtitan()` hand the rows over in those trainers' forms.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from .mixreport import StepMix
from .plan.cost import StepCosts
from .plan.packing import IGNORE_INDEX   # labels with no target: segment ends, padding

__all__ = ["Batch", "MicroBatch", "IGNORE_INDEX"]


@dataclass
class MicroBatch:
    tokens: torch.Tensor          # int64 [n]; n <= micro_batch_tokens, n == C with pad_to
    cu_seqlens: torch.Tensor      # int32 [segments + 1]: the documents (for varlen attention),
                                  # then, in a padded row, the padding as one last segment
    position_ids: torch.Tensor    # int64 [n], restarting at 0 in every segment
    labels: torch.Tensor          # int64 [n], the next token in the segment; -100 at each
                                  # segment's last token (a split document's pieces included)
    loss_mask: torch.Tensor       # float32 [n], 1.0 where labels != -100, else 0.0
    sample_ids: list[str]         # "source/shard/record", ":k" for the k-th piece of a split doc,
                                  # ":k+o" for its rest from token o after a cut (`pieces`);
                                  # one per document, in order (the padding has none)
    max_seqlen: int               # longest segment of cu_seqlens (a padded row's padding too,
                                  # so it bounds every segment a varlen kernel is given)
    padding: int = 0              # pad tokens at the end of the row (pad_to="capacity")

    @property
    def num_tokens(self) -> int:
        """The documents' tokens in this row (the padding not counted); 0 on a pipeline stage
        that receives no tokens."""
        return 0 if self.tokens is None else int(self.tokens.shape[0]) - self.padding

    def to_megatron(self) -> dict:
        """The dict Megatron-LM's `get_batch` reads from its data iterator, for one micro-batch
        of micro-batch size 1: tokens, labels, loss_mask, position_ids as [1, n] tensors,
        cu_seqlens int32 [1, segments + 1] and max_seqlen int32 [1] (the packed THD path). No
        attention_mask: documents are separated by cu_seqlens. Tensors share the batch's memory
        (`.cuda()` copies them)."""
        return {"tokens": _row(self.tokens), "labels": _row(self.labels),
                "loss_mask": _row(self.loss_mask), "position_ids": _row(self.position_ids),
                "cu_seqlens": _row(self.cu_seqlens),
                "max_seqlen": torch.tensor([self.max_seqlen], dtype=torch.int32)}

    def to_torchtitan(self) -> tuple[dict, Optional[torch.Tensor]]:
        """torchtitan's (input_dict, labels) for one micro-batch of batch size 1:
        ({"input": tokens [1, n], "positions": position_ids [1, n]}, labels [1, n]); labels use
        -100, the ignore index of torchtitan's cross-entropy."""
        return {"input": _row(self.tokens), "positions": _row(self.position_ids)}, \
            _row(self.labels)


def _row(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[n] -> [1, n], a view; None (a field this rank's stage does not receive) stays None."""
    return None if tensor is None else tensor.unsqueeze(0)


@dataclass
class Batch:
    step: int
    epoch: int
    micro_batches: list[MicroBatch]
    # Tokens planned for, and predicted cost of, each rank this step [R]. Under
    # control_plane="gather" only rank 0 holds every rank's: another rank's Batch holds its own
    # rank's alone ([1]; likewise `row_cost` [1, M] and `encoder_cost` [1]). The step's
    # job-wide figures are in `costs`, the same on every rank.
    rank_tokens: np.ndarray = field(repr=False)
    rank_cost: np.ndarray = field(repr=False)
    max_deferral: int = 0      # steps the longest-waiting sample of this step was deferred
    # The job's tokens of each source this step, over every DP rank (the Loader's source order)
    source_tokens: Optional[np.ndarray] = field(default=None, repr=False)
    # The job's tokens moved to another rank this step (the exchange), over every DP rank
    exchanged_tokens: int = 0
    # The step's mix facts: the configured target shares, whether the epoch's tail had begun,
    # which sources ran out with this step (`mixreport`)
    mix: Optional[StepMix] = field(default=None, repr=False)
    # Predicted cost of each (rank, micro-batch) [R, M], and the pipeline stages P of the
    # 1F1B cost model (`step_time`); None on a broadcast follower
    row_cost: Optional[np.ndarray] = field(default=None, repr=False)
    pipeline_stages: int = 1
    # This rank's skips so far (on_error="skip"), [sources, 2]: records and shards skipped
    skipped: Optional[np.ndarray] = field(default=None, repr=False)
    # The vision encoder's part of each rank's predicted cost [R] (image sources under
    # image_cost="hybrid": the per-item encoder cost the planner balanced; zeros without one);
    # None on a broadcast follower
    encoder_cost: Optional[np.ndarray] = field(default=None, repr=False)
    # The step's job-wide cost figures (`plan.cost.StepCosts`), which the properties below
    # read; counted from the arrays above when not given
    costs: Optional[StepCosts] = field(default=None, repr=False)

    def __post_init__(self):
        if self.costs is None:
            self.costs = StepCosts.of(self.rank_tokens, self.rank_cost, self.row_cost,
                                      self.pipeline_stages, self.encoder_cost)

    @property
    def backbone_cost(self) -> np.ndarray:
        """Each rank's predicted cost less its encoder's part [R]: the backbone (LM) over the
        fused rows, plus any `sample_costs` hook's extra."""
        if self.encoder_cost is None:
            return np.asarray(self.rank_cost, np.float64)
        return np.asarray(self.rank_cost, np.float64) - self.encoder_cost

    @property
    def encoder_imbalance(self) -> float:
        """Max / mean over ranks of `encoder_cost` (1.0: even, or no encoder cost)."""
        return self.costs.encoder_imbalance

    @property
    def backbone_imbalance(self) -> float:
        """Max / mean over ranks of `backbone_cost`."""
        return self.costs.backbone_imbalance

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)

    def rank_cost_of(self, dp_rank: int) -> float:
        """DP rank `dp_rank`'s predicted cost, asked on that rank (or on rank 0, which holds
        every rank's): a rank other than 0 holds its own alone under control_plane="gather"."""
        cost = self.rank_cost
        return float(cost[0] if cost.size == 1 else cost[dp_rank])

    @property
    def imbalance(self) -> float:
        """Predicted max rank cost / mean rank cost (1.0 is perfect)."""
        return self.costs.imbalance

    @property
    def step_time(self) -> float:
        """The step's predicted time: the slowest rank's 1F1B time over its micro-batches,
        (sum + (P - 1) * max) / P (`cost.pipeline_time`); the largest rank cost without rows."""
        return self.costs.step_time

    @property
    def pipeline_efficiency(self) -> float:
        """The step's time with its work spread evenly over every (rank, micro-batch), over its
        predicted time (1.0: no rank and no micro-batch waits on another; 1.0 without rows)."""
        return self.costs.pipeline_efficiency

    def to_megatron(self) -> list[dict]:
        """One dict per micro-batch, in order (`MicroBatch.to_megatron`). Megatron's external
        data iterator yields one micro-batch per `next()` (micro-batch size 1, M micro-batches
        per step on each data-parallel rank), so feed it the micro-batches of consecutive
        steps: `iter(d for batch in loader for d in batch.to_megatron())`."""
        return [mb.to_megatron() for mb in self.micro_batches]

    def to_torchtitan(self) -> list[tuple[dict, Optional[torch.Tensor]]]:
        """One (input_dict, labels) per micro-batch, in order (`MicroBatch.to_torchtitan`)."""
        return [mb.to_torchtitan() for mb in self.micro_batches]
