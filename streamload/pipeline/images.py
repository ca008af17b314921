"""Image-text records -> buffer items, on a transform thread: headers read, pixels not.

For each `ImageText` record (`formats/images.py`) of a source with `images`:

1. every image's header is read (`vision.probe`: format and size, and a check that the bytes
   are whole) and the rule places it (`Images.place`: resized size, grid, visual tokens);
2. the text between images is tokenized (the loader's tokenizer, one call per range, each
   piece on its own: give image sources a tokenizer that adds no BOS/EOS per call; UTF-8
   bytes without one);
3. the fused sequence is built: text, then for each image `image_begin_ids`, its visual
   tokens' worth of `image_token_id`, `image_end_ids`, then the next text.

The item's tokens are that sequence, so its length, what planning balances and packs, is text
plus visual tokens, known before any pixel is decoded; it carries its images' encoded bytes
and placements (a buffer `ItemBlock`'s `images`) to the rank the plan sends it to, which decodes
them (`vision.decode`, in worker processes) when it builds its batch.

An image sample is never split: one longer than a row (`micro_batch_tokens`) is a record error
naming it and its visual tokens (with long_documents="drop": dropped and counted). A problem
with one image (bytes that are no image, a truncated JPEG, a source image over
`max_source_pixels`) is a record error naming the sample's key and the member: a DataError,
or with on_error="skip" a counted skip under the source's skip limit (`SkipLedger`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..formats.base import Problems, RawRecord
from ..formats.images import ImageText
from ..tokenizer import TextTokenizer, TokenizerError
from ..vision.options import Images
from ..vision.probe import ImageProblem, probe
from ..vision.exchange import ImageRef
from ..vision.rule import ImageRefused
from .buffer import ItemBlock
from .transform import TokenIdError, TransformCounts, token_ids, utf8_bytes


def image_bytes(block: ItemBlock) -> int:
    """The encoded bytes a block's images hold (0 for a text block)."""
    if block.images is None:
        return 0
    return sum(len(ref.data) for refs in block.images for ref in refs)


class ImageItems:
    """The transform of one image source (see the module); called on a transform thread."""

    def __init__(self, images: Images, tokenizer: Optional[TextTokenizer], capacity: int,
                 long_documents: str):
        self.images, self.tokenizer = images, tokenizer
        self.capacity, self.long_documents = capacity, long_documents
        self._begin = np.asarray(images.image_begin_ids, dtype=np.int32)
        self._end = np.asarray(images.image_end_ids, dtype=np.int32)

    def __call__(self, records: list[RawRecord], shard: int, keep=None,
                 ages: Optional[dict] = None, problems: Optional[Problems] = None
                 ) -> tuple[ItemBlock, TransformCounts]:
        problems = problems or Problems(None, None)
        counts = TransformCounts(records=len(records))
        placed = []
        for record in records:
            sample = record.payload
            refs, problem = self._place(sample)
            if problem is not None:
                problems.record(record.index, f"sample {sample.key!r}: {problem}")
                counts.records -= 1
                continue
            placed.append((record, refs))
        texts = self._tokenize([r.payload for r, _ in placed], problems, [r for r, _ in placed])
        arrays, records_kept, images, ages_kept = [], [], [], []
        for (record, refs), pieces in zip(placed, texts):
            if pieces is None:   # the tokenizer failed on it (reported)
                counts.records -= 1
                continue
            tokens, problem = self._fuse(pieces, refs)
            if problem is None and tokens.shape[0] > self.capacity:
                visual = sum(ref.placement.tokens for ref in refs)
                problem = (f"{tokens.shape[0]} tokens ({visual} visual, in {len(refs)} "
                           f"image(s)) do not fit a row of micro_batch_tokens={self.capacity}; "
                           f"an image sample is never split: raise micro_batch_tokens or lower "
                           f"images.max_pixels")
                if self.long_documents == "drop":
                    counts.dropped += 1
                    continue
            if problem is not None:
                problems.record(record.index, f"sample {record.payload.key!r}: {problem}")
                counts.records -= 1
                continue
            if tokens.shape[0] == 0:
                counts.empty += 1
                continue
            if keep is not None and keep(record.index, -1) is None:
                continue
            arrays.append(tokens)
            records_kept.append(record.index)
            images.append(tuple(refs))
            ages_kept.append(ages.get((shard, record.index, -1), 0) if ages else 0)
        block = ItemBlock.of_arrays(shard, arrays, records_kept, images=images)
        block.age = np.asarray(ages_kept, np.int64)
        counts.samples, counts.tokens = len(block), block.total
        return block, counts

    def _place(self, sample: ImageText) -> tuple[list[ImageRef], Optional[str]]:
        if not isinstance(sample, ImageText):
            return [], f"expected an image-text record, got {type(sample).__name__}"
        if len(sample.images) > self.images.max_images:
            return [], (f"{len(sample.images)} images, more than images.max_images="
                        f"{self.images.max_images}")
        refs = []
        for blob in sample.images:
            try:
                header = probe(blob.data)
                placement = self.images.place(header.height, header.width)
            except (ImageProblem, ImageRefused) as exc:
                return [], f"image member {blob.member!r}: {exc}"
            refs.append(ImageRef(blob.member, blob.data, placement))
        return refs, None

    def _tokenize(self, samples: list[ImageText], problems: Problems,
                  records: list[RawRecord]) -> list[Optional[list[np.ndarray]]]:
        """Each sample's text pieces as token ids (None: the tokenizer failed on it)."""
        if self.tokenizer is None:
            return [[utf8_bytes(t) for t in s.texts] for s in samples]
        flat = [t for s in samples for t in s.texts if t]
        try:
            ids = iter(self.tokenizer.encode_texts(flat)) if flat else iter(())
        except TokenizerError as exc:   # name the sample; its pieces fail the call alone
            return self._tokenize_each(samples, problems, records)
        return [[np.asarray(next(ids)) if t else np.zeros(0, np.int32) for t in s.texts]
                for s in samples]

    def _tokenize_each(self, samples, problems, records):
        out = []
        for sample, record in zip(samples, records):
            try:
                out.append([np.asarray(ids) for ids in
                            self.tokenizer.encode_texts(list(sample.texts))])
            except TokenizerError as exc:
                problems.record(record.index, f"sample {sample.key!r}: {exc}")
                out.append(None)
        return out

    def _fuse(self, pieces: list[np.ndarray], refs: list[ImageRef]
              ) -> tuple[np.ndarray, Optional[str]]:
        parts = []
        image_id = self.images.image_token_id
        for k, piece in enumerate(pieces):
            try:
                ids = token_ids(piece.reshape(-1))
            except TokenIdError as exc:
                return np.zeros(0, np.int32), str(exc)
            if ids.size and (ids == image_id).any():
                return np.zeros(0, np.int32), (f"the text's tokens hold image_token_id "
                                               f"{image_id}, which marks image positions")
            parts.append(ids)
            if k < len(refs):
                parts.extend((self._begin, np.full(refs[k].placement.tokens, image_id,
                                                   np.int32), self._end))
        return np.concatenate(parts).astype(np.int32, copy=False), None
