"""The side channel's bytes on a TCP connection: each side opens with :data:`GREETING`, then sends
frames, a 4-byte big-endian length and that many payload bytes (one message each).

Pure parsing, no sockets: :class:`FrameReader` takes bytes as they arrive and hands out whole
frames, refusing a greeting that is not ours (another protocol, or another version of this one)
and a frame declared larger than the limit before any of its body is buffered.
"""

from __future__ import annotations

import struct

from kv_mooncake.errors import FrameTooLarge, NotASideChannel

GREETING = b"KVSC\x01"  # "KV side channel", wire version 1 (ZeroMQ before it)
_LENGTH = struct.Struct(">I")


def frame(payload: bytes) -> bytes:
    """One message as it goes on the wire."""
    return _LENGTH.pack(len(payload)) + payload


class FrameReader:
    """One direction of a connection: the greeting, then frames of at most ``max_bytes`` each."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._buffer = bytearray()
        self._greeted = False

    def feed(self, data: bytes) -> None:
        self._buffer += data

    @property
    def greeted(self) -> bool:
        """Whether the whole greeting came (the peer speaks this protocol)."""
        return self._greeted

    @property
    def buffered(self) -> int:
        """Bytes received and not yet handed out (a part of a frame, when non-zero)."""
        return len(self._buffer)

    def next_frame(self) -> bytes | None:
        """The next whole frame's payload, or None until more bytes arrive."""
        buf = self._buffer
        if not self._greeted:
            seen = bytes(buf[: len(GREETING)])
            if not GREETING.startswith(seen):  # refused on the first wrong byte, not after a timeout
                raise NotASideChannel(f"the connection opened with {seen!r}, not {GREETING!r}")
            if len(seen) < len(GREETING):
                return None
            del buf[: len(GREETING)]
            self._greeted = True
        if len(buf) < _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(buf)
        if length > self.max_bytes:
            raise FrameTooLarge(length, self.max_bytes)
        end = _LENGTH.size + length
        if len(buf) < end:
            return None
        payload = bytes(buf[_LENGTH.size : end])
        del buf[:end]
        return payload


DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
