"""Value framing: the block payload followed by a 16-byte trailer (magic, crc32, payload length).

The trailer turns a truncated, resized or corrupted value into a detected load error instead of
silently wrong KV. The crc can be switched off (``checksum=False``); the length check stays.

The crc is zlib's crc32. When ISA-L's binding (``isal``) is installed its ``crc32`` is used: the
same values (so instances with and without it share blocks), about 10x faster (13 GB/s against
1.2 GB/s for zlib 1.2.13 on the development machines), which keeps the checksum off the critical
path of a multi-GB/s store.

A value may live in several buffers ("parts": one slice per KV layer, then the trailer), so a
backend can move it without a gather/scatter copy: ``seal_parts`` / ``check_parts``.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

try:  # pragma: no cover - depends on the environment
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover
    _crc32 = zlib.crc32

crc32 = _crc32

_TRAILER = struct.Struct("<4sIQ")
TRAILER_SIZE = _TRAILER.size
_MAGIC_CRC = b"KVS1"
_MAGIC_NOCRC = b"KVS0"


def write_trailer(value: memoryview, payload_size: int, checksum: bool) -> None:
    """``value`` is payload_size + TRAILER_SIZE bytes; fills in the trailer."""
    payload = value[:payload_size]
    if checksum:
        _TRAILER.pack_into(value, payload_size, _MAGIC_CRC, crc32(payload), payload_size)
    else:
        _TRAILER.pack_into(value, payload_size, _MAGIC_NOCRC, 0, payload_size)


def check_value(value: memoryview, payload_size: int, nbytes: int) -> str | None:
    """None when ``value`` (``nbytes`` read) is intact; otherwise why not."""
    if nbytes != payload_size + TRAILER_SIZE:
        return f"size {nbytes} != expected {payload_size + TRAILER_SIZE}"
    magic, crc, length = _TRAILER.unpack_from(value, payload_size)
    if length != payload_size:
        return f"trailer length {length} != {payload_size}"
    if magic == _MAGIC_CRC:
        if crc32(value[:payload_size]) != crc:
            return "checksum mismatch"
        return None
    if magic == _MAGIC_NOCRC:
        return None
    return f"bad magic {magic!r}"


def crc32_parts(parts: Sequence[memoryview]) -> int:
    crc = 0
    for part in parts:
        crc = crc32(part, crc)
    return crc


def seal_parts(parts: Sequence[memoryview], trailer: memoryview, checksum: bool) -> None:
    """``parts`` hold the payload in order; fills the 16-byte ``trailer`` (as ``write_trailer``)."""
    payload_size = sum(len(p) for p in parts)
    if checksum:
        _TRAILER.pack_into(trailer, 0, _MAGIC_CRC, crc32_parts(parts), payload_size)
    else:
        _TRAILER.pack_into(trailer, 0, _MAGIC_NOCRC, 0, payload_size)


def check_parts(parts: Sequence[memoryview], trailer: memoryview, nbytes: int) -> str | None:
    """``check_value`` for a value read into ``parts`` + ``trailer`` (``nbytes`` read in all)."""
    payload_size = sum(len(p) for p in parts)
    if nbytes != payload_size + TRAILER_SIZE:
        return f"size {nbytes} != expected {payload_size + TRAILER_SIZE}"
    magic, crc, length = _TRAILER.unpack_from(trailer, 0)
    if length != payload_size:
        return f"trailer length {length} != {payload_size}"
    if magic == _MAGIC_CRC:
        return None if crc32_parts(parts) == crc else "checksum mismatch"
    if magic == _MAGIC_NOCRC:
        return None
    return f"bad magic {magic!r}"
