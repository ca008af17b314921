"""Move a step's images with their samples: each planned item's encoded images go from the
rank that read it to the rank the plan sends it to, beside the token exchange
(`collective/exchange.py`), on the same collective thread.

Two all-to-alls on the loader's group (`Comm.all_to_all`): the size of each rank's message
(one int64 per pair of ranks), then the messages, one uint8 array per destination. A message
is a header of int64s, per outgoing item (in plan order) its images' count, and per image its
member name's and its data's byte counts and its placement (height, width, grid t, h, w,
visual tokens), then the names' and the data's bytes. Items are matched by their order, as
the token exchange matches them: what rank r sends here, in plan order, are the plan entries
held by r and destined here, in plan order; plan entry numbers are not sent (under
control_plane="gather" each rank numbers its own part of the plan). Images stay encoded
(JPEG is ~10x smaller than its pixels); the receiving rank decodes them. Items without images
send nothing but their entry.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .rule import Placement

if TYPE_CHECKING:
    from ..collective.comm import Comm

_PER_IMAGE = 8   # int64s: member bytes, data bytes, height, width, t, h, w, tokens


class ImageRef(NamedTuple):
    member: str          # the tar member or Parquet cell it came from, for errors
    data: bytes          # encoded (JPEG, PNG, WebP)
    placement: Placement


def encode_images(items: list[tuple]) -> np.ndarray:
    """One message (uint8) of the ImageRefs of items, in order."""
    header, blobs = [], []
    for refs in items:
        header.append(len(refs))
        for ref in refs:
            name = ref.member.encode("utf-8", "surrogateescape")
            p = ref.placement
            header += [len(name), len(ref.data), p.height, p.width, *p.grid, p.tokens]
            blobs += [name, ref.data]
    head = np.asarray([len(header)] + header, dtype=np.int64)
    return np.frombuffer(head.tobytes() + b"".join(blobs), dtype=np.uint8)


def decode_images(message: np.ndarray) -> list[tuple]:
    """The items' ImageRefs of one message (`encode_images`), in order."""
    if message.size == 0:
        return []
    raw = message.tobytes()
    count = int(np.frombuffer(raw[:8], dtype=np.int64)[0])
    header = np.frombuffer(raw[8:8 + 8 * count], dtype=np.int64).tolist()
    at, pos, out = 0, 8 + 8 * count, []
    while at < len(header):
        n = header[at]
        at += 1
        refs = []
        for _ in range(n):
            name_len, data_len, h, w, gt, gh, gw, tokens = header[at:at + _PER_IMAGE]
            at += _PER_IMAGE
            name = raw[pos:pos + name_len].decode("utf-8", "surrogateescape")
            pos += name_len
            refs.append(ImageRef(name, raw[pos:pos + data_len],
                                 Placement(h, w, (gt, gh, gw), tokens)))
            pos += data_len
        out.append(tuple(refs))
    return out


def exchange_images(comm: "Comm", holder: np.ndarray, dest: np.ndarray,
                    mine: dict[int, tuple]) -> dict[int, tuple]:
    """`mine`: the plan entries held here (every one of them, () for an item without images)
    -> their ImageRefs. Returns the same for the entries destined here. Blocking: run it on
    the collective thread, after the token exchange, on every rank."""
    me, world = comm.rank, comm.world
    if world == 1:
        return {int(e): mine[int(e)] for e in np.flatnonzero(dest == me)}
    sends = []
    for r in range(world):
        outgoing = np.flatnonzero((holder == me) & (dest == r)).tolist()
        sends.append(encode_images([mine[e] for e in outgoing]) if outgoing
                     else np.zeros(0, np.uint8))
    sizes = comm.all_to_all([np.array([s.size], np.int64) for s in sends], np.int64,
                            [1] * world)
    received = comm.all_to_all(sends, np.uint8, [int(s[0]) for s in sizes])
    out: dict[int, tuple] = {}
    for r, message in enumerate(received):
        incoming = np.flatnonzero((holder == r) & (dest == me)).tolist()
        items = decode_images(message)
        if len(items) != len(incoming):
            raise RuntimeError(f"rank {r} sent the images of {len(items)} items, the plan "
                               f"says {len(incoming)}")
        out.update(zip(incoming, items))
    return out
