"""How a LitData dataset's items are laid out (`Layout`, from `index.json`'s config and the
source's fields) and decoding an item's leaves into a record (`Decoder`).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np
import zstandard

from ..base import (BadShard, MissingField, Records, column_dtype, field_hint, joined_spans,
                    utf8_spans)


_DEFAULT_FRAME_ROWS = 256


# Serializer dtype indexes (litdata.constants): numpy's and torch's integer types.
_NUMPY_INT_DTYPES = {0: "i1", 1: "<i2", 2: "<i4", 3: "<i8", 4: "u1", 5: "<u2", 6: "<u4", 7: "<u8"}


_TORCH_INT_DTYPES = {11: "u1", 12: "i1", 13: "<i2", 14: "<i2", 15: "<i4", 16: "<i4", 17: "<i8",
                     18: "<i8", 20: "<u2"}


# Leaves of a constant byte size (their size still sits in each item's header).
_FIXED_LEAF_BYTES = {"int": 8, "float": 8, "bool": 1}


_TEXT_LEAVES = ("str", "text")


def _token_dtype(data_format: str) -> Optional[np.dtype]:
    """The token dtype of a 1-D "no_header_numpy:<k>" / "no_header_tensor:<k>" leaf, else None."""
    kind, _, index = data_format.partition(":")
    table = {"no_header_numpy": _NUMPY_INT_DTYPES, "no_header_tensor": _TORCH_INT_DTYPES}.get(kind)
    if table is None or not index.isdigit() or int(index) not in table:
        return None
    return np.dtype(table[int(index)])


def _out_dtype(dtype: np.dtype) -> np.dtype:
    """Dtype of the arrays handed out: int32 where every value fits (signed ones are checked for
    negative ids here), else the stored one (`to_tokens` checks those)."""
    if dtype.itemsize <= 2 or dtype == np.dtype("<i4"):
        return np.dtype(np.int32)
    return dtype.newbyteorder("=")


def _leaf_names(data_spec) -> Optional[list[str]]:
    """The leaves' names, in leaf order, from the serialized pytree spec (None: unreadable)."""
    try:
        spec = json.loads(data_spec) if isinstance(data_spec, str) else data_spec
        _protocol, root = spec
        names: list[str] = []

        def walk(node, path: str) -> None:
            children = node.get("children_spec") or []
            if node.get("type") is None and not children:
                names.append(path)
                return
            context = node.get("context")
            if isinstance(context, str):
                try:
                    context = json.loads(context)
                except ValueError:
                    pass
            if isinstance(context, dict):   # defaultdict
                context = context.get("dict_context")
            keys = ([str(k) for k in context] if isinstance(context, list)
                    and len(context) == len(children) else [str(i) for i in range(len(children))])
            for key, child in zip(keys, children):
                walk(child, f"{path}.{key}" if path else key)

        walk(root, "")
        return names
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


@dataclass(frozen=True)
class Layout:
    """How to read a dataset's items, from its index's config and the format's options."""
    tokens_loader: bool
    leaf_formats: tuple[str, ...]
    leaf_names: tuple[str, ...]
    leaf: int                       # the leaf delivered (PyTree), or 0 (TokensLoader)
    dtype: Optional[np.dtype]       # token dtype; None for text (or a "json" list leaf)
    want_tokens: bool               # tokens (TokensLoader, tokens_field) rather than text
    block_size: Optional[int]       # TokensLoader blocks; None: one record per written item
    whole_file: bool                # whole-file compression: read and inflate the chunk whole
    level: str                      # "none", "chunk", "batch" (framed) or "sample"
    frame_rows: int
    field_name: str                 # for messages

    @property
    def fixed_other_bytes(self) -> Optional[int]:
        """Bytes of the other leaves when they all have a fixed size, else None."""
        total = 0
        for k, name in enumerate(self.leaf_formats):
            if k != self.leaf:
                if name not in _FIXED_LEAF_BYTES:
                    return None
                total += _FIXED_LEAF_BYTES[name]
        return total


