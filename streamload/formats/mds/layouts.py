"""Where an MDS sample keeps the source's column (`Layout`, from an index entry), and decoding
samples into records (`Decoder`): text from a `str` column, token ids from an ndarray column,
as `RawRecord`s or as columns (`Records`: the token ids of a range's samples in one buffer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..base import (BadShard, MissingField, Problems, RawRecord, Records, column_dtype,
                    field_hint, joined_spans, utf8_spans)
from .index import Entry


# MDS ndarray dtype codes (dynamic-dtype arrays store one of these bytes first).
_DTYPE_CODES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16",
                32: "uint32", 33: "int32", 34: "float32", 64: "uint64", 65: "int64",
                66: "float64"}


_INT_DTYPES = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"}


_SMALL_INTS = {"uint8", "int8", "uint16", "int16", "int32"}   # handed out as int32


class _BadSample(Exception):
    """One sample cannot be decoded: reported (`Problems.record`) and left out."""


# ---------------------------------------------------------------- columns


@dataclass(frozen=True)
class Layout:
    """Where the read column lies in a sample, and how to decode it."""
    field: str
    tokens: bool
    n_var: int                    # uint32 sizes at the start of every sample
    var_before: int               # variable-size columns before the field
    fixed_before: int             # bytes of fixed-size columns before the field
    fixed_total: int              # bytes of every fixed-size column
    size: Optional[int]           # the field's fixed size, None when variable
    dtype: Optional[str]          # ndarray: the static dtype, None when stored per sample
    shape: Optional[tuple]        # ndarray: the static shape, None when stored per sample

    @property
    def static_count(self) -> Optional[int]:
        """Token ids per sample when every sample holds the same number (a fixed shape)."""
        if self.tokens and self.dtype is not None and self.shape is not None:
            return int(np.prod(self.shape))
        return None


def _columns_text(entry: Entry) -> str:
    return ", ".join(f"{n!r} ({e})" for n, e in zip(entry.names, entry.encodings))


def _parse_ndarray(encoding: str, field: str) -> tuple[Optional[str], Optional[tuple]]:
    args = encoding.split(":")[1:]
    if len(args) > 2:
        raise BadShard(f"column {field!r} has an unknown ndarray encoding {encoding!r}")
    dtype = args[0] if args and args[0] else None
    shape = None
    if dtype is not None and dtype not in _DTYPE_CODES.values():
        raise BadShard(f"column {field!r} has an unknown ndarray dtype {dtype!r}")
    if dtype is not None and dtype not in _INT_DTYPES:
        raise BadShard(f"column {field!r} holds {dtype} arrays, not integer token ids")
    if len(args) == 2:
        try:
            shape = tuple(int(d) for d in args[1].split(","))
        except ValueError:
            raise BadShard(f"column {field!r} has an unreadable shape in {encoding!r}") from None
        if not shape or min(shape) < 1:
            raise BadShard(f"column {field!r} has an invalid shape in {encoding!r}")
        if sum(d > 1 for d in shape) > 1:
            raise BadShard(f"column {field!r} holds arrays of shape {shape}, not one "
                            f"sequence of token ids per sample")
    return dtype, shape


def layout_of(entry: Entry, field: str, tokens: bool) -> Layout:
    if field not in entry.names:
        option = "tokens_field" if tokens else "text_field"
        hint = "" if tokens else "; token ids are read with tokens_field=<ndarray column>"
        raise MissingField(f"no column {field!r} ({option}) in the shard; its columns are "
                           f"{_columns_text(entry)}{field_hint(option, field, entry.names)}"
                           f"{hint}")
    k = entry.names.index(field)
    encoding = entry.encodings[k]
    if encoding == "pkl":
        raise BadShard(f"column {field!r} is pickled (encoding 'pkl'); streamload does not "
                        f"unpickle data (unpickling runs arbitrary code)")
    dtype = shape = None
    if tokens:
        if encoding != "ndarray" and not encoding.startswith("ndarray:"):
            raise BadShard(f"column {field!r} has encoding {encoding!r}; token ids must be an "
                            f"ndarray column (ndarray, ndarray:<int dtype>[:<shape>])")
        dtype, shape = _parse_ndarray(encoding, field)
    elif encoding != "str":
        hint = (" (read ndarray columns with tokens_field)"
                if encoding.split(":")[0] == "ndarray" else "")
        raise BadShard(f"column {field!r} has encoding {encoding!r}; text must be a 'str' "
                        f"column{hint}")
    # As MDSReader does: a column without a (non-zero) fixed size has its size per sample.
    variable = [not s for s in entry.sizes]
    size = None if variable[k] else entry.sizes[k]
    if size is not None and dtype is not None and shape is not None:
        expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if size != expected:
            raise BadShard(f"column {field!r} ({encoding}) has size {size} in the index, "
                            f"but its arrays take {expected} bytes")
    return Layout(field, tokens, sum(variable), sum(variable[:k]),
                   sum(s for s, v in zip(entry.sizes[:k], variable[:k]) if not v),
                   sum(s for s, v in zip(entry.sizes, variable) if not v), size, dtype, shape)


def check_header(head: bytes, samples: int, size: int, what: str) -> np.ndarray:
    """The offsets of a raw shard's header (int64), checked against the index and the size."""
    want = 4 * (samples + 2)
    if len(head) < want:
        raise BadShard(f"{what} is truncated: {len(head)} bytes, too short for the header of "
                        f"{samples} samples")
    count = int.from_bytes(head[:4], "little")
    if count != samples:
        raise BadShard(f"{what} holds {count} samples but the index says {samples}")
    offsets = np.frombuffer(head, "<u4", samples + 1, 4).astype(np.int64)
    if offsets[0] < want or offsets[-1] != size:
        raise BadShard(f"{what} has a corrupt offsets table: samples span bytes "
                        f"{int(offsets[0])}..{int(offsets[-1])} of {size}")
    steps = np.diff(offsets)
    if steps.size and steps.min() < 0:
        bad = int(np.argmax(steps < 0))
        raise BadShard(f"{what} has a corrupt offsets table: it decreases at sample {bad}")
    return offsets


