"""WebDataset shards: tar archives (`.tar`, or gzip-compressed `.tar.gz` / `.tgz`) of samples.

WebDataset's convention (`webdataset/tariterators.py`): a member's name splits into a *key*, the
path up to the first dot of its base name, and an *extension*, the rest (lower-cased):
`shard/000123.txt` and `shard/000123.meta.json` are the extensions "txt" and "meta.json" of
the sample "shard/000123". Consecutive members with the same key form one sample; samples come
in tar order and a sample's record index is its position among the tar's samples (0-based).
Members that are no regular files (directories, links), names without a dot or a base name, and
metadata members (`__...__`) belong to no sample, as in WebDataset.

The text of a sample (`text_field`, default "txt"):

* `text_field="txt"` (any extension): the member with that extension, decoded as UTF-8.
* `text_field="json.text"`: when `text_field` is an extension ending in "json", a dot, then a
  field name (`json.text`, `meta.json.body`), the member with that extension is parsed as a JSON
  object and its string field (the part after the dot, a top-level key) is the text.

With `images` (a source's `vision.Images`) a sample is an image-text record
(`formats/images.py`): its image members (extensions ending in one of `Images.fields`, "jpg",
"0.jpg", "left.png", ...) are kept too, in the natural order of their names, and interleaved
with the text (placeholders, or a JSON field's list of strings and nulls). A sample without
image members is text alone.

With `tokens_field` (an extension, e.g. "ids.npy") a sample's record is token ids instead: that
member holds a 1-D integer array in NumPy's `.npy` format (`np.save`), as WebDataset's own `.npy`
decoder reads it; negative ids are record errors.

A shard is read in consecutive byte ranges of `chunk_bytes` and parsed incrementally: tar headers
(512-byte blocks, ustar, GNU long names, pax extended headers, as Python's `tarfile` writes them)
and member data may straddle ranges; only the text members' bytes are kept. A `.tar.gz` goes
through an incremental gzip decompressor. No index is needed and none is read: the shard is read
sequentially from start to end (`document_lengths` scans it).

Errors. A sample without its text member (or whose member repeats an extension, whose text is not
UTF-8, whose JSON is bad or lacks the field) is a record error naming the sample's index and key.
A corrupt tar header, an archive cut short (inside a header or a member's data), damaged gzip data
and sparse members are shard errors: the samples before were delivered, the rest of the shard is
not read (or, with on_error="skip", the shard is reported as skipped).
"""
from __future__ import annotations

import io
import re
import zlib
from functools import lru_cache
from typing import Optional, Union

import msgspec
import numpy as np

from ..errors import ConfigError
from ..storage.base import ObjectInfo, ObjectStore
from ..tokenizer import TextTokenizer
from .base import LENGTHS_CHUNK_BYTES, BadShard, DocumentLengths, Problems, RawRecord, field_hint
from .images import ImageBlob, interleave, member_text, natural_key
from .lengths import stream_lengths
from .tar import (BLOCK, REGULAR, SUPPORTED, ZERO_BLOCK, checksum_ok, member_name, pax_fields,
                  tar_number)

_SUFFIXES = {".tar": None, ".tar.gz": "gzip", ".tgz": "gzip"}
# WebDataset's `base_plus_ext` and `tar_file_iterator`'s skip_meta.
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")
_JSON_FIELD = re.compile(r"(.*?json)\.(.+)", re.IGNORECASE | re.DOTALL)


def compression_of(uri: str) -> Union[str, None, bool]:
    """"gzip" or None (plain tar) for a WebDataset shard's name; False for other names."""
    name = uri.rsplit("/", 1)[-1].lower()
    for suffix, compression in _SUFFIXES.items():
        if name.endswith(suffix) and len(name) > len(suffix):
            return compression
    return False


@lru_cache(maxsize=None)
def _json_decoder(field: str) -> msgspec.json.Decoder:
    record = msgspec.defstruct("WebdatasetJson", [("text", str)], rename={"text": field})
    return msgspec.json.Decoder(record)


def _json_problem(error: msgspec.MsgspecError, field: str, data: bytes, member: str) -> str:
    message = str(error)
    if message.startswith("Object missing required field"):
        try:
            fields = [str(k) for k in msgspec.json.decode(data)]
        except (msgspec.MsgspecError, TypeError):   # not expected: it decoded as an object
            return f"missing field {field!r}"
        return (f"missing field {field!r}; fields present: "
                f"{', '.join(repr(f[:64]) for f in fields[:12]) or 'none'}"
                f"{field_hint('text_field', field, fields, prefix=member + '.')}")
    if message.startswith("Expected `str`, got `"):
        return f"field {field!r} is not a string (got {message.split('`')[3]})"
    if message.startswith("Expected `object`, got `"):
        return f"not a JSON object (got {message.split('`')[3]})"
    return f"invalid JSON: {message}"