def parse_config(config, *, text_field: str, tokens_field: Optional[str],
                  block_size: Optional[int]) -> Layout:
    """The dataset's layout; raises BadShard for what this format cannot read."""
    if not isinstance(config, dict):
        raise BadShard("its 'config' is missing or not an object")
    if config.get("encryption"):
        raise BadShard("the dataset is encrypted, which this format does not read")
    if config.get("format") not in (None, "litdata"):
        raise BadShard(f"config format {config.get('format')!r} is not a litdata chunk format")
    loader = config.get("item_loader") or "PyTreeLoader"
    if loader not in ("PyTreeLoader", "TokensLoader"):
        raise BadShard(f"item_loader {loader!r} is not supported (PyTreeLoader and "
                        "TokensLoader chunks are)")
    formats = config.get("data_format")
    if not isinstance(formats, list) or not formats or not all(isinstance(f, str) for f in formats):
        raise BadShard(f"its config has no usable 'data_format' (found {formats!r})")
    compression = config.get("compression")
    level_name = config.get("compression_level")
    if compression:
        if not str(compression).startswith("zstd"):
            raise BadShard(f"compression {compression!r} is not supported (zstd is)")
        level = level_name or "chunk"
        if level not in ("chunk", "batch", "sample"):
            raise BadShard(f"compression_level {level_name!r} is not known")
    else:
        level = "none"
    frame_rows = config.get("compression_batch_size")
    if not isinstance(frame_rows, int) or frame_rows < 1:
        frame_rows = _DEFAULT_FRAME_ROWS   # a hint only: the chunk's own header says

    if loader == "TokensLoader":
        dtype = _token_dtype(formats[0])
        if len(formats) != 1 or dtype is None:
            raise BadShard(f"TokensLoader data_format {formats!r} is not one 1-D integer array")
        size = block_size if block_size is not None else config.get("block_size")
        if size is not None and (not isinstance(size, int) or size < 1):
            raise BadShard(f"block_size must be a positive integer, found {size!r}")
        return Layout(True, tuple(formats), ("",), 0, dtype, True, size, level == "chunk",
                       level, frame_rows, "tokens")

    names = _leaf_names(config.get("data_spec"))
    if names is None or len(names) != len(formats):
        names = [str(k) for k in range(len(formats))]
    described = ", ".join(f"{n or '<item>'} ({f})" for n, f in zip(names, formats))
    wanted = tokens_field if tokens_field is not None else text_field
    if wanted in names:
        leaf = names.index(wanted)
    elif names == [""]:   # the items are bare leaves: no field names to choose from
        leaf = 0
    else:
        kind = "tokens_field" if tokens_field is not None else "text_field"
        raise MissingField(f"{kind} {wanted!r} is not a field of its items; they have: "
                           f"{described}{field_hint(kind, wanted, [n for n in names if n])}")
    leaf_format = formats[leaf]
    name = names[leaf] or "<item>"
    bare_tokens = names == [""] and _token_dtype(leaf_format) is not None
    if tokens_field is not None or bare_tokens:   # a bare token array needs no field name
        dtype = _token_dtype(leaf_format)
        if dtype is None and leaf_format not in ("json",):   # "json": Arrow-footer lists
            raise BadShard(f"field {name!r} holds {leaf_format!r}, not a 1-D integer array "
                            f"(no_header_numpy / no_header_tensor); fields: {described}")
    else:
        dtype = None
        if leaf_format not in _TEXT_LEAVES:
            raise BadShard(f"field {name!r} holds {leaf_format!r}, not text (str); use "
                            f"tokens_field for token arrays; fields: {described}")
    return Layout(False, tuple(formats), tuple(names), leaf, dtype,
                   tokens_field is not None or bare_tokens, None, level == "chunk", level,
                   frame_rows, name)


