"""Shard formats: which format reads a URI, and the formats themselves.

`format_for(uri, format_name=..., text_field=..., tokens_field=...)` picks the format for one
listed object, or returns None for objects that are no shard (companion index files, unknown
names), which the fetcher leaves out.

Every format class is built as `Format(text_field, tokens_field, named)`: `text_field` None
means the format's own default; `named` is True when the user chose the format by name. A
source with `images` (`vision.Images`) gets the formats that read images (`IMAGE_FORMATS`),
built with `images=` too; the others are not considered for it.
"""
from __future__ import annotations

from functools import lru_cache
from importlib import import_module

from ..errors import ConfigError
from .base import LENGTHS_CHUNK_BYTES, Problems, RawRecord, ShardFormat, ShardStream
from .jsonl import JsonlFormat
from .tokens import TokensFormat
from .writers import write_jsonl, write_token_shard

# name -> "module:Class" of every format, imported when first used. Auto-detection tries them
# in this order.
FORMATS: dict[str, str] = {
    "jsonl": "jsonl:JsonlFormat",
    "tokens": "tokens:TokensFormat",
    "parquet": "parquet:ParquetFormat",
    "megatron": "megatron:MegatronFormat",
    "mds": "mds:MdsFormat",
    "litdata": "litdata:LitdataFormat",
    "webdataset": "webdataset:WebdatasetFormat",
}
# Formats that read image-text samples (`formats/images.py`).
IMAGE_FORMATS = ("parquet", "webdataset")


@lru_cache(maxsize=None)
def _instance(name: str, text_field: str | None, tokens_field: str | None,
              named: bool, images=None) -> ShardFormat:
    module, cls = FORMATS[name].split(":")
    fmt = getattr(import_module(f"{__name__}.{module}"), cls)
    if images is None:
        return fmt(text_field, tokens_field, named)
    return fmt(text_field, tokens_field, named, images=images)


def format_for(uri: str, *, format_name: str | None = None, text_field: str | None = None,
               tokens_field: str | None = None, images=None) -> ShardFormat | None:
    """The format that reads `uri`, or None when `uri` is not a shard.

    With `format_name` None the format comes from the file name (`.jsonl[.gz|.zst]`,
    `.ndjson[...]`, `.tokens.npy`). With a name, only that format is considered; naming "jsonl"
    also reads `.json[.gz|.zst]` files as JSON Lines.
    """
    if format_name is not None:
        if format_name not in FORMATS:
            raise ConfigError(f"format: unknown format {format_name!r}; "
                              f"known formats are {', '.join(sorted(FORMATS))}")
        if images is not None and format_name not in IMAGE_FORMATS:
            raise ConfigError(f"format: {format_name!r} holds no images; a source with images "
                              f"reads {' or '.join(IMAGE_FORMATS)}")
        fmt = _instance(format_name, text_field, tokens_field, True, images)
        return fmt if fmt.matches(uri) else None
    for name in (FORMATS if images is None else IMAGE_FORMATS):
        fmt = _instance(name, text_field, tokens_field, False, images)
        if fmt.matches(uri):
            return fmt
    return None


__all__ = [
    "FORMATS", "JsonlFormat", "LENGTHS_CHUNK_BYTES", "Problems", "RawRecord", "ShardFormat",
    "ShardStream", "TokensFormat", "format_for", "write_jsonl", "write_token_shard",
]
