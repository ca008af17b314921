"""Move planned samples to the rank the plan names (all-to-all on the loader's gloo group)."""
from __future__ import annotations

import numpy as np

from ..pipeline.buffer import Item
from .comm import Comm


def exchange_items(comm: Comm, holder: np.ndarray, dest: np.ndarray,
                   lengths: np.ndarray, mine: dict[int, Item]) -> tuple[list[int], list[Item]]:
    """Send each planned item from its holder to its destination.

    `holder`, `dest` and `lengths` have one entry per planned item (plan order); `mine` maps
    plan entries held here to their items. Returns the plan entries destined here, in plan
    order, and their items. Blocking: run it on the collective thread.
    """
    me, world = comm.rank, comm.world
    entries_here = np.flatnonzero(dest == me)
    if world == 1:
        return entries_here.tolist(), [mine[int(e)] for e in entries_here]
    token_sends, id_sends = [], []
    for r in range(world):
        outgoing = np.flatnonzero((holder == me) & (dest == r))
        items = [mine[int(e)] for e in outgoing]
        token_sends.append(np.concatenate([i.tokens for i in items]) if items
                           else np.zeros(0, np.int32))
        id_sends.append(np.array([(i.shard, i.record, i.chunk, i.age) for i in items],
                                 dtype=np.int64).reshape(-1))
    token_recv = comm.all_to_all(token_sends, np.int32)
    id_recv = comm.all_to_all(id_sends, np.int64)
    received: dict[int, Item] = {}
    for r in range(world):
        incoming = np.flatnonzero((holder == r) & (dest == me))
        tokens = np.split(token_recv[r], np.cumsum(lengths[incoming])[:-1]) if incoming.size else []
        ids = id_recv[r].reshape(-1, 4)
        for e, t, (shard, record, chunk, age) in zip(incoming, tokens, ids):
            item = Item(int(shard), int(record), int(chunk), t)
            item.age = int(age)
            received[int(e)] = item
    return entries_here.tolist(), [received[int(e)] for e in entries_here]
