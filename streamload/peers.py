"""`delivery="broadcast"`: one rank of each DP rank's group builds the step, the others receive it.

The leaders (the ranks of the first (PP, CP, TP) coordinate, one per DP rank) run the loader
(`Runtime`) over their DP group. After each step a leader broadcasts its DP rank's whole step
(rows before `stage_view`, with the resumable state as of that step) over its peer group: every
rank of its DP rank. Each rank, the leader included, then takes its own view (its CP part, its
pipeline stage's fields). A `Follower` runs where a Runtime would on the other ranks: it
receives, shapes and hands over, and its `state_dict()` is the leader's.

The message is msgpack (msgspec): per micro-batch, each tensor as (dtype, bytes), the sample
ids and the row's numbers; the step's per-rank tokens and costs; the state's JSON. Its status
says whether a step follows, the run ended, or the leader failed (and why).
"""
from __future__ import annotations

import time
from typing import Optional

import msgspec
import numpy as np
import torch

from .batch import Batch, MicroBatch
from .collective.comm import GlooComm, collective_thread
from .collective.topology import Topology
from .errors import DistributedError
from .mixreport import StepMix
from .plan.cost import StepCosts
from .stage_view import needs_view, stage_view
from .state import LoaderState, decode_state
from .vision.batch import VisionMicroBatch

TENSORS = ("tokens", "cu_seqlens", "position_ids", "labels", "loss_mask")
# A multimodal row's (`vision.batch.VisionMicroBatch`): its images travel to the peers too (TP
# peers need the same pixels; a pipeline's later stages drop them in `stage_view`).
VISION_TENSORS = ("image_mask", "pixel_values", "image_grid", "vision_cu_seqlens",
                  "image_document")
VISION_GEOMETRY = ("patch_size", "merge_size", "temporal_patch_size")


class StepMessage(msgspec.Struct, frozen=True):
    status: str                     # "step" | "end" | "failed"
    error: str = ""
    step: int = 0
    epoch: int = 0
    rank_tokens: list = []
    rank_cost: list = []
    costs: list = []                # the step's job-wide cost figures (`StepCosts`)
    max_deferral: int = 0
    source_tokens: list = []
    exchanged_tokens: int = 0
    target: list = []               # the step's mix facts (`mixreport.StepMix`); [] when none
    tail: bool = False
    ran_out: list = []
    state: bytes = b""              # LoaderState JSON, as of this step
    micro_batches: list = []        # dicts: tensors as [dtype, bytes], ids, numbers


def encode_step(batch: Batch, state: bytes) -> bytes:
    rows = []
    for mb in batch.micro_batches:
        vision = isinstance(mb, VisionMicroBatch)
        row = {name: [str(t.numpy().dtype), t.numpy().tobytes()]
               for name in TENSORS + (VISION_TENSORS if vision else ())
               if (t := getattr(mb, name, None)) is not None}
        row.update(sample_ids=mb.sample_ids, max_seqlen=mb.max_seqlen,
                   padding=getattr(mb, "padding", 0))
        if vision:
            row.update(vision=True, **{name: getattr(mb, name) for name in VISION_GEOMETRY})
        rows.append(row)
    return msgspec.msgpack.encode(StepMessage(
        "step", step=batch.step, epoch=batch.epoch, rank_tokens=batch.rank_tokens.tolist(),
        rank_cost=batch.rank_cost.tolist(), costs=batch.costs.to_array().tolist(),
        max_deferral=batch.max_deferral,
        source_tokens=[] if batch.source_tokens is None else batch.source_tokens.tolist(),
        exchanged_tokens=batch.exchanged_tokens,
        **({} if batch.mix is None else {"target": batch.mix.target.tolist(),
                                         "tail": batch.mix.tail,
                                         "ran_out": batch.mix.ran_out.tolist()}),
        state=state, micro_batches=rows))


def encode_end(error: Optional[BaseException] = None) -> bytes:
    if error is None:
        return msgspec.msgpack.encode(StepMessage("end"))
    return msgspec.msgpack.encode(StepMessage("failed", error=f"{type(error).__name__}: {error}"))


