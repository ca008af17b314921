"""Tar headers, as the WebDataset reader parses them (POSIX ustar, GNU and pax; the layout
of Python's `tarfile`): 512-byte blocks, numeric fields in octal or GNU base-256, checksums,
pax extended records.
"""
from __future__ import annotations

import re
import struct

from .base import BadShard

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
# tarfile's member types.
REGULAR = (b"0", b"\0", b"7")
SUPPORTED = REGULAR + (b"1", b"2", b"3", b"4", b"5", b"6", b"L", b"K", b"S")
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")


def tar_number(field: bytes, what: str) -> int:
    """A tar header's numeric field: octal digits, or GNU's base-256 (high bit set)."""
    if field[0] in (0o200, 0o377):
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0o377 else n
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise BadShard(f"{what}: bad number field {field!r}") from None


def member_name(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def checksum_ok(block: bytes) -> bool:
    """The stored checksum is the unsigned (or, for some old tars, signed) sum of the header
    with its checksum field counted as spaces."""
    try:
        stored = tar_number(block[148:156], "checksum")
    except BadShard:
        return False
    unsigned = 256 + sum(struct.unpack_from("148B8x356B", block))
    signed = 256 + sum(struct.unpack_from("148b8x356b", block))
    return stored in (unsigned, signed)


def pax_fields(data: bytes) -> dict[str, str]:
    fields, pos = {}, 0
    while match := _PAX_RECORD.match(data, pos):
        length = int(match.group(1))
        if length <= 0:
            break
        value = data[match.end(2) + 1:match.start(1) + length - 1]
        fields[match.group(2).decode("utf-8", "surrogateescape")] = \
            value.decode("utf-8", "surrogateescape")
        pos += length
    return fields
