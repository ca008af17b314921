"""Context-parallel (CP) split of a packed row, as Megatron-LM does it for THD (packed) data.
Pure NumPy.

Definition. A CP group of `cp` ranks shares each packed row. Every document (segment
[cu_seqlens[d], cu_seqlens[d+1]) of the row) is

1. padded at its end to a multiple of 2·cp: padded_len = ceil(len / (2·cp)) · 2·cp, giving
   `cu_seqlens_padded` (`pad_documents`);
2. cut into 2·cp equal chunks of m = padded_len / (2·cp) slots;
3. CP rank r keeps chunk r and chunk 2·cp−1−r, in that order (the "zigzag": under causal
   attention chunk c costs m²·c + m(m+1)/2, so every pair {r, 2·cp−1−r} costs the same,
   m²·(2·cp−1) + m(m+1), and the ranks' attention work is equal).

cp = 1 is the identity: no padding, no split (Megatron skips CP entirely for cp_size 1, and its
SFT dataset pads only when cp > 1).

Rank r's part of the row is its 2·m slots of every document, concatenated in document order.
Its local cu_seqlens are the cumulative local lengths padded_len / cp, so every rank holds
exactly cu_seqlens_padded[-1] / cp slots. A slot beyond a document's real length is a padding
slot: `cp_partition` marks it -1 and `cp_split` writes `fill[name]` there.

Padding. Padding goes at the end of each document, never the front, so under causal masking no
real token attends to a pad; pads are loss-masked through `fill` (labels -100, loss_mask 0,
tokens a pad id). position_ids at padding slots: `fill["position_ids"]` when given (Megatron's
data_schedule writes 0 there); otherwise the document's positions continue, last real position
+1, +2, ... (what Megatron's SFT dataset writes when it pads each conversation to a multiple of
2·cp). Kept real tokens always carry their original position_ids.

Reference. Megatron-LM `get_batch_on_this_cp_rank` / `get_thd_batch_on_this_cp_rank`
(megatron/core/utils.py) index-select every per-token tensor with Transformer Engine's
`tex.thd_get_partitioned_indices(cu_seqlens_padded, total_tokens, cp_size, cp_rank)`, whose
kernel requires every padded length to be divisible by 2·cp and maps local token t of document
d to cu_seqlens_padded[d] + chunk·m + offset with chunk r in the first half of the local
document and 2·cp−1−r in the second: the `index` here, with real-token indices into the
unpadded row and -1 for pads. Megatron's SFT dataset (megatron/training/datasets/sft_dataset.py)
and data_schedule (`_build_thd_padding_mask`, `_sanitize_thd_padding_values`) build the padding.
Attention: Transformer Engine takes the global cu_seqlens (real lengths) and
cu_seqlens_padded (returned by `cp_partition`) and divides by cp itself; a local varlen kernel
(flash-attn) takes the local cu_seqlens and `max_seqlen` returned by `cp_split`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import ConfigError

POSITION_IDS = "position_ids"


def _check_cu(cu_seqlens) -> np.ndarray:
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    if cu.size == 0 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ConfigError.at("cu_seqlens", "must start at 0 and never decrease, got "
                             f"{np.asarray(cu_seqlens).tolist()[:8]}")
    return cu


def _check_cp(cp: int, cp_rank: int | None = None) -> None:
    if int(cp) != cp or cp < 1:
        raise ConfigError.at("cp", f"must be an integer >= 1, got {cp!r}")
    if cp_rank is not None and not (int(cp_rank) == cp_rank and 0 <= cp_rank < cp):
        raise ConfigError.at("cp_rank", f"must be in [0, {cp}), got {cp_rank!r}")


def pad_documents(cu_seqlens, multiple: int) -> np.ndarray:
    """cu_seqlens with every document's length rounded up to a multiple of `multiple` (int64).
    Megatron calls the result cu_seqlens_padded; for CP, multiple = 2·cp."""
    if int(multiple) != multiple or multiple < 1:
        raise ConfigError.at("multiple", f"must be an integer >= 1, got {multiple!r}")
    cu = _check_cu(cu_seqlens)
    lengths = np.diff(cu)
    padded = np.zeros_like(cu)
    np.cumsum(-(-lengths // multiple) * multiple, out=padded[1:])
    return padded


def _partition(cu: np.ndarray, cp: int, cp_rank: int):
    """(index, local_cu, padded_cu, doc of each slot, offset of each slot in its padded doc)."""
    lengths = np.diff(cu)
    if cp == 1:     # no split, no padding: the identity, as Megatron skips CP for cp_size 1
        index = np.arange(int(cu[-1]), dtype=np.int64)
        doc = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
        return index, cu.copy(), cu.copy(), doc, index - cu[doc]
    padded_cu = pad_documents(cu, 2 * cp)
    chunk = np.diff(padded_cu) // (2 * cp)            # m per document
    local_cu = np.zeros_like(cu)
    np.cumsum(2 * chunk, out=local_cu[1:])
    total = int(local_cu[-1])
    doc = np.repeat(np.arange(lengths.size, dtype=np.int64), 2 * chunk)
    k = np.arange(total, dtype=np.int64) - local_cu[doc]   # slot within the local document
    m = chunk[doc]
    second = k >= m
    # first half: chunk r, offset k; second half: chunk 2cp-1-r, offset k - m
    offset = np.where(second, (2 * cp - 1 - cp_rank) * m + (k - m), cp_rank * m + k)
    index = np.where(offset < lengths[doc], cu[doc] + offset, -1)
    return index, local_cu, padded_cu, doc, offset


def cp_partition(cu_seqlens, cp: int, cp_rank: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CP rank `cp_rank`'s share of a packed row (the module docstring's definition).

    Returns int64 arrays:
      index: for each of the rank's local slots, the index into the row's tokens, or -1 for a
        padding slot; length cu_seqlens_padded[-1] / cp.
      local_cu_seqlens: cumulative local document lengths (each padded_len / cp).
      padded_cu_seqlens: the row's cu_seqlens with documents padded to a multiple of 2·cp
        (Megatron's cu_seqlens_padded, global: not divided by cp); cu_seqlens when cp = 1.
    Vectorized: no Python loop over documents."""
    _check_cp(cp, cp_rank)
    index, local_cu, padded_cu, _, _ = _partition(_check_cu(cu_seqlens), int(cp), int(cp_rank))
    return index, local_cu, padded_cu


