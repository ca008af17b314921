"""Pack planned samples into rows: tokens, cu_seqlens, position_ids, and the trainer's targets
(labels, loss mask). Pure NumPy.

Labels are the next token within the same segment of `cu_seqlens`, and IGNORE_INDEX at each
segment's last token: a document's last token has nothing to predict, and neither has the last
token of a piece of a split document (the piece is its own segment, attended to alone, so its
successor is not in its context). The loss mask is 1.0 where a label counts, else 0.0.

Padded rows (`pad_to_capacity`) hold exactly C tokens: the documents, then the padding as one
final pseudo-document (so cu_seqlens[-1] == C, the form flash-attn's varlen kernels and
Megatron/Transformer Engine THD attention take). The padding's tokens are the pad id, its
positions count from 0 like any segment's (so position ids and cu_seqlens name the same
segments: a consumer that derives boundaries from positions, such as Hugging Face's
position-id packing, sees the padding as one sequence too), its labels are IGNORE_INDEX and its
loss mask 0. A full row gets no padding segment.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

IGNORE_INDEX = -100   # label of a token with no target (PyTorch's cross_entropy default)


@dataclass(frozen=True)
class PackedRow:
    tokens: np.ndarray        # int64 [n]
    cu_seqlens: np.ndarray    # int32 [segments + 1]: the documents, then the padding if any
    position_ids: np.ndarray  # int64 [n], restarting at 0 for each segment
    labels: np.ndarray        # int64 [n], the next token in the segment; IGNORE_INDEX at its end
    loss_mask: np.ndarray     # float32 [n], 1.0 where labels != IGNORE_INDEX, else 0.0
    item_indices: np.ndarray  # which of the input items are in this row, in order
    max_seqlen: int           # longest segment of cu_seqlens (the padding included)
    padding: int = 0          # pad tokens at the end of the row (the last segment when > 0)


# pack_rows' `out`: tokens, positions, labels (int64), loss mask (float32)
RowMemory = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def row_memory_words(step_tokens: int) -> int:
    """int64 words of one array that `split_row_memory` cuts into a step's row memory."""
    return 3 * step_tokens + (step_tokens + 1) // 2


def split_row_memory(memory: np.ndarray, step_tokens: int) -> RowMemory:
    """The `out` of pack_rows for up to `step_tokens` tokens, as views of one int64 array of
    `row_memory_words(step_tokens)` (so one recycled array holds a whole step, and every tensor
    made from a view keeps that array alive)."""
    S = step_tokens
    return (memory[:S], memory[S:2 * S], memory[2 * S:3 * S],
            memory[3 * S:].view(np.float32)[:S])