class Decoder:
    """Turns one item's (or block's) bytes into a record payload, or raises BadRecord."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.n_leaves = len(layout.leaf_formats)
        self.sizes = struct.Struct("<" + "I" * self.n_leaves)
        self.out_dtype = _out_dtype(layout.dtype) if layout.dtype is not None else None
        self.inflate = zstandard.ZstdDecompressor() if layout.level == "sample" else None

    def tokens(self, data) -> np.ndarray:
        dtype = self.layout.dtype
        if dtype is None:   # a "json" leaf: only its Arrow-footer rows are read
            raise BadShard(f"field {self.layout.field_name!r} is a JSON-encoded leaf, read "
                            "only from chunks whose rows sit in an Arrow footer")
        if len(data) % dtype.itemsize:
            raise BadRecord(f"{len(data)} bytes of tokens is not a multiple of "
                             f"{dtype.itemsize} ({dtype})")
        ids = np.frombuffer(data, dtype).astype(self.out_dtype)
        if dtype.kind == "i" and ids.size and ids.min() < 0:
            raise BadRecord("negative token id")
        return ids

    def columns(self, data: bytes, begin: np.ndarray, end: np.ndarray,
                first: int) -> Optional[Records]:
        """Items first.. whose wanted leaf is data[begin[k]:end[k]] (`spans`, none of
        them bad) as columns: their texts, or their token ids in one buffer (one join of the
        leaves), no Python object per item for ids. None when one of them is not valid UTF-8,
        not whole ids or holds a negative one: the item-by-item path reports it."""
        index = np.arange(first, first + begin.shape[0], dtype=np.int64)
        if not self.layout.want_tokens:
            texts = utf8_spans(data, begin, end)
            return None if texts is None else Records(index, texts=texts)
        dtype = self.layout.dtype
        if dtype is None or ((end - begin) % dtype.itemsize).any():
            return None
        tokens = np.frombuffer(joined_spans(data, begin, end), dtype)
        if dtype.kind == "i" and tokens.size and tokens.min() < 0:
            return None
        offsets = np.zeros(begin.shape[0] + 1, np.int64)
        np.cumsum((end - begin) // dtype.itemsize, out=offsets[1:])
        return Records(index, offsets=offsets,
                       tokens=tokens.astype(column_dtype(dtype, self.out_dtype), copy=False))

    def spans(self, data: bytes, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        """PyTree items data[bounds[k]:bounds[k + 1]], their headers read at once: where in
        `data` each item's wanted leaf begins and ends, and {k: reason} for bad items."""
        n, width = len(bounds) - 1, 4 * self.n_leaves
        starts, lengths = bounds[:-1], np.diff(bounds)
        errors = {}
        short = np.flatnonzero(lengths < width)
        for k in short.tolist():
            errors[k] = (f"item of {int(lengths[k])} bytes is shorter than its "
                         f"{self.n_leaves}-leaf header")
        heads = np.where(lengths < width, 0, starts) if short.size else starts
        raw = np.frombuffer(data, np.uint8, count=int(bounds[-1]))
        if raw.size < width:   # only short items: read zeros in place of their headers
            raw = np.concatenate([raw, np.zeros(width, np.uint8)])
        sizes = raw[heads[:, None] + np.arange(width)].view("<u4").astype(np.int64)
        sizes = sizes.reshape(n, self.n_leaves)
        begin = starts + width + sizes[:, :self.layout.leaf].sum(axis=1)
        end = begin + sizes[:, self.layout.leaf]
        bad = np.flatnonzero(sizes.sum(axis=1) + width != lengths)
        for k in bad.tolist():
            errors.setdefault(k, f"item header sizes {sizes[k].tolist()} do not add up to the "
                                 f"item's {int(lengths[k])} bytes")
        return begin, end, errors

    def item(self, data):
        if self.inflate is not None:
            try:
                data = inflate(self.inflate, data)
            except (zstandard.ZstdError, Truncated) as exc:
                raise BadRecord(f"corrupt zstd item: {exc}") from None
        if self.layout.tokens_loader:
            return self.tokens(data)
        header = 4 * self.n_leaves
        if len(data) < header:
            raise BadRecord(f"item of {len(data)} bytes is shorter than its "
                             f"{self.n_leaves}-leaf header")
        sizes = self.sizes.unpack_from(data, 0)
        if header + sum(sizes) != len(data):
            raise BadRecord(f"item header sizes {list(sizes)} do not add up to the item's "
                             f"{len(data)} bytes")
        start = header + sum(sizes[:self.layout.leaf])
        payload = data[start:start + sizes[self.layout.leaf]]
        if self.layout.want_tokens:
            return self.tokens(payload)
        try:
            return str(payload, "utf-8")
        except UnicodeDecodeError as exc:
            raise BadRecord(f"field {self.layout.field_name!r} is not valid UTF-8: {exc}") from None


class BadRecord(Exception):
    pass


class Truncated(Exception):
    pass


def inflate(dctx: zstandard.ZstdDecompressor, data) -> bytes:
    """One whole zstd frame (its content size may be unknown); Truncated if it is cut."""
    inflater = dctx.decompressobj()
    out = inflater.decompress(bytes(data))
    if not inflater.eof:
        raise Truncated("the zstd frame is truncated")
    return out
