"""Parquet rows of text and images, as Hugging Face `datasets` writes them.

A `datasets` Image feature is stored as a struct column of `bytes` (the encoded file) and
`path` (its original name); a Sequence(Image) as a list of such structs. The image column is
the first of the source's `Images.fields` that the file has ("image", "images", ...); the
text column is `text_field` ("text"): a string (with placeholders, or none: the images
first), or a list of strings and nulls (interleaved: each null takes the next image).

Each row group is one range spanning both columns' chunks (`parquet._plan` with two names);
the row's record is an `ImageText` whose images are named "column[row]" or
"column[row][k]". A null image cell is a sample without images; an image stored by path
alone (no bytes: a dataset saved without embedding its files) is a record error naming the
path, as is a null text.
"""
from __future__ import annotations

from .base import BadShard, MissingField, Problems, RawRecord, field_hint
from .images import ImageBlob, interleave
from .parquet import ParquetStream


def _image_column(pa, schema, images) -> str:
    for name in images.fields:
        if name in schema.names:
            return name
    raise MissingField(f"no image column ({', '.join(repr(f) for f in images.fields)}, "
                       f"images.fields); the file's columns are "
                       f"{', '.join(repr(n) for n in schema.names) or 'none'}"
                       f"{field_hint('images.fields', images.fields[0], schema.names)}")


def _is_image(pa, type_) -> bool:
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        type_ = type_.value_type
    if pa.types.is_struct(type_):
        names = [type_.field(i).name for i in range(type_.num_fields)]
        return "bytes" in names
    return pa.types.is_binary(type_) or pa.types.is_large_binary(type_)


def _is_text(pa, type_) -> bool:
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        type_ = type_.value_type
    return pa.types.is_string(type_) or pa.types.is_large_string(type_)


def image_stream(pa, shard, problems: Problems, metadata, footer_start: int, text: str,
                 images) -> "ParquetImageStream":
    try:
        schema = metadata.schema.to_arrow_schema()
    except (ValueError, pa.ArrowException) as exc:
        raise BadShard(f"unreadable Parquet schema: {exc}") from None
    if text not in schema.names:
        raise MissingField(f"no column {text!r} (text_field); the file's columns are "
                           f"{', '.join(repr(n) for n in schema.names) or 'none'}"
                           f"{field_hint('text_field', text, schema.names)}")
    column = _image_column(pa, schema, images)
    if not _is_text(pa, schema.field(text).type):
        raise BadShard(f"column {text!r} (text_field) must hold strings or lists of strings, "
                       f"found {schema.field(text).type}")
    if not _is_image(pa, schema.field(column).type):
        raise BadShard(f"column {column!r} must hold images (a struct of bytes and path, as "
                       f"datasets' Image writes it, or binary; or a list of them), found "
                       f"{schema.field(column).type}")
    return ParquetImageStream(shard, problems=problems, metadata=metadata,
                              footer_start=footer_start, text=text, column=column,
                              placeholder=images.placeholder)


class ParquetImageStream(ParquetStream):
    # Its records are image-text samples, one object each, never columns: not the text
    # stream's `decode_columns` (the fetcher reads an image source through `decode`).
    decode_columns = None

    def __init__(self, shard, *, problems: Problems, metadata, footer_start: int, text: str,
                 column: str, placeholder: str):
        super().__init__(shard, problems=problems, metadata=metadata, footer_start=footer_start,
                         field=(text, column), tokens=False)
        self._text, self._column, self._placeholder = text, column, placeholder

    def decode(self, chunk: bytes) -> list[RawRecord]:
        group = self._read_group(chunk, [self._text, self._column])
        if group is None:
            return []
        first, table = group
        records = []
        texts = table.column(self._text).to_pylist()
        cells = table.column(self._column).to_pylist()
        for row, (text, cell) in enumerate(zip(texts, cells)):
            index = first + row
            record, problem = self._record(index, text, cell)
            if problem is not None:
                self._record_error(index, problem)
            else:
                records.append(RawRecord(index, record))
        return records

    def _record(self, index: int, text, cell):
        if text is None:
            return None, f"null value in column {self._text!r}"
        listed = isinstance(cell, list)
        cells = cell if listed else ([] if cell is None else [cell])
        blobs = []
        for k, value in enumerate(cells):
            name = f"{self._column}[{index}]" + (f"[{k}]" if listed else "")
            data = value.get("bytes") if isinstance(value, dict) else value
            if data is None:
                path = value.get("path") if isinstance(value, dict) else None
                return None, (f"image {name} has no bytes" + (f" (only the path {path!r}: "
                              f"embed the files, e.g. datasets' embed_external_files)"
                              if path else ""))
            blobs.append(ImageBlob(name, bytes(data)))
        return interleave(str(index), text, blobs, self._placeholder)
