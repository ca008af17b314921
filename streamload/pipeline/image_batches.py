"""A multimodal step's images, on the rank that trains on them: exchanged, decoded, attached.

The delivery (`delivery.py`) packs the step's rows as for text; for a job with an image source
it also moves each planned item's encoded images with it (`vision.exchange`, one more pair of
all-to-alls on the collective thread), then `ImageBatches.attach` decodes every image of the
rank's rows in worker processes (`image_workers`; `decode_images_in="threads"` decodes on
daemon threads instead: Pillow releases the GIL while it decodes and resizes, but the Python
between calls takes it), split evenly by pixels, and turns each row into a
`VisionMicroBatch` (`vision.batch`).

Every image source of a loader shares one encoder geometry (patch, merge, frames, image ids):
one `pixel_values` tensor holds a row's images whatever source they came from.

An image whose header was read at fetch time (`pipeline/images.py`) but that does not decode
is a DataError naming the source, the shard, the record and the member, whatever on_error
says: the sample was planned, and a row does not lose a sample silently.
"""
from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import ConfigError, DataError
from ..vision.batch import vision_row
from ..vision.decode import decode_many
from ..vision.options import Images
from .workers import DaemonExecutor

_GEOMETRY = ("image_token_id", "image_begin_ids", "image_end_ids", "patch_size", "merge_size",
             "temporal_patch_size")


def shared_geometry(names: Sequence[str], options: Sequence[Optional[Images]]) -> Images:
    """The one encoder geometry of the image sources; a ConfigError naming two that differ."""
    found = [(n, o) for n, o in zip(names, options) if o is not None]
    first_name, first = found[0]
    for name, other in found[1:]:
        for key in _GEOMETRY:
            if getattr(other, key) != getattr(first, key):
                raise ConfigError.at(
                    "images", f"sources {first_name!r} and {name!r} differ in images.{key} "
                    f"({getattr(first, key)!r} vs {getattr(other, key)!r}); a row's images go "
                    f"to one encoder, so every image source must share its geometry")
    return first


class ImageBatches:
    def __init__(self, options: Images, workers: int, where: str = "processes"):
        self.options, self.workers, self.where = options, workers, where
        self._pool: Optional[Executor] = None

    def _executor(self) -> Executor:
        if self._pool is None:   # made at the first step with images
            if self.where == "threads":
                self._pool = DaemonExecutor(self.workers, "streamload-images")
            else:
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def attach(self, micro_batches: list, rows: list, entries: np.ndarray,
                     here: dict[int, tuple], name_of: Callable[[int], tuple]) -> list:
        """Each of `micro_batches` (one per packed row of `rows`, whose `item_indices` index
        `entries`) with its images (`here`: plan entry -> ImageRefs, from the exchange).
        `name_of(k)` -> (source name, shard name, record) of the k-th received item."""
        o = self.options
        jobs, owners = [], []   # per image: (row, item k)
        for r, row in enumerate(rows):
            for k in row.item_indices.tolist():
                for ref in here.get(int(entries[k]), ()):
                    jobs.append((ref.data, tuple(ref.placement), o.patch_size, o.merge_size))
                    owners.append((r, k, ref))
        patches = await self._decode(jobs) if jobs else []
        per_row: list[list] = [[] for _ in rows]
        for (r, k, ref), result in zip(owners, patches):
            if isinstance(result, str):
                source, shard, record = name_of(k)
                raise DataError(f"image member {ref.member!r} does not decode: {result}",
                                source=source, shard=shard, record=record, skippable=False)
            per_row[r].append((k, ref, result))
        out = []
        for mb, row, images in zip(micro_batches, rows, per_row):
            position = {k: j for j, k in enumerate(row.item_indices.tolist())}
            out.append(vision_row(mb, [p for _, _, p in images],
                                  [ref.placement.grid for _, ref, _ in images],
                                  [position[k] for k, _, _ in images], o))
        return out

    async def _decode(self, jobs: list) -> list:
        """The patches of every job, decoded by the workers in about equal shares of pixels."""
        pixels = np.array([j[1][0] * j[1][1] for j in jobs], dtype=np.float64)
        parts = min(self.workers, len(jobs))
        order = np.argsort(-pixels, kind="stable")
        load = np.zeros(parts)
        share: list[list[int]] = [[] for _ in range(parts)]
        for j in order.tolist():   # largest first, to the least loaded
            w = int(np.argmin(load))
            share[w].append(j)
            load[w] += pixels[j]
        pool = self._executor()
        results = await asyncio.gather(*(asyncio.wrap_future(
            pool.submit(decode_many, [jobs[j] for j in part])) for part in share))
        out: list = [None] * len(jobs)
        for part, result in zip(share, results):
            for j, patches in zip(part, result):
                out[j] = patches
        return out
