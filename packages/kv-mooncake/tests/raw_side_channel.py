"""Side-channel peers written by hand for tests: bytes on a TCP socket, none of our client or
server code, so a test can send what a broken or hostile peer would."""

from __future__ import annotations

import socket

from kv_mooncake.wire.connection import split_address
from kv_mooncake.wire.framing import GREETING, FrameReader, frame

# A reply that must come: waited for generously (a vCPU stalls for a minute now and then here, and
# a server thread can starve beside pinned engines); it returns as soon as the reply is there.
REPLY_WAIT_S = 90.0


class RawConnection:
    """One connection speaking the wire by hand (greeting sent on creation)."""

    def __init__(self, sock: socket.socket, greeting: bytes = GREETING):
        self.sock = sock
        self.reader = FrameReader(1 << 30)
        if greeting:
            sock.sendall(greeting)

    @classmethod
    def to(cls, address: str, greeting: bytes = GREETING) -> RawConnection:
        return cls(socket.create_connection(split_address(address), timeout=REPLY_WAIT_S), greeting)

    def send(self, payload: bytes) -> None:
        self.sock.sendall(frame(payload))

    def read(self, timeout_s: float = REPLY_WAIT_S) -> bytes | None:
        """The next frame, or None when the peer closed the connection first."""
        self.sock.settimeout(timeout_s)
        while (payload := self.reader.next_frame()) is None:
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self.reader.feed(data)
        return payload

    def closed_by_peer(self, timeout_s: float = REPLY_WAIT_S) -> bool:
        """Whether the peer closes the connection (after whatever it still sends) within ``timeout_s``."""
        self.sock.settimeout(timeout_s)
        try:
            while self.sock.recv(1 << 16):
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raw_exchange(address: str, payload: bytes) -> bytes:
    """One request's reply, over a connection of its own."""
    with RawConnection.to(address) as conn:
        conn.send(payload)
        reply = conn.read()
    assert reply is not None, f"{address} closed the connection without a reply"
    return reply


class RawServer:
    """A listener on loopback that answers only when the test says so (or never)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"

    def accept(self, timeout_s: float = REPLY_WAIT_S) -> RawConnection:
        self.sock.settimeout(timeout_s)
        sock, _ = self.sock.accept()
        return RawConnection(sock)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
