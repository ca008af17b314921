"""A multimodal step's images, on the rank that trains on them: exchanged, decoded, attached.

The delivery (`delivery.py`) packs the step's rows as for text; for a job with an image source
it also moves each planned item's encoded images with it (`vision.exchange`, one more pair of
all-to-alls on the collective thread), then `ImageBatches.attach` decodes every image of the
rank's rows in worker processes (`image_workers`; `decode_images_in="threads"` decodes on
daemon threads instead: Pillow releases the GIL while it decodes and resizes, but the Python
between calls takes it), one image per job, largest first, each written into its row's place
(worker processes: through a shared-memory file of the step, `vision.decode.SharedPixels`),
and turns each row into a `VisionMicroBatch` (`vision.batch`).

Every image source of a loader shares one encoder geometry (patch, merge, frames, image ids):
one `pixel_values` tensor holds a row's images whatever source they came from.

An image whose header was read at fetch time (`pipeline/images.py`) but that does not decode
is reported as data (`attach` returns it: the received item and why); the delivery applies
on_error to it (a DataError naming the source, the shard, the record and the member, or under
"skip" the sample left out of its row, counted under the skip limit).
"""
from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import Optional, Sequence

import numpy as np

from ..errors import ConfigError
from ..vision.batch import vision_row
from ..vision.decode import SharedPixels, decode_one
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
    def __init__(self, options: Images, workers: int, where: str = "processes",
                 shared_memory: bool = True):
        """`shared_memory`: worker processes write patches into a /dev/shm file of the step
        (`SharedPixels`) when one can be had; False: they send them back pickled."""
        self.options, self.workers, self.where = options, workers, where
        self.shared_memory = shared_memory
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
                     here: dict[int, tuple]) -> tuple[list, dict[int, str]]:
        """Each of `micro_batches` (one per packed row of `rows`, whose `item_indices` index
        `entries`) with its images (`here`: plan entry -> ImageRefs, from the exchange), and
        the images that did not decode: {k: why} for the k-th received item (empty: none).

        The step's `pixel_values` are allocated once, at their size (known from the
        placements), and each image is a job of its own that writes its patches in place:
        worker threads into the array, worker processes into the step's shared-memory file
        (or, without one, sent back and copied into place as they arrive). Neither a worker nor
        this process holds more than the images in hand besides the rows."""
        o = self.options
        values = o.patch_values
        layout = []   # per row: its images (k, ref), their grids and sizes
        for row in rows:
            refs = [(k, ref) for k in row.item_indices.tolist()
                    for ref in here.get(int(entries[k]), ())]
            grids = [ref.placement.grid for _, ref in refs]
            layout.append((refs, grids, [g[0] * g[1] * g[2] for g in grids]))
        total = sum(sum(sizes) for _, _, sizes in layout)
        shared = None
        if self.where == "processes" and self.shared_memory:
            shared = SharedPixels.create(total * values)
        memory = shared.array if shared is not None else np.empty(total * values, np.uint8)
        out, jobs, at = [], [], 0
        for mb, row, (refs, grids, sizes) in zip(micro_batches, rows, layout):
            position = {k: j for j, k in enumerate(row.item_indices.tolist())}
            pixels = memory[at * values:(at + sum(sizes)) * values].reshape(-1, values)
            start = 0
            for (k, ref), size in zip(refs, sizes):
                where = pixels[start:start + size]
                if shared is not None:
                    where = (shared.path, (at + start) * values)
                elif self.where == "processes":
                    where = (None, pixels[start:start + size])   # copied here on arrival
                jobs.append((where, size, ref, k))
                start += size
            at += sum(sizes)
            out.append(vision_row(mb, pixels, grids, [position[k] for k, _ in refs], o))
        try:
            failed = await self._decode(jobs) if jobs else {}
        finally:
            if shared is not None:
                shared.unlink()
        return out, failed

    async def _decode(self, jobs: list) -> dict[int, str]:
        """Decode every job's image in the workers, largest first (the step ends with small
        ones). Returns the failures, {k: why} (an item's first image that failed)."""
        o, pool = self.options, self._executor()
        pending = {}
        for j in sorted(range(len(jobs)), key=lambda j: -jobs[j][1]):
            where, _, ref, _ = jobs[j]
            into = None if isinstance(where, tuple) and where[0] is None else where
            pending[asyncio.wrap_future(pool.submit(
                decode_one, ref.data, tuple(ref.placement), o.patch_size, o.merge_size,
                into))] = j
        failed: dict[int, str] = {}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    where, _, ref, k = jobs[pending.pop(future)]
                    result = future.result()
                    if isinstance(result, str):
                        failed.setdefault(k, f"image member {ref.member!r} does not decode: "
                                             f"{result}")
                    elif result is not None:   # sent back: into its place
                        where[1][...] = result
        finally:
            for future in pending:   # cancelled (the loader closes): the rest is not needed
                future.cancel()
        return failed
