"""One side-channel connection: socket accounting, addresses, a kept client connection and the
kernel's receive stamp on what it reads.

When a side-channel reply reached this host: the kernel's receive stamp, not when a thread read it.

A lease's Ack dates the hold (``pull.lease.lease_covers_read``): the later the decode says the Ack
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

import select
import socket
import struct
import sys
import threading
import time
from typing import Any

from kv_mooncake.wire.framing import GREETING, FrameReader, frame

_RECV_BYTES = 1 << 16


_SHORT_NAP_S = 100e-6  # the last millisecond of a wait for a reply is watched this often


CLIENT_IDLE_S = 60.0  # ...and a kept one is dropped by the client well before that


_count_lock = threading.Lock()


_open_sockets = 0


def _opened() -> None:
    global _open_sockets
    with _count_lock:
        _open_sockets += 1


def _closed(sock: socket.socket) -> None:
    global _open_sockets
    if sock.fileno() != -1:
        sock.close()
        with _count_lock:
            _open_sockets -= 1


def open_socket_count() -> int:
    """Listening sockets and client connections this module has opened and not yet closed in this
    process (for leak checks; a server's accepted connections are its own and closed with it)."""
    return _open_sockets


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (or 'tcp://host:port', '[v6]:port') -> (host, port)."""
    address = address.removeprefix("tcp://")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"side channel address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def rank_port(base_port: int, rank_offset: int) -> int:
    """The side-channel port of the worker ``rank_offset`` ranks past an instance's base port: every
    worker rank listens on its own port, base + its rank index (``rank_layout.PrefillRank.index``).
    The one formula: the worker binds it, the decode and the proxy address it, doctor checks it; the
    base itself (configured port, DP rank) is ``config.side_channel_base_port``."""
    return base_port + rank_offset


def rank_address(host: str, base_port: int, rank_offset: int) -> str:
    return f"{host}:{rank_port(base_port, rank_offset)}"


def _resolve(host: str, port: int, *, passive: bool = False) -> tuple[int, Any]:
    """(address family, socket address) for ``host``: an IPv6 literal as such, a name by its IPv4
    address when it has one (as ZeroMQ did: "localhost" is 127.0.0.1, where our servers listen).
    "*" listens on every IPv4 interface."""
    if passive and host in ("*", ""):
        host = "0.0.0.0"
    flags = socket.AI_PASSIVE if passive else 0
    if ":" not in host:
        try:
            infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM, 0, flags)
            return infos[0][0], infos[0][4]
        except socket.gaierror:
            pass  # a name with IPv6 addresses only
    infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, flags)
    return infos[0][0], infos[0][4]


class KeptConnection:
    """One client connection to a peer. Non-blocking: a send never waits (what the kernel does not
    take now goes out while we wait for the reply), and every wait is the caller's deadline."""

    def __init__(self, peer: tuple[str, int], max_bytes: int):
        family, sockaddr = _resolve(*peer)
        sock = socket.socket(family, socket.SOCK_STREAM)
        _opened()
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect_ex(sockaddr)  # in progress; a refusal shows on the first send or wait
        except OSError:
            _closed(sock)
            raise
        self.sock = sock
        self.reader = FrameReader(max_bytes)
        self.out = bytearray(GREETING)
        self.used_at = time.monotonic()
        self.stamped = enable(sock)  # the kernel dates what arrives (Linux)
        self.received_ns = 0  # its receive stamp of the bytes read last (wall clock; 0: none)

    def send(self, payload: bytes) -> None:
        self.out += frame(payload)
        self._flush()

    def _flush(self) -> None:
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        del self.out[:sent]

    def reply(self, timeout_s: float) -> bytes | None:
        """The next frame within ``timeout_s`` (None past it). Raises OSError when the connection
        broke or was refused, WireError on bytes that are not side-channel frames."""
        deadline = time.monotonic() + timeout_s
        poller = select.poll()
        fd = self.sock.fileno()
        poller.register(fd, select.POLLIN)
        while True:
            payload = self.reader.next_frame()
            if payload is not None:
                self.used_at = time.monotonic()
                return payload
            if self.out:
                self._flush()
            poller.modify(fd, select.POLLIN | (select.POLLOUT if self.out else 0))
            left = deadline - time.monotonic()
            # poll() counts whole milliseconds: below one, look, then nap briefly (a wait of a fraction
            # of a millisecond neither spins nor oversleeps to the next millisecond).
            events = poller.poll(int(left * 1000) if left >= 1e-3 else 0)
            if not events:
                if left <= 0:
                    return None
                if left < 1e-3:
                    time.sleep(min(left, _SHORT_NAP_S))
                continue
            if events[0][1] & (select.POLLIN | select.POLLERR | select.POLLHUP):
                data = self._recv()  # raises the refusal or the reset
                if not data:
                    raise ConnectionResetError("the peer closed the connection")
                self.reader.feed(data)

    def _recv(self) -> bytes:
        if not self.stamped:
            return self.sock.recv(_RECV_BYTES)
        data, self.received_ns = receive(self.sock, _RECV_BYTES)
        return data

    def stale(self, now: float) -> bool:
        """An idle connection with anything to read was closed by the peer (or is not ours)."""
        if now - self.used_at > CLIENT_IDLE_S:
            return True
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        _closed(self.sock)


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