def cp_split(arrays: Mapping[str, np.ndarray], cu_seqlens, cp: int, cp_rank: int,
             fill: Mapping[str, int]) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
    """Apply `cp_partition` to every per-token array (first axis = the row's tokens).

    Padding slots get `fill[name]`; every array needs a fill value except position_ids, whose
    padding slots continue the document's positions when `fill` has none (module docstring).
    Keys of `fill` without an array are ignored. Returns (local arrays, same dtypes; local
    cu_seqlens, int64; max_seqlen = the longest local document, max padded_len / cp)."""
    _check_cp(cp, cp_rank)
    cu = _check_cu(cu_seqlens)
    n = int(cu[-1])
    for name, array in arrays.items():
        if np.ndim(array) == 0 or np.shape(array)[0] != n:
            raise ConfigError.at(name, f"must have cu_seqlens[-1] = {n} tokens on its first axis, "
                                 f"got shape {np.shape(array)}")
        if name not in fill and name != POSITION_IDS:
            raise ConfigError.at(f"fill[{name!r}]", "is missing: the value for padding slots")
    index, local_cu, _, doc, offset = _partition(cu, int(cp), int(cp_rank))
    pad = index < 0
    any_pad = bool(pad.any())
    safe = np.where(pad, 0, index) if any_pad else index
    local = {}
    for name, array in arrays.items():
        array = np.asarray(array)
        out = array[safe]
        if any_pad:
            if name in fill:
                out[pad] = fill[name]
            else:   # position_ids: continue from the document's last real position
                lengths = np.diff(cu)
                d = doc[pad]
                step = (offset[pad] - lengths[d] + 1).reshape((-1,) + (1,) * (array.ndim - 1))
                out[pad] = array[cu[d + 1] - 1] + step
        local[name] = out
    lengths_local = np.diff(local_cu)
    max_seqlen = int(lengths_local.max()) if lengths_local.size else 0
    return local, local_cu, max_seqlen


def cp_reassemble(parts: Sequence[Mapping[str, np.ndarray]], cu_seqlens, cp: int
                  ) -> dict[str, np.ndarray]:
    """The row rebuilt from all CP ranks' parts: parts[r] is rank r's local arrays (as from
    `cp_split`); padding slots are dropped. The inverse of splitting over r = 0..cp-1."""
    _check_cp(cp)
    if len(parts) != cp:
        raise ConfigError.at("parts", f"must hold one part per CP rank ({cp}), got {len(parts)}")
    cu = _check_cu(cu_seqlens)
    n = int(cu[-1])
    names = list(parts[0].keys()) if parts else []
    for r, part in enumerate(parts):
        if set(part.keys()) != set(names):
            raise ConfigError.at(f"parts[{r}]", f"has fields {sorted(part)}, expected "
                                 f"{sorted(names)}")
    rows: dict[str, np.ndarray] = {}
    for r, part in enumerate(parts):
        index, _, _, _, _ = _partition(cu, int(cp), r)
        real = index >= 0
        for name in names:
            local = np.asarray(part[name])
            if local.shape[0] != index.size:
                raise ConfigError.at(f"parts[{r}][{name!r}]", f"must have {index.size} slots, "
                                     f"got shape {local.shape}")
            if name not in rows:
                rows[name] = np.empty((n,) + local.shape[1:], dtype=local.dtype)
            rows[name][index[real]] = local[real]
    return rows