def _little_endian(raw: np.ndarray, at: np.ndarray, width: np.ndarray) -> np.ndarray:
    """The unsigned little-endian integers of `width[k]` bytes (1-8) at `at[k]` of `raw`, as
    int64 (one past 2**63 - 1 wraps negative)."""
    places = np.arange(int(width.max()))
    byte = raw[np.minimum(at[:, None] + places, raw.shape[0] - 1)].astype(np.uint64)
    byte[places >= width[:, None]] = 0
    return (byte << (8 * places).astype(np.uint64)).sum(axis=1, dtype=np.uint64).view(np.int64)


# ---------------------------------------------------------------- samples -> records


class Decoder:
    """Turns samples (bytes of one buffer) into records of the layout's column."""

    def __init__(self, layout: Layout, problems: Problems):
        self._layout, self._problems = layout, problems

    def records(self, buf: bytes, starts: np.ndarray, ends: np.ndarray,
                first: int) -> list[RawRecord]:
        """Samples buf[starts[k]:ends[k]] as records first.., one by one; each bad sample
        reported (`Problems.record`, naming it) and left out."""
        if not len(starts):
            return []
        ok, col_start, col_len, total = self._spans(buf, starts, ends)
        lengths = ends - starts
        out = []
        decode = self._tokens if self._layout.tokens else self._text
        for k, (good, start, size) in enumerate(zip(ok.tolist(), col_start.tolist(),
                                                    col_len.tolist())):
            try:
                if not good:
                    raise _BadSample(f"corrupt sample: it holds {int(lengths[k])} bytes but "
                                     f"its column sizes add up to {int(total[k])}")
                out.append(RawRecord(first + k, decode(buf, start, size)))
            except _BadSample as exc:
                self._problems.record(first + k, str(exc))
        return out

    def columns(self, buf: bytes, starts: np.ndarray, ends: np.ndarray, first: int) -> Records:
        """`records` as columns: texts as a list, or every sample's token ids copied into one
        buffer (one join of the column's bytes), with no Python object per sample (each
        sample's shape read in its own width). A range with a sample that is not well formed
        (a corrupt size or ndarray header, invalid UTF-8, a negative id, an array that is not
        1-D), or whose samples name different dtypes, is read by `records`, which reports
        each bad sample."""
        if not len(starts):
            return Records.empty()
        ok, col_start, col_len, _ = self._spans(buf, starts, ends)
        if ok.all():
            read = self._token_columns if self._layout.tokens else self._text_columns
            records = read(buf, col_start, col_len, first)
            if records is not None:
                return records
        return Records.of(self.records(buf, starts, ends, first))

    def _text_columns(self, buf: bytes, col_start: np.ndarray, col_len: np.ndarray,
                      first: int) -> Optional[Records]:
        texts = utf8_spans(buf, col_start, col_start + col_len)
        if texts is None:
            return None
        return Records(np.arange(first, first + len(texts), dtype=np.int64), texts=texts)

    def _token_columns(self, buf: bytes, col_start: np.ndarray, col_len: np.ndarray,
                       first: int) -> Optional[Records]:
        """What `_tokens` reads, for every sample at once: the ndarray headers (a dtype code,
        a 1-D shape) as columns, then the ids of every sample in one buffer."""
        lay, raw = self._layout, np.frombuffer(buf, np.uint8)
        at, end = col_start.copy(), col_start + col_len
        dtype = lay.dtype
        if dtype is None:   # the dtype's code, per sample: one for all of them here
            if (at >= end).any():
                return None
            codes = raw[at]
            dtype = _DTYPE_CODES.get(int(codes[0]))
            if dtype not in _INT_DTYPES or (codes != codes[0]).any():
                return None
            at += 1
        if lay.shape is None:   # [ndim << 2 | width code] [shape]: 1-D for all
            if (at >= end).any():
                return None
            heads = raw[at]
            if (heads >> 2 != 1).any():
                return None
            width = np.left_shift(1, heads & 3).astype(np.int64)   # the writer's smallest
            at += 1
            if (at + width > end).any():
                return None
            count = _little_endian(raw, at, width)
            at += width
        else:
            count = np.full(at.shape[0], int(np.prod(lay.shape)), np.int64)
        stored = np.dtype("<" + np.dtype(dtype).str[1:])
        # A count beyond the column's bytes first: count * itemsize could wrap past 2**63
        # (an 8-byte shape) and seem to fit.
        if ((count < 0) | (count > end - at)).any() \
                or not np.array_equal(at + count * stored.itemsize, end):
            return None
        tokens = np.frombuffer(joined_spans(buf, at, end), stored)
        if dtype in _SMALL_INTS:   # as `_tokens`: no negative ids, handed out as int32 (or
            if dtype[0] == "i" and tokens.size and tokens.min() < 0:   # a view of uint8/16)
                return None
            tokens = tokens.astype(column_dtype(stored, np.dtype(np.int32)), copy=False)
        offsets = np.zeros(count.shape[0] + 1, np.int64)
        np.cumsum(count, out=offsets[1:])
        return Records(np.arange(first, first + count.shape[0], dtype=np.int64), tokens=tokens,
                       offsets=offsets)

    def _spans(self, buf: bytes, starts: np.ndarray, ends: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per sample: whether its column sizes add up to its bytes, where the column starts
        and how long it is (bytes), and what the sizes add up to."""
        lay = self._layout
        n = len(starts)
        lengths = ends - starts
        header = 4 * lay.n_var
        ok = lengths >= header
        col_start = starts + header + lay.fixed_before
        col_len = np.full(n, lay.size or 0, np.int64)
        total = np.full(n, header + lay.fixed_total, np.int64)
        if lay.n_var:
            rows = np.flatnonzero(ok)
            raw = np.frombuffer(buf, np.uint8)
            at = (starts[rows, None] + 4 * np.arange(lay.n_var))[..., None] + np.arange(4)
            var = raw[at].view("<u4").reshape(len(rows), lay.n_var).astype(np.int64)
            total[rows] += var.sum(axis=1)
            col_start[rows] += var[:, :lay.var_before].sum(axis=1)
            if lay.size is None:
                col_len[rows] = var[:, lay.var_before]
        ok &= total == lengths
        return ok, col_start, col_len, total

    def _text(self, buf: bytes, start: int, size: int) -> str:
        try:
            return buf[start:start + size].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _BadSample(f"invalid UTF-8 in column {self._layout.field!r}: {exc}") from None

    def _tokens(self, buf: bytes, start: int, size: int) -> np.ndarray:
        lay = self._layout
        end = start + size
        at = start
        dtype = lay.dtype
        if dtype is None:   # the dtype's code, per sample
            if at >= end:
                raise _BadSample(f"corrupt ndarray in column {lay.field!r}: no dtype byte")
            dtype = _DTYPE_CODES.get(buf[at])
            at += 1
            if dtype is None:
                raise _BadSample(f"corrupt ndarray in column {lay.field!r}: unknown dtype "
                                 f"code {buf[at - 1]}")
            if dtype not in _INT_DTYPES:
                raise _BadSample(f"column {lay.field!r} holds a {dtype} array, not integer "
                                 f"token ids")
        shape = lay.shape
        if shape is None:   # [ndim << 2 | shape dtype code] [shape]
            if at >= end:
                raise _BadSample(f"corrupt ndarray in column {lay.field!r}: no shape")
            ndim, width = buf[at] >> 2, 1 << (buf[at] & 3)
            at += 1
            if not ndim or at + ndim * width > end:
                raise _BadSample(f"corrupt ndarray in column {lay.field!r}: bad shape header")
            shape = tuple(np.frombuffer(buf, f"<u{width}", ndim, at).tolist())
            at += ndim * width
            if sum(d > 1 for d in shape) > 1:
                raise _BadSample(f"column {lay.field!r} holds an array of shape {shape}, not "
                                 f"one sequence of token ids")
        count = int(np.prod(shape))
        itemsize = np.dtype(dtype).itemsize
        if at + count * itemsize != end:
            raise _BadSample(f"corrupt ndarray in column {lay.field!r}: shape {shape} of "
                             f"{dtype} needs {count * itemsize} bytes, {end - at} are stored")
        values = np.frombuffer(buf, "<" + np.dtype(dtype).str[1:], count, at)
        if dtype in _SMALL_INTS:
            if dtype[0] == "i" and count and values.min() < 0:
                raise _BadSample("negative token id")
            return values.astype(np.int32)
        return values.copy()   # not a view: a record must not keep the whole chunk alive
