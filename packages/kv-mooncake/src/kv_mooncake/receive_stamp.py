"""When a side-channel reply reached this host: the kernel's receive stamp, not when a thread read it.

A lease's Ack dates the hold (``early_lease.lease_covers_read``): the later the decode says the Ack
came, the younger the hold looks, and a read that looks begun before its hold is read again. A
pull thread gets to the Ack late under load (a status call, the GIL: measured 1-7 ms with 16 pulls
in flight from two prefills on 2 cores), so on Linux every client socket asks the kernel to stamp
what it receives (``SO_TIMESTAMPNS``, the wall clock), and the stamp is turned into
``time.monotonic`` with the clocks' offset.

Fail closed: the arrival is never put before the request went out, never after the thread saw the
reply, and not used at all when the wall clock was stepped between the two (its offset to the
monotonic clock moved): then the reply counts as arrived when the thread saw it, as without stamps.
"""

from __future__ import annotations

import socket
import struct
import sys
import time
from typing import Any

# Python names no constant for it; 35 is SO_TIMESTAMPNS on the Linux architectures vLLM runs on
# (x86-64, Arm: asm-generic). Elsewhere no stamps: a reply arrives when a thread reads it.
SO_TIMESTAMPNS: int | None = getattr(socket, "SO_TIMESTAMPNS", 35) if sys.platform == "linux" else None
_TIMESPEC = struct.Struct("qq")  # tv_sec, tv_nsec (64-bit)
_ANCILLARY_BYTES = socket.CMSG_SPACE(_TIMESPEC.size) if hasattr(socket, "CMSG_SPACE") else 0
# The wall clock's offset to the monotonic one may move this much between a request and its reply
# (slewing, the two clock reads) before it counts as stepped.
MAX_OFFSET_DRIFT_NS = 20_000
# Bracketed clock reads per offset (wall_offset_ns), and a bracket tight enough to stop at.
OFFSET_READS = 4
TIGHT_READ_NS = 2_000
# Added to a stamp turned into monotonic time: a slewing wall clock can be off by a few us per ms.
MARGIN_S = 50e-6


def enable(sock: socket.socket) -> bool:
    """Ask the kernel to stamp what ``sock`` receives; False where it cannot."""
    if SO_TIMESTAMPNS is None or not _ANCILLARY_BYTES:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def receive(sock: socket.socket, bufsize: int) -> tuple[bytes, int]:
    """``sock.recv(bufsize)`` of a socket :func:`enable` stamps, and the kernel's receive time of
    those bytes (wall clock, ns; 0 when none came with them)."""
    data, ancillary, _flags, _address = sock.recvmsg(bufsize, _ANCILLARY_BYTES)
    return data, stamp_ns(ancillary)


def stamp_ns(ancillary: list[tuple[int, int, bytes]] | Any) -> int:
    """The receive stamp among ``recvmsg``'s ancillary data (0: none)."""
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(raw) >= _TIMESPEC.size:
            seconds, nanoseconds = _TIMESPEC.unpack_from(raw)
            return seconds * 1_000_000_000 + nanoseconds
    return 0


def wall_offset_ns() -> int:
    """The wall clock minus the monotonic clock, now.

    The monotonic clock is read after the wall clock, so a pause between the two makes the offset
    smaller and a stamp turned with it lands later: the safe side. But a thread preempted there (a
    loaded machine) makes it smaller by the whole pause, past MAX_OFFSET_DRIFT_NS, and the stamp is
    thrown away: so the wall clock is read between two monotonic reads, a few times, and the
    tightest pair, the one read without a pause, gives the offset.
    """
    best_width, best_offset = -1, 0
    for _ in range(OFFSET_READS):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if best_width < 0 or after - before < best_width:
            best_width, best_offset = after - before, wall - after
        if best_width <= TIGHT_READ_NS:
            break
    return best_offset


def arrival(received_ns: int, offset_at_send_ns: int, offset_now_ns: int, sent_at: float,
            noticed_at: float) -> float:
    """When a reply stamped ``received_ns`` (wall clock) arrived, in ``time.monotonic`` seconds:
    between ``sent_at`` (its request went out) and ``noticed_at`` (a thread saw it); ``noticed_at``
    when there is no stamp, or the wall clock moved against the monotonic one since the request."""
    if not received_ns or abs(offset_now_ns - offset_at_send_ns) > MAX_OFFSET_DRIFT_NS:
        return noticed_at
    stamped = (received_ns - offset_now_ns) / 1e9 + MARGIN_S
    return min(noticed_at, max(sent_at, stamped))
