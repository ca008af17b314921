"""control_plane="gather": how a rank other than 0 gets the job's state for `state_dict()`.

Only rank 0 keeps the job model, so only rank 0 can say what the state was after a step. The
others get it from rank 0, on the rounds of `Agreement.gather_step` (each round carries side
words, `protocol.Sideband`, whatever its status: a summary, a heartbeat, a closing word):

* **On request.** A rank's `state_dict()` for step k (the last batch its trainer took) asks in
  its next round, and the round starts at once (`wake`) rather than waiting for the rank's next
  summary. Rank 0 answers in that round's reply with the state after step k: it keeps the
  snapshots of the steps that may still be asked for (every rank's trainer is at most the
  batches in flight behind the loop).
* **Sent with rank 0's own.** Trainers call `state_dict()` on every rank at the same step (a
  torch.distributed.checkpoint save does), so when rank 0's trainer asks for step k, rank 0
  sends step k's state to every rank in its next reply, and wakes its loop for that round: a
  rank whose request reached rank 0 later, or whose loop was busy, finds it there. Neither
  side waits for a heartbeat (`collective_timeout_s / 3`) unless rank 0's trainer never asks
  and its loop has nothing to send (its queue full, its trainer waiting on that rank).
* **At a checkpoint interval** (`state_every`): with every step that is a multiple of it, the
  state goes to every rank unasked.
* **When the run ends** (the last epoch, a source that stops the job, or every rank closing),
  rank 0's last reply carries the states of the steps still kept, so `state_dict()` answers
  after the loop has ended, as it does on rank 0.

Side words: a rank's are [] or [k] (the step it asks for); rank 0's are a count, then (step,
byte length; -1: not kept) per state, then the states' bytes as int64 words.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from collections import OrderedDict
from typing import Callable, Optional, Union

import numpy as np

from .errors import UsageError
from .job import StepSnapshot

NOT_KEPT = -1


def encode_states(states: list[tuple[int, Optional[bytes]]]) -> np.ndarray:
    head = [len(states)]
    for step, payload in states:
        head += [step, NOT_KEPT if payload is None else len(payload)]
    body = b"".join(p + b"\0" * (-len(p) % 8) for _, p in states if p is not None)
    return np.concatenate([np.array(head, np.int64),
                           np.frombuffer(body, dtype="<i8").astype(np.int64)])


def decode_states(words: np.ndarray) -> list[tuple[int, Optional[bytes]]]:
    if not words.shape[0]:
        return []
    count = int(words[0])
    pairs = words[1:1 + 2 * count].reshape(count, 2).tolist()
    body = np.ascontiguousarray(words[1 + 2 * count:]).astype("<i8").tobytes()
    out, at = [], 0
    for step, size in pairs:
        if size == NOT_KEPT:
            out.append((step, None))
            continue
        out.append((step, body[at:at + size]))
        at += size + (-size % 8)
    return out


class StateRelay:
    """One per rank under control_plane="gather" (world > 1), owned by the loop. Rank 0:
    `kept(snapshot)` after each step, `encode(snapshot)` answers its own trainer and sends
    that state to all; the others: `get(step)` gives the state's bytes, or a future the
    trainer waits on. `keep`: how many steps' snapshots rank 0 keeps (the batches in flight)."""

    def __init__(self, rank: int, world: int, keep: int,
                 encode: Optional[Callable[[StepSnapshot], bytes]] = None,
                 state_every: Optional[int] = None):
        self.rank, self.world, self.keep = rank, world, keep
        self._encode, self.state_every = encode, state_every
        self.wake = asyncio.Event()
        # rank 0
        self._snapshots: "OrderedDict[int, StepSnapshot]" = OrderedDict()   # batch step ->
        self._encoded: "OrderedDict[int, bytes]" = OrderedDict()
        self._push: set[int] = set()      # steps to send every rank with the next reply
        self._final = False               # the next reply is the run's last
        # the other ranks
        self._received: "OrderedDict[int, bytes]" = OrderedDict()
        self._asked: dict[int, list[concurrent.futures.Future]] = {}
        self._ended: Optional[BaseException] = None
        self.requests = 0                  # requests this rank sent (stats)
        self.states_received = 0

    # -- rank 0 -------------------------------------------------------------------------------
    def kept(self, step: int, snapshot: StepSnapshot) -> None:
        """Rank 0, after batch `step` was planned."""
        self._snapshots[step] = snapshot
        while len(self._snapshots) > self.keep:
            self._snapshots.popitem(last=False)
        if self.state_every and (step + 1) % self.state_every == 0:
            self._push.add(step)

    def encoded(self, step: int) -> Optional[bytes]:
        """Rank 0: the state after batch `step`, encoded once (None: no longer kept)."""
        if step not in self._encoded:
            snapshot = self._snapshots.get(step)
            if snapshot is None:
                return None
            self._encoded[step] = self._encode(snapshot)
            while len(self._encoded) > self.keep:
                self._encoded.popitem(last=False)
        return self._encoded[step]

    def own(self, step: int) -> bytes:
        """Rank 0's trainer asked for the state after batch `step`: every other rank will ask
        for it too, so it goes to all with the next reply, which starts at once."""
        payload = self.encoded(step)
        if self.world > 1 and self.state_every != 1:   # every 1: every step's went to all
            self._push.add(step)
            self.wake.set()
        return payload

    def finish(self) -> None:
        """Rank 0: the next reply ends the run; it carries every state still kept."""
        self._final = True

    def answer(self, words: list[Optional[np.ndarray]], final: bool) -> list[np.ndarray]:
        """Rank 0: each rank's side words for this round's reply."""
        common = set(self._push)
        if final or self._final:
            common |= set(self._snapshots)
        self._push.clear()
        self.wake.clear()
        out = []
        for r, asked in enumerate(words):
            steps = set(common)
            if r != 0 and asked is not None and asked.shape[0]:
                steps.add(int(asked[0]))
            out.append(encode_states([(k, self.encoded(k)) for k in sorted(steps)])
                       if steps and r != 0 else np.zeros(0, np.int64))
        return out

    # -- the other ranks ----------------------------------------------------------------------
    def get(self, step: int) -> Union[bytes, "concurrent.futures.Future[bytes]"]:
        """On the loop: the state after batch `step`, or a future of it, which the next round
        asks rank 0 for (now: `wake`)."""
        if step in self._received:
            return self._received[step]
        future: "concurrent.futures.Future[bytes]" = concurrent.futures.Future()
        if self._ended is not None:
            future.set_exception(self._ended)
            return future
        self._asked.setdefault(step, []).append(future)
        self.wake.set()
        return future

    def outgoing(self) -> np.ndarray:
        if self.rank == 0 or not self._asked:
            return np.zeros(0, np.int64)
        self.requests += 1
        return np.array([min(self._asked)], np.int64)

    def receive(self, words: np.ndarray) -> None:
        for step, payload in decode_states(words):
            if payload is not None:
                self.states_received += 1
                self._received[step] = payload
                while len(self._received) > 2 * self.keep:
                    self._received.popitem(last=False)
            for future in self._asked.pop(step, []):
                if payload is None:
                    future.set_exception(UsageError(
                        f"state_dict(): rank 0 no longer keeps the state after step {step}"))
                else:
                    future.set_result(payload)
        if self.rank != 0:
            if self._asked:
                self.wake.set()
            else:
                self.wake.clear()

    def end(self, error: Optional[BaseException]) -> None:
        """The loop ended: a request not answered by now never will be."""
        self._ended = error if error is not None else UsageError(
            "state_dict(): the loader's loop ended before rank 0 sent this rank the state of "
            "the last batch it returned; call state_dict() on every rank at the same step, "
            "before close()")
        for futures in self._asked.values():
            for future in futures:
                if not future.done():
                    future.set_exception(self._ended)
        self._asked.clear()
        self.wake.clear()
