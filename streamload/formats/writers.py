"""Write shards in the formats streamload reads: for tests, the demo and small conversions.

These write local files; upload them to object storage with any tool.
"""
from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import msgspec
import numpy as np
import zstandard

from ..errors import ConfigError
from .tokens import OFFSETS_SUFFIX, TOKENS_SUFFIX

_COMPRESSION_NAMES = {"gz": "gzip", "gzip": "gzip", "zst": "zstd", "zstd": "zstd"}
_TOKEN_DTYPES = (np.uint16, np.uint32, np.int32, np.int64)


def write_jsonl(path: str | os.PathLike, texts: Iterable[str], compression: str | None = None,
                text_field: str = "text",
                extra_fields: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None) -> Path:
    """Write one JSON object per text: `{text_field: text, **extra}`, one per line.

    `compression` is None (taken from the file name: `.gz`, `.zst`/`.zstd`, else plain), "plain",
    "gz" or "zst". `extra_fields` is one mapping added to every record, or one mapping per text.
    """
    path = Path(path)
    if compression is None:
        kind = _COMPRESSION_NAMES.get(path.suffix.lower().lstrip("."))
    elif compression == "plain":
        kind = None
    elif compression in _COMPRESSION_NAMES:
        kind = _COMPRESSION_NAMES[compression]
    else:
        raise ConfigError.at("compression",
                             f"must be None, 'plain', 'gz' or 'zst', got {compression!r}")

    encode = msgspec.json.Encoder().encode
    per_record = extra_fields is not None and not isinstance(extra_fields, Mapping)
    texts = list(texts)
    if per_record and len(extra_fields) != len(texts):
        raise ConfigError.at("extra_fields",
                             f"has {len(extra_fields)} entries for {len(texts)} texts")
    lines = []
    for i, text in enumerate(texts):
        extra = extra_fields[i] if per_record else (extra_fields or {})
        lines.append(encode({**extra, text_field: text}))
    data = b"\n".join(lines) + b"\n" if lines else b""

    if kind == "gzip":
        data = gzip.compress(data, mtime=0)
    elif kind == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def write_token_shard(path_stem: str | os.PathLike, docs: Sequence[np.ndarray],
                      dtype: Any = np.uint16) -> tuple[Path, Path]:
    """Write `<stem>.tokens.npy` (every document back to back, as `dtype`) and
    `<stem>.offsets.npy` (int64, n_docs + 1 entries). Returns both paths."""
    dtype = np.dtype(dtype)
    if dtype not in {np.dtype(t) for t in _TOKEN_DTYPES}:
        raise ConfigError.at("dtype", f"must be uint16, uint32, int32 or int64, got {dtype}")
    info = np.iinfo(dtype)
    arrays = [np.asarray(doc).reshape(-1) for doc in docs]
    for i, doc in enumerate(arrays):
        if doc.size and doc.dtype.kind not in "iub":
            raise ConfigError.at(f"docs[{i}]", f"has non-integer dtype {doc.dtype}")
        if doc.size and (doc.min() < max(info.min, 0) or doc.max() > info.max):
            raise ConfigError.at(f"docs[{i}]", f"has token ids outside [0, {info.max}] for {dtype}")
    lengths = np.array([doc.size for doc in arrays], dtype=np.int64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(arrays).astype(dtype.newbyteorder("<")) if arrays else np.empty(0, dtype)

    stem = str(path_stem)
    tokens_path, offsets_path = Path(stem + TOKENS_SUFFIX), Path(stem + OFFSETS_SUFFIX)
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    np.save(tokens_path, tokens, allow_pickle=False)
    np.save(offsets_path, offsets.astype("<i8"), allow_pickle=False)
    return tokens_path, offsets_path


def write_webdataset_shard(path: str | os.PathLike,
                           samples: Sequence[Mapping[str, Union[str, bytes]]],
                           keys: Optional[Sequence[str]] = None,
                           format: int = tarfile.PAX_FORMAT) -> Path:
    """Write a WebDataset tar with Python's `tarfile`: sample k's members are
    `<key>.<extension>` for each (extension, data) it maps (str data as UTF-8), its key
    `keys[k]` (default `%06d` of k). `.tar.gz` / `.tgz` names are gzip-compressed."""
    from .webdataset import compression_of   # here: the formats import lazily (FORMATS)

    path = Path(path)
    if keys is not None and len(keys) != len(samples):
        raise ConfigError.at("keys", f"{len(keys)} keys for {len(samples)} samples")
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "w:gz" if compression_of(str(path)) == "gzip" else "w"
    with tarfile.open(path, mode, format=format) as tar:
        for k, sample in enumerate(samples):
            key = keys[k] if keys is not None else f"{k:06d}"
            for extension, data in sample.items():
                data = data.encode("utf-8") if isinstance(data, str) else bytes(data)
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
    return path