def decode_step(message: StepMessage) -> Batch:
    micro_batches = []
    for row in message.micro_batches:
        vision = row.get("vision", False)
        fields = {name: torch.from_numpy(np.frombuffer(row[name][1], dtype=row[name][0]).copy())
                  for name in TENSORS + (VISION_TENSORS if vision else ()) if name in row}
        extra = {"padding": row["padding"]} if "padding" in MicroBatch.__dataclass_fields__ else {}
        if vision:
            for name, width in (("pixel_values", 3 * row["patch_size"] ** 2), ("image_grid", 3)):
                fields[name] = fields[name].reshape(fields[name].numel() // width, width)
            extra.update({name: row[name] for name in VISION_GEOMETRY})
        kind = VisionMicroBatch if vision else MicroBatch
        micro_batches.append(kind(**fields, sample_ids=list(row["sample_ids"]),
                                  max_seqlen=row["max_seqlen"], **extra))
    return Batch(message.step, message.epoch, micro_batches,
                 np.asarray(message.rank_tokens, dtype=np.float64),
                 np.asarray(message.rank_cost, dtype=np.float64),
                 costs=StepCosts.from_array(message.costs) if message.costs else None,
                 max_deferral=message.max_deferral,
                 source_tokens=np.asarray(message.source_tokens, dtype=np.int64),
                 exchanged_tokens=message.exchanged_tokens,
                 mix=StepMix(np.asarray(message.target, dtype=np.float64), message.tail,
                             np.asarray(message.ran_out, dtype=bool)) if message.target else None)


class Follower:
    """Stands where a Runtime would on a rank that builds no batch (broadcast delivery)."""

    def __init__(self, peers: GlooComm, topology: Topology, pad_token_id: int = 0):
        self.peers, self.topology, self.pad_token_id = peers, topology, pad_token_id
        self.resume: Optional[LoaderState] = None
        self.steps = 0
        self.bytes_received = 0
        self.receive_s = 0.0

    def load_state(self, state: LoaderState) -> None:
        self.resume = state   # the leader resumes the job; this is what `state` says until then

    def request_close(self) -> None:
        """Nothing to tell anyone: the leader's closing sends "end", which ends this run (the
        ranks of a DP rank stop at the same step)."""

    def state(self, snapshot: Optional[bytes]) -> Optional[LoaderState]:
        """The state as of the last batch returned: its leader's JSON, decoded only when asked
        (the snapshot is the message's bytes), or the state this rank resumed from."""
        return decode_state(snapshot) if snapshot is not None else self.resume

    def stats(self) -> dict:
        return {"rank": self.topology.dp_rank, "world_size": self.topology.dp, "role": "follower",
                "steps": self.steps, "bytes_received": self.bytes_received,
                "receive_s": self.receive_s}

    async def run(self, handoff) -> None:
        thread = collective_thread()
        try:
            while True:
                # No slot is reserved first: a follower always takes what its leader sends, so
                # the leader's broadcast never waits on a full queue here (the queue stays
                # short: the leader runs at most prefetch_steps ahead of its own trainer, and
                # the ranks of a DP rank train in step), and a run that ends early ends here
                # when the leader's "end" comes.
                started = time.perf_counter()
                payload = await thread.run(lambda: self.peers.broadcast_bytes(None, self.peers.leader))
                self.receive_s += time.perf_counter() - started
                self.bytes_received += len(payload)
                message = msgspec.msgpack.decode(payload, type=StepMessage)
                if message.status == "end":
                    return
                if message.status == "failed":
                    raise DistributedError(f"the rank that builds DP rank {self.topology.dp_rank}'s "
                                           f"batches failed: {message.error}")
                batch = decode_step(message)
                if needs_view(self.topology):
                    batch = stage_view(batch, self.topology, self.pad_token_id)
                self.steps += 1
                handoff.put(batch, message.state)   # decoded by `state`, if ever
        finally:
            thread.shutdown()
