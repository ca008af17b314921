"""Move planned samples to the rank the plan names (all-to-all on the loader's gloo group)."""
from __future__ import annotations

import numpy as np

from .comm import Comm


def exchange_tokens(comm: Comm, holder: np.ndarray, dest: np.ndarray, lengths: np.ndarray,
                    mine: dict[int, np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Send each planned item's tokens from the rank holding it to its destination.

    `holder`, `dest` and `lengths` have one entry per planned item (plan order); `mine` maps the
    plan entries held here to their tokens. Every rank knows every length and id from the
    summaries, so only tokens travel. Returns the plan entries destined here, in plan order,
    and their tokens. Blocking: run it on the collective thread.
    """
    me, world = comm.rank, comm.world
    entries_here = np.flatnonzero(dest == me)
    if world == 1:
        return entries_here, [mine[int(e)] for e in entries_here]
    # Items hold uint8 (byte tokens) or int32 ids; every rank sends int32, so they agree.
    sends = []
    for r in range(world):
        outgoing = np.flatnonzero((holder == me) & (dest == r))
        sends.append(np.concatenate([mine[int(e)] for e in outgoing], dtype=np.int32)
                     if outgoing.size else np.zeros(0, np.int32))
    incoming = [np.flatnonzero((holder == r) & (dest == me)) for r in range(world)]
    received = comm.all_to_all(sends, np.int32, [int(lengths[i].sum()) for i in incoming])
    tokens: dict[int, np.ndarray] = {}
    for r in range(world):
        if incoming[r].size:
            pieces = np.split(received[r], np.cumsum(lengths[incoming[r]])[:-1])
            tokens.update(zip(incoming[r].tolist(), pieces))
    return entries_here, [tokens[int(e)] for e in entries_here]
