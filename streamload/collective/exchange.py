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
    # No loop over the peers (most send this rank nothing): what goes out, in plan order within
    # each destination, and what comes in, in plan order within each holder, as flat arrays.
    outgoing = np.flatnonzero(holder == me)
    outgoing = outgoing[np.argsort(dest[outgoing], kind="stable")]
    incoming = entries_here[np.argsort(holder[entries_here], kind="stable")]
    lengths = np.asarray(lengths, dtype=np.int64)
    # Items hold uint8 (byte tokens) or int32 ids; every rank sends int32, so they agree.
    flat = np.concatenate([mine[e] for e in outgoing.tolist()], dtype=np.int32) \
        if outgoing.size else np.zeros(0, np.int32)
    received = comm.all_to_all_flat(
        flat, np.bincount(dest[outgoing], weights=lengths[outgoing], minlength=world),
        np.bincount(holder[incoming], weights=lengths[incoming], minlength=world))
    tokens = dict(zip(incoming.tolist(), np.split(received, np.cumsum(lengths[incoming])[:-1])))
    return entries_here, [tokens[e] for e in entries_here.tolist()]