class _Sample:
    __slots__ = ("key", "index", "extensions", "text", "problem", "images")

    def __init__(self, key: str, index: int):
        self.key, self.index = key, index
        self.extensions: list[str] = []
        self.text: Optional[bytes] = None
        self.problem: Optional[str] = None
        self.images: list[ImageBlob] = []


class _Gunzip:
    """Incremental decompression of one or more concatenated gzip members."""

    def __init__(self):
        self._current = None

    def feed(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._current is None:
                self._current = zlib.decompressobj(wbits=31)
            out.append(self._current.decompress(data))
            if self._current.eof:
                data, self._current = self._current.unused_data, None
            else:
                data = b""
        return b"".join(out)

    @property
    def complete(self) -> bool:
        return self._current is None


class WebdatasetStream:
    """Parses one tar shard incrementally: the partial header, the member being read (kept when
    it is the text member, else skipped), the sample being gathered."""

    def __init__(self, shard: ObjectInfo, *, problems: Problems, chunk_bytes: int,
                 compression: Optional[str], member: str, field: Optional[str],
                 tokens: bool = False, images=None):
        self.problems = problems
        self._images = images            # vision.Images: keep image members too
        self._image_member: Optional[str] = None
        step, size = chunk_bytes, shard.size
        self._ranges = [(start, min(start + step, size)) for start in range(0, size, step)]
        self._next_range = 0
        self._compression = compression
        self._gunzip = _Gunzip() if compression == "gzip" else None
        self._member, self._field, self._tokens = member, field, tokens
        self._decode_json = _json_decoder(field).decode if field is not None else None
        self._header = bytearray()       # a header block not yet complete
        self._skip_data = 0              # bytes of a member's data to pass over
        self._skip_pad = 0               # padding to the next block after member data
        self._collect = 0                # bytes of kept data still to come
        self._parts: list[bytes] = []    # kept data so far
        self._collecting: Optional[str] = None   # "text", "pax", "global", "longname"
        self._global_pax: dict[str, str] = {}
        self._pax: dict[str, str] = {}
        self._long_name: Optional[str] = None
        self._sample: Optional[_Sample] = None
        self._next_index = 0
        self._offset = 0                 # bytes of the tar stream consumed
        self._out: list[RawRecord] = []
        self._done = False               # the end-of-archive block was seen
        self._failed = False

    def ranges(self) -> list[tuple[int, int]]:
        return self._ranges

    def decode(self, chunk: bytes) -> list[RawRecord]:
        if self._failed:
            return []
        if self._next_range < len(self._ranges):
            start, end = self._ranges[self._next_range]
            self._next_range += 1
            if len(chunk) != end - start:
                return self._shard_error(f"expected {end - start} bytes at {start}, got "
                                         f"{len(chunk)} (the object changed while read?)")
        if self._gunzip is not None:
            try:
                chunk = self._gunzip.feed(chunk)
            except zlib.error as exc:
                return self._shard_error(f"corrupt gzip data: {exc}")
        try:
            self._feed(chunk)
        except BadShard as exc:
            return self._shard_error(str(exc))
        out, self._out = self._out, []
        return out

    def finish(self) -> list[RawRecord]:
        if self._failed:
            return []
        if self._gunzip is not None and not self._gunzip.complete:
            return self._shard_error("truncated gzip stream")
        if not self._done:
            if self._collect or self._skip_data:
                return self._shard_error(f"the archive ends inside a member's data (byte "
                                         f"{self._offset} of the tar): truncated")
            if self._header.strip(b"\0"):
                return self._shard_error(f"the archive ends inside a header (byte "
                                         f"{self._offset} of the tar): truncated")
            if self._collecting is not None or self._pax or self._long_name is not None:
                return self._shard_error("the archive ends after an extended header, before "
                                         "its member: truncated")
        self._close_sample()
        out, self._out = self._out, []
        return out

    # -- the tar stream

    def _feed(self, data: bytes) -> None:
        view = memoryview(data)
        pos, n, base = 0, len(data), self._offset
        while pos < n and not self._done:
            if self._collect:
                take = min(self._collect, n - pos)
                self._parts.append(bytes(view[pos:pos + take]))
                self._collect -= take
                pos += take
                if not self._collect:
                    self._kept_member_done()
                continue
            if self._skip_data or self._skip_pad:
                take = min(self._skip_data + self._skip_pad, n - pos)
                from_data = min(take, self._skip_data)
                self._skip_data -= from_data
                self._skip_pad -= take - from_data
                pos += take
                continue
            if not self._header and n - pos >= BLOCK:
                block = bytes(view[pos:pos + BLOCK])
                pos += BLOCK
            else:
                take = min(BLOCK - len(self._header), n - pos)
                self._header += view[pos:pos + take]
                pos += take
                if len(self._header) < BLOCK:
                    break
                block, self._header = bytes(self._header), bytearray()
            self._offset = base + pos
            self._on_header(block)
        self._offset = base + n

    def _on_header(self, block: bytes) -> None:
        at = self._offset - BLOCK
        if block == ZERO_BLOCK:
            self._done = True
            return
        if not checksum_ok(block):
            raise BadShard(f"corrupt tar header at byte {at} (bad checksum)")
        what = f"tar header at byte {at}"
        kind = block[156:157]
        size = tar_number(block[124:136], what)
        name = member_name(block[0:100])
        if kind in (b"x", b"X", b"g"):
            return self._start_kept("global" if kind == b"g" else "pax", size)
        if kind == b"L":
            return self._start_kept("longname", size)
        if kind == b"K":
            return self._start_skip(size)
        if kind == b"S":
            raise BadShard(f"{what}: sparse members are not supported")
        if kind == b"\0" and name.endswith("/"):
            kind = b"5"                  # an old V7 directory
        prefix = member_name(block[345:500])
        if prefix:
            name = prefix + "/" + name
        if self._long_name is not None:
            name, self._long_name = self._long_name, None
        pax, self._pax = {**self._global_pax, **self._pax}, {}
        if "path" in pax:
            name = pax["path"].rstrip("/")
        if "size" in pax:
            try:
                size = int(pax["size"])
            except ValueError:
                raise BadShard(f"{what}: bad pax size {pax['size']!r}") from None
        if size < 0:
            raise BadShard(f"{what}: negative size {size}")
        if kind in REGULAR:
            self._on_member(name, size)
        elif kind not in SUPPORTED:     # unknown types carry data, as tarfile reads them
            self._start_skip(size)

    def _start_skip(self, size: int) -> None:
        self._skip_data, self._skip_pad = size, -size % BLOCK

    def _start_kept(self, what: str, size: int) -> None:
        self._collecting, self._parts = what, []
        self._collect, self._skip_pad = size, -size % BLOCK
        if not size:
            self._kept_member_done()

    def _kept_member_done(self) -> None:
        data, self._parts = b"".join(self._parts), []
        what, self._collecting = self._collecting, None
        if what == "text":
            self._sample.text = data
        elif what == "image":
            self._sample.images.append(ImageBlob(self._image_member, data))
        elif what == "pax":
            self._pax.update(pax_fields(data))
        elif what == "global":
            self._global_pax.update(pax_fields(data))
        elif what == "longname":
            self._long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")

    def _on_member(self, name: str, size: int) -> None:
        match = _KEY_EXT.match(name)
        if match is None or _META.match(name):
            return self._start_skip(size)
        key, extension = match.group(1), match.group(2).lower()
        if self._sample is None or self._sample.key != key:
            self._close_sample()
            self._sample = _Sample(key, self._next_index)
            self._next_index += 1
        sample = self._sample
        if extension in sample.extensions and sample.problem is None:
            sample.problem = f"member {name!r} repeats the extension {extension!r}"
        sample.extensions.append(extension)
        if extension == self._member and sample.text is None:
            self._start_kept("text", size)
        elif self._images is not None and self._images.is_image(extension):
            self._image_member = name
            self._start_kept("image", size)
        else:
            self._start_skip(size)

    # -- samples

    def _close_sample(self) -> None:
        sample, self._sample = self._sample, None
        if sample is None:
            return
        problem = sample.problem
        text = None
        if problem is None and sample.text is None:
            option = "tokens_field" if self._tokens else "text_field"
            problem = (f"no member with the extension {self._member!r} (the sample has "
                       f"{', '.join(repr(e) for e in sample.extensions)})"
                       f"{field_hint(option, self._member, sample.extensions)}")
        if problem is None and self._images is not None:
            text, problem = member_text(sample.text, self._member, self._field)
            if problem is None:
                images = sorted(sample.images, key=lambda b: natural_key(b.member))
                text, problem = interleave(sample.key, text, images, self._images.placeholder)
        elif problem is None:
            text, problem = (self._ids if self._tokens else self._text)(sample.text)
        if problem is not None:
            self.problems.record(sample.index, f"sample {sample.key!r}: {problem}")
            return
        self._out.append(RawRecord(sample.index, text))

    def _ids(self, data: bytes) -> tuple[Optional[np.ndarray], Optional[str]]:
        """(token ids, None) or (None, what is wrong) for a `.npy` member's bytes."""
        what = f"member {self._member!r}"
        try:
            ids = np.load(io.BytesIO(data), allow_pickle=False)
        except Exception as exc:   # numpy raises ValueError, EOFError, OSError, ...
            return None, f"{what} is not a .npy array: {exc}"
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            return None, f"{what} must hold a 1-D integer array, found {ids.dtype} {ids.shape}"
        if ids.dtype.kind == "i" and ids.size and ids.min() < 0:
            return None, f"{what}: negative token id {int(ids.min())}"
        return ids.astype(ids.dtype.newbyteorder("="), copy=False), None

    def _text(self, data: bytes) -> tuple[Optional[str], Optional[str]]:
        """(text, None) or (None, what is wrong) for a text member's bytes."""
        if self._decode_json is None:
            try:
                return data.decode("utf-8"), None
            except UnicodeDecodeError:
                return None, f"member {self._member!r} is not valid UTF-8"
        try:
            return self._decode_json(data).text, None
        except msgspec.MsgspecError as exc:
            if "UTF-8" in str(exc):
                return None, f"member {self._member!r} is not valid UTF-8"
            problem = _json_problem(exc, self._field, data, self._member)
            return None, f"member {self._member!r}: {problem}"

    def _shard_error(self, reason: str) -> list[RawRecord]:
        """Records already complete go out; the rest of the shard is not read."""
        out, self._out = self._out, []
        self._failed = True
        self._sample = None
        self.problems.shard(reason)
        return out


def text_source(text_field: str) -> tuple[str, Optional[str]]:
    """(member extension, JSON field or None) that `text_field` names (see the module)."""
    match = _JSON_FIELD.fullmatch(text_field)
    if match is not None:
        return match.group(1).lower(), match.group(2)
    return text_field.lower(), None


class WebdatasetFormat:
    """WebDataset tar shards: `*.tar`, `*.tar.gz`, `*.tgz` (names matched case-insensitively).
    One record per sample; `text_field` names the text member (default "txt") or a JSON
    member's field ("json.text"); `tokens_field` a `.npy` member of token ids instead."""

    name = "webdataset"

    def __init__(self, text_field: str | None = None, tokens_field: str | None = None,
                 named: bool = False, images=None):
        if images is not None and tokens_field is not None:
            raise ConfigError.at("images", "an image source reads text (text_field), not "
                                           "token ids (tokens_field)")
        self.images = images
        text_field = "txt" if text_field is None else text_field
        if not text_field:
            raise ConfigError.at("text_field", "must be a non-empty string")
        self.text_field = text_field
        self.tokens = tokens_field is not None
        if self.tokens:
            if not tokens_field:
                raise ConfigError.at("tokens_field", "must be a non-empty string")
            self.member, self.field = tokens_field.lower(), None
        else:
            self.member, self.field = text_source(text_field)
        if self.field is not None:
            _json_decoder(self.field)

    def matches(self, uri: str) -> bool:
        return compression_of(uri) is not False

    async def open(self, store: ObjectStore, shard: ObjectInfo, *, problems: Problems,
                   chunk_bytes: int) -> WebdatasetStream:
        if chunk_bytes <= 0:
            raise ConfigError.at("chunk_bytes", f"must be positive, got {chunk_bytes}")
        compression = compression_of(shard.uri)
        return WebdatasetStream(shard, problems=problems, chunk_bytes=chunk_bytes,
                                compression=compression if compression is not False else None,
                                member=self.member, field=self.field, tokens=self.tokens,
                                images=self.images)

    async def document_lengths(self, store: ObjectStore, shard: ObjectInfo, *,
                               problems: Problems, tokenizer: TextTokenizer | None = None,
                               limit: int | None = None,
                               chunk_bytes: int = LENGTHS_CHUNK_BYTES) -> DocumentLengths:
        """Each sample's length in tokens (`ShardFormat.document_lengths`): the shard is read
        and each text measured with `tokenizer` (UTF-8 bytes without one), token ids counted."""
        return await stream_lengths(self, store, shard, problems=problems, tokenizer=tokenizer,
                                    limit=limit, chunk_bytes=chunk_bytes)