def pack_rows(token_arrays: list[np.ndarray], rows: np.ndarray, num_rows: int,
              capacity: int, out: Optional[RowMemory] = None, *,
              pad_to_capacity: bool = False, pad_token_id: int = 0,
              counting: Optional[np.ndarray] = None) -> list[PackedRow]:
    """Concatenate items into `num_rows` rows, keeping their order within each row. Items may
    hold any integer dtype that fits int64 (uint8 bytes, int32 ids, ...); token ids are >= 0.

    The rows are consecutive slices of one array per field: the four arrays of `out` (tokens,
    positions and labels int64, loss mask float32; each at least as long as all the items
    together, or num_rows * capacity when padding; see `split_row_memory`), or new ones. With
    `pad_to_capacity`, row r is [r*C, (r+1)*C), its padding (if any) its last segment.

    What it costs is the 28 bytes per token it writes (into memory last written steps ago,
    out of cache), so each field is written in one pass: unpadded rows lie back to back, so
    each field of the whole step is one NumPy call (`_fill`); padded rows one per row.
    `counting`: int64 0, 1, 2, ... (`np.arange(capacity)`, which a caller packing every step
    keeps: made anew, its pages are faulted in each time); made here when None or short."""
    rows = np.asarray(rows, dtype=np.int64)
    lengths = np.fromiter(map(len, token_arrays), dtype=np.int64, count=len(token_arrays))
    by_row = np.argsort(rows, kind="stable")   # grouped by row, input order within a row
    bounds = np.searchsorted(rows[by_row], np.arange(num_rows + 1))
    ordered_lengths = lengths[by_row]
    starts = np.zeros(by_row.size + 1, dtype=np.int64)   # of each item, unpadded, in row order
    np.cumsum(ordered_lengths, out=starts[1:])
    row_tokens = np.diff(starts[bounds])
    if row_tokens.size and row_tokens.max() > capacity:
        row = int(np.argmax(row_tokens > capacity))
        raise AssertionError(f"row {row} holds {row_tokens[row]} tokens > capacity {capacity}")
    if pad_to_capacity:
        row_begin = np.arange(num_rows, dtype=np.int64) * capacity
        padding = capacity - row_tokens
        n = num_rows * capacity
    else:
        row_begin = starts[bounds[:-1]]
        padding = np.zeros(num_rows, dtype=np.int64)
        n = int(starts[-1])
    if out is None:
        out = (np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64),
               np.empty(n, np.float32))
    tokens, positions, labels, loss_mask = (a[:n] for a in out)
    bounds_list, begin_list, used_list, pad_list = \
        bounds.tolist(), row_begin.tolist(), row_tokens.tolist(), padding.tolist()
    length_list = ordered_lengths.tolist()
    if n:
        items = [token_arrays[i] for i in by_row.tolist()]
        # Each segment's positions are a prefix of this: one concatenation of views is cheaper
        # than arange(total) - repeat(starts, lengths).
        longest = max(max(length_list, default=0), max(pad_list, default=0))
        if counting is None or counting.shape[0] < longest:
            counting = np.arange(longest, dtype=np.int64)
        if not pad_to_capacity:   # the rows lie back to back: the step at once
            _fill(items, length_list, 0, n, tokens, positions, labels, loss_mask, counting)
        else:
            for row in range(num_rows):
                a, b = bounds_list[row], bounds_list[row + 1]
                begin, used, pad = begin_list[row], used_list[row], pad_list[row]
                end = begin + used
                if used:
                    _fill(items[a:b], length_list[a:b], begin, end, tokens, positions, labels,
                          loss_mask, counting)
                if pad:   # one last pseudo-document, with nothing to predict
                    tokens[end:end + pad] = pad_token_id
                    positions[end:end + pad] = counting[:pad]
                    labels[end:end + pad] = IGNORE_INDEX
                    loss_mask[end:end + pad].fill(0.0)
        # Nothing to predict at a segment's last token (a row's last one among them).
        item_begin = starts[:-1]
        if pad_to_capacity:   # items move with their row's start
            item_begin = item_begin + np.repeat(row_begin - starts[bounds[:-1]], np.diff(bounds))
        ends = (item_begin + ordered_lengths - 1)[ordered_lengths > 0]
        labels[ends] = IGNORE_INDEX
        loss_mask[ends] = 0.0
    packed = []
    start_list = starts.tolist()
    for row in range(num_rows):
        a, b = bounds_list[row], bounds_list[row + 1]
        begin, pad = begin_list[row], pad_list[row]
        end = begin + used_list[row] + pad
        cu_seqlens = np.empty(b - a + 1 + (pad > 0), dtype=np.int32)
        np.subtract(starts[a:b + 1], start_list[a], out=cu_seqlens[:b - a + 1], casting="unsafe")
        if pad:
            cu_seqlens[-1] = capacity
        packed.append(PackedRow(tokens[begin:end], cu_seqlens, positions[begin:end],
                                labels[begin:end], loss_mask[begin:end], by_row[a:b],
                                max(max(length_list[a:b], default=0), pad), pad))
    return packed


def _fill(items: list[np.ndarray], lengths: list[int], begin: int, end: int,
          tokens: np.ndarray, positions: np.ndarray, labels: np.ndarray, loss_mask: np.ndarray,
          counting: np.ndarray) -> None:
    """`items` (holding end - begin tokens in all) back to back at [begin, end) of each field;
    labels are the next token there, each segment's last one left for the caller to fix."""
    np.concatenate(items, out=tokens[begin:end], casting="safe")
    # The labels are the same items one token on: from the items (1-8 bytes a token, in
    # cache) rather than from the int64 tokens just written.
    first = next(k for k, length in enumerate(lengths) if length)
    np.concatenate([items[first][1:], *items[first + 1:]], out=labels[begin:end - 1],
                   casting="safe")
    loss_mask[begin:end].fill(1.0)
    np.concatenate([counting[:length] for length in lengths], out=positions[begin:end])
