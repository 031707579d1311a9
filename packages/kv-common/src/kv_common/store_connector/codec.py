"""Value framing: the block payload followed by a 16-byte trailer (magic, crc32, payload length).

The trailer turns a truncated, resized or corrupted value into a detected load error instead of
silently wrong KV. The crc can be switched off (``checksum=False``); the length check stays.
"""

from __future__ import annotations

import struct
import zlib

_TRAILER = struct.Struct("<4sIQ")
TRAILER_SIZE = _TRAILER.size
_MAGIC_CRC = b"KVS1"
_MAGIC_NOCRC = b"KVS0"


def write_trailer(value: memoryview, payload_size: int, checksum: bool) -> None:
    """``value`` is payload_size + TRAILER_SIZE bytes; fills in the trailer."""
    payload = value[:payload_size]
    if checksum:
        _TRAILER.pack_into(value, payload_size, _MAGIC_CRC, zlib.crc32(payload), payload_size)
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
        if zlib.crc32(value[:payload_size]) != crc:
            return "checksum mismatch"
        return None
    if magic == _MAGIC_NOCRC:
        return None
    return f"bad magic {magic!r}"
