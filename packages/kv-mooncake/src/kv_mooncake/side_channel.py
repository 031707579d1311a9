"""Request/reply side channel over plain TCP: a server thread (one ``selectors`` loop for all its
connections) and clients that keep one connection per request in flight, open per peer.

The bytes are :mod:`kv_mooncake.side_channel_wire`'s: a greeting, then length-prefixed frames.
ZeroMQ carried them before; its I/O threads cost a thread wake-up on each side of every message,
~0.25 ms per round trip on a 2-core host against ~0.015 ms for a TCP socket, and a pull makes two.

Messages are msgspec Structs encoded with msgpack; a peer can only ever make us build the Struct
types we list, never arbitrary objects (no pickle). Every message has a size limit and every wait
a deadline, so a bad or silent peer costs at most one warning line per period (rate limited per
peer), not a hung engine or a flooded log. The server bounds its connections, and drops one that
stalls inside a message, never says a word, or idles for long.

Requests must be idempotent: a request whose connection broke before its reply (the peer restarted,
a kept connection had gone stale) is sent again on a new connection, as long as its deadline allows.

With a ``SideChannelAuth`` (a shared secret, ``kv_mooncake.side_channel_auth``) both ends seal every
message: the server answers only authentic, fresh, first-seen requests, and tells anyone else one
fixed line. ``trusted_only`` request types (leak queries) are answered only to authenticated peers,
or, without a secret, to loopback peers.
"""

from __future__ import annotations

import os
import select
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Union

import msgspec
from kv_common.logging_utils import get_logger

from kv_mooncake import receive_stamp
from kv_mooncake.side_channel_auth import (
    NO_SECRET_HERE,
    NOT_AUTHENTICATED,
    AuthError,
    ReplayGuard,
    SideChannelAuth,
    WarningLimiter,
    decode_sealed,
    is_loopback_peer,
)
from kv_mooncake.side_channel_wire import GREETING, FrameReader, FrameTooLarge, WireError, frame

logger = get_logger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
_POLL_S = 0.05  # how often the server thread looks at its stop flag
WARNING_PERIOD_S = 60.0  # one bad-message line per peer per period
_SHOWN_ERROR_CHARS = 300  # of an unauthenticated peer's error text, in our exceptions
_RECV_BYTES = 1 << 16
_SHORT_NAP_S = 100e-6  # the last millisecond of a wait for a reply is watched this often
MAX_CONNECTIONS = 1024  # per server: each is a file descriptor
STALLED_S = 10.0  # a connection inside a message (or with a reply unread) for this long is dropped
SERVER_IDLE_S = 300.0  # a connection silent for this long is closed by the server...
CLIENT_IDLE_S = 60.0  # ...and a kept one is dropped by the client well before that
RECONNECT_PAUSE_S = 0.1  # between tries to reach a peer that refused or broke the connection


class SideChannelError(RuntimeError):
    """The peer answered with an error, or its reply could not be decoded."""


class SideChannelTimeout(SideChannelError):
    """No reply before the deadline (also when nothing at the address would take the connection)."""


class SideChannelRefused(SideChannelError):
    """The peer refuses us for good (the side-channel secrets differ, or one side has none): a
    retry, sealed afresh, would be refused the same way."""


class ErrorReply(msgspec.Struct, tag=True, frozen=True):
    """What the server answers when it cannot (or would not) handle a request."""

    message: str


Handler = Callable[[msgspec.Struct], Union[msgspec.Struct, None]]

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


def _decoder(types: tuple[type, ...], *, with_error: bool) -> msgspec.msgpack.Decoder:
    all_types = (*types, ErrorReply) if with_error else tuple(types)
    if not all_types or not all(isinstance(t, type) and issubclass(t, msgspec.Struct) for t in all_types):
        raise TypeError(f"side channel messages must be msgspec Structs, got {types!r}")
    if len(all_types) > 1:
        untagged = [t.__name__ for t in all_types if t.__struct_config__.tag is None]  # type: ignore[attr-defined]
        if untagged:
            raise TypeError(f"side channel Structs must be declared with tag=True: {', '.join(untagged)}")
    return msgspec.msgpack.Decoder(Union[all_types] if len(all_types) > 1 else all_types[0])


def split_address(address: str) -> tuple[str, int]:
    """'host:port' (or 'tcp://host:port', '[v6]:port') -> (host, port)."""
    address = address.removeprefix("tcp://")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"side channel address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


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


class _ServerConnection:
    """One accepted peer: what it sent so far, our reply not yet sent, when it last moved."""

    def __init__(self, sock: socket.socket, peer: str, max_bytes: int, now: float):
        self.sock, self.peer = sock, peer
        self.reader = FrameReader(max_bytes)
        self.out = bytearray(GREETING)
        self.last_active = now
        self.closing = False  # close once ``out`` is sent (after a refusal that ends the connection)


class SideChannelServer:
    """Answers requests with ``handler(request)`` in a daemon thread. Binds only ``host``."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        request_types: tuple[type, ...],
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        name: str = "side-channel",
        *,
        auth: SideChannelAuth | None = None,
        trusted_only: tuple[type, ...] = (),
    ):
        self.host, self.name = host, name
        self._auth = auth
        self._replays = ReplayGuard(auth.window_s) if auth is not None else None
        self._trusted_only = trusted_only
        self._warnings = WarningLimiter(WARNING_PERIOD_S)
        self._requested_port = port
        self._handler = handler
        self._decoder = _decoder(request_types, with_error=False)
        self._encoder = msgspec.msgpack.Encoder()
        self._max_bytes = max_message_bytes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        self._connections: dict[int, _ServerConnection] = {}  # fd -> connection (the server thread's)
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(f"{self.name}: not started")
        return self._port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def connection_count(self) -> int:
        """Peers connected now (the server thread's view)."""
        return len(self._connections)

    def start(self) -> SideChannelServer:
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: already started")
        # Bind in the caller's thread so a busy port raises here; the thread then owns the socket.
        try:
            family, sockaddr = _resolve(self.host.strip("[]"), self._requested_port, passive=True)
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            raise SideChannelError(f"{self.name}: cannot bind {self.host}:{self._requested_port}: {exc}") from exc
        _opened()
        try:
            # A restarted rank takes its port back while the old connections linger in TIME_WAIT.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(128)
            sock.setblocking(False)
        except OSError as exc:
            _closed(sock)
            raise SideChannelError(f"{self.name}: cannot bind {self.host}:{self._requested_port}: {exc}") from exc
        self._port = sock.getsockname()[1]
        self._listener = sock
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("%s: server thread did not stop within %.1fs", self.name, timeout_s)

    def __enter__(self) -> SideChannelServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the server thread -------------------------------------------------------------------
    def _serve(self) -> None:
        listener = self._listener
        assert listener is not None
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ, None)
        last_sweep = time.monotonic()
        try:
            while not self._stop.is_set():
                events = selector.select(_POLL_S)
                now = time.monotonic()
                for key, mask in events:
                    if key.data is None:
                        self._accept(selector, listener, now)
                        continue
                    conn: _ServerConnection = key.data
                    if mask & selectors.EVENT_WRITE:
                        self._flush(selector, conn)
                        self._answer_buffered(selector, conn)  # what came while the reply waited
                    if mask & selectors.EVENT_READ and conn.sock.fileno() != -1:
                        self._receive(selector, conn, now)
                if now - last_sweep >= 1.0:
                    last_sweep = now
                    self._sweep(selector, now)
        except Exception:  # noqa: BLE001 - the thread must report, not vanish silently
            logger.exception("%s: server thread failed", self.name)
        finally:
            for conn in list(self._connections.values()):
                self._drop(selector, conn)
            selector.close()
            _closed(listener)

    def _accept(self, selector: selectors.BaseSelector, listener: socket.socket, now: float) -> None:
        try:
            sock, addr = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of file descriptors, or the like: the peer retries
            self._warn("?", "could not accept a connection: %s", exc)
            return
        peer = str(addr[0])
        if len(self._connections) >= MAX_CONNECTIONS:
            self._warn(peer, "refused a connection (%d connections open, the limit)", MAX_CONNECTIONS)
            sock.close()
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _ServerConnection(sock, peer, self._max_bytes, now)
        self._connections[sock.fileno()] = conn
        selector.register(sock, selectors.EVENT_READ, conn)
        self._flush(selector, conn)  # our greeting

    def _receive(self, selector: selectors.BaseSelector, conn: _ServerConnection, now: float) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the peer closed (a reachability probe, a client that is done)
            self._drop(selector, conn)
            return
        conn.last_active = now
        conn.reader.feed(data)
        self._answer_buffered(selector, conn)

    def _answer_buffered(self, selector: selectors.BaseSelector, conn: _ServerConnection) -> None:
        """Answer the whole requests received, one at a time: the next only once the reply before it
        is sent (a peer that does not read its replies stops being read)."""
        while not conn.out and not conn.closing and conn.sock.fileno() != -1:
            try:
                payload = conn.reader.next_frame()
            except FrameTooLarge as exc:
                self._warn(conn.peer, "dropped %s", exc)
                conn.out += frame(self._encoder.encode(ErrorReply("message too large")))
                conn.closing = True  # its body is on the way: the connection cannot be resynchronised
            except WireError as exc:
                self._warn(conn.peer, "closed a connection that is not a side channel of this version (%s)", exc)
                self._drop(selector, conn)
                return
            else:
                if payload is None:
                    return
                conn.out += frame(self._answer(payload, conn.peer))
            self._flush(selector, conn)

    def _flush(self, selector: selectors.BaseSelector, conn: _ServerConnection) -> None:
        try:
            sent = conn.sock.send(conn.out) if conn.out else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # the peer went away: nobody to answer
            self._drop(selector, conn)
            return
        del conn.out[:sent]
        if conn.out:
            selector.modify(conn.sock, selectors.EVENT_WRITE, conn)  # reading resumes once it is sent
        elif conn.closing:
            self._drop(selector, conn)
        elif selector.get_key(conn.sock).events != selectors.EVENT_READ:
            selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _sweep(self, selector: selectors.BaseSelector, now: float) -> None:
        """Drop connections stalled inside a message or on an unread reply, ones that never sent the
        greeting (a client sends it with its first request: silent ones would hold the connection
        slots), and long-idle ones."""
        for conn in list(self._connections.values()):
            quiet = now - conn.last_active
            if (conn.reader.buffered or conn.out) and quiet > STALLED_S:
                self._warn(conn.peer, "closed a connection stalled %.0fs inside a message", quiet)
                self._drop(selector, conn)
            elif not conn.reader.greeted and quiet > STALLED_S:
                self._warn(conn.peer, "closed a connection silent for %.0fs since it opened", quiet)
                self._drop(selector, conn)
            elif quiet > SERVER_IDLE_S:
                self._drop(selector, conn)

    def _drop(self, selector: selectors.BaseSelector, conn: _ServerConnection) -> None:
        fd = conn.sock.fileno()
        if fd == -1:
            return
        self._connections.pop(fd, None)
        try:
            selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # ---- one request -------------------------------------------------------------------------
    def _warn(self, peer: str, message: str, *args: object) -> None:
        """A bad message's warning, at most one line per peer per period (a flood costs a line)."""
        suppressed = self._warnings.allow(peer)
        if suppressed is not None:
            logger.warning("%s: peer %s: " + message + "%s", self.name, peer, *args,
                           f" ({suppressed} more from this peer suppressed)" if suppressed else "")

    def _answer(self, payload: bytes, peer: str = "?") -> bytes:
        """The encoded (and, to a sealed request, sealed) reply to one request."""
        nonce = None
        if self._auth is not None:
            assert self._replays is not None
            try:
                sealed = decode_sealed(payload)
                payload, nonce = self._auth.open_request(sealed, self._replays), sealed.nonce
            except AuthError as exc:  # the peer learns nothing of why: our log does
                self._warn(peer, "refused a message (%s; this side channel needs the secret from %s)",
                           exc, self._auth.source)
                return self._encoder.encode(ErrorReply(NOT_AUTHENTICATED))
        return self._sealed(self._reply(payload, peer, nonce), nonce)

    def _reply(self, payload: bytes, peer: str, nonce: bytes | None) -> bytes:
        """The encoded reply to one (authentic, when a secret is set) request."""
        try:
            request = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if self._auth is None and _is_sealed(payload):
                self._warn(peer, "got a sealed message but has no side-channel secret (set the same one on "
                                 "both sides, or on neither)")
                return self._encoder.encode(ErrorReply(NO_SECRET_HERE))
            self._warn(peer, "dropped an undecodable message: %s", exc)
            return self._encoder.encode(ErrorReply(f"undecodable request: {exc}"))
        if isinstance(request, self._trusted_only) and nonce is None and not is_loopback_peer(peer):
            self._warn(peer, "refused a %s (answered only to loopback or authenticated peers)", type(request).__name__)
            return self._encoder.encode(ErrorReply(
                f"{type(request).__name__} is answered only to loopback peers or peers with the side-channel secret"))
        try:
            result: Any = self._handler(request)
        except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the server
            if self._warnings.allow(f"handler:{peer}") is not None:
                logger.exception("%s: handler failed on %s", self.name, type(request).__name__)
            result = ErrorReply(f"{type(exc).__name__}: {exc}")
        if result is None:
            result = ErrorReply("no reply")
        return self._encoder.encode(result)

    def _sealed(self, encoded: bytes, nonce: bytes | None) -> bytes:
        """The reply as it goes out: sealed to the request when it was sealed, within the size limit."""
        def seal(body: bytes) -> bytes:
            return body if nonce is None or self._auth is None else self._auth.seal_reply(body, nonce)

        out = seal(encoded)
        if len(out) > self._max_bytes:
            logger.warning("%s: reply of %d bytes exceeds the limit", self.name, len(out))
            out = seal(self._encoder.encode(ErrorReply("reply too large")))
        return out


def _is_sealed(payload: bytes) -> bool:
    try:
        decode_sealed(payload)
    except AuthError:
        return False
    return True


def _encode_request(message: msgspec.Struct, max_message_bytes: int) -> bytes:
    payload = msgspec.msgpack.encode(message)
    if len(payload) > max_message_bytes:
        raise SideChannelError(f"request of {len(payload)} bytes exceeds the limit of {max_message_bytes}")
    return payload


def _decode_reply(decoder: msgspec.msgpack.Decoder, raw: bytes, address: str) -> msgspec.Struct:
    try:
        reply = decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SideChannelError(f"undecodable reply from {address}: {exc}") from exc
    if isinstance(reply, ErrorReply):
        error = SideChannelRefused if reply.message in (NOT_AUTHENTICATED, NO_SECRET_HERE) else SideChannelError
        raise error(f"{address} answered with an error: {reply.message}")
    return reply


def request(
    address: str,
    message: msgspec.Struct,
    reply_types: tuple[type, ...],
    timeout_s: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    auth: SideChannelAuth | None = None,
) -> msgspec.Struct:
    """Send one request to ``address`` ('host:port') and return its reply, within ``timeout_s``.
    Opens and closes its own connection: for repeated traffic to the same peers use
    :class:`SideChannelClient`."""
    one_shot = SideChannelClient(reply_types, max_message_bytes, max_idle_per_peer=0, auth=auth)
    return one_shot.request(address, message, timeout_s)


class _Link:
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
        self.stamped = receive_stamp.enable(sock)  # the kernel dates what arrives (Linux)
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
        data, self.received_ns = receive_stamp.receive(self.sock, _RECV_BYTES)
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


class SideChannelClient:
    """Requests to a set of peers over kept-open connections (thread-safe).

    A new TCP connection per message costs a connect and the greetings; a decode rank talks to the
    same prefill ranks several times per pull. Each idle connection is kept per peer and reused; one
    whose exchange failed or timed out is closed, so a late reply can never be read as the answer
    to a later request. At most ``max_idle_per_peer`` idle connections per peer and ``max_peers``
    peers are kept (least recently used peers are dropped first); with ``max_idle_per_peer=0``
    every connection is closed after its request (what :func:`request` does). A kept connection
    the peer closed meanwhile (it restarted) is noticed before use and replaced. With ``auth``
    every request is sealed and only a reply sealed to it is read (a peer's plain refusal is an error).
    """

    def __init__(
        self,
        reply_types: tuple[type, ...],
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_idle_per_peer: int = 4,
        max_peers: int = 64,
        *,
        auth: SideChannelAuth | None = None,
    ):
        self._decoder = _decoder(reply_types, with_error=True)
        self._auth = auth
        self._max_bytes = max_message_bytes
        self._max_idle, self._max_peers = max_idle_per_peer, max_peers
        self._idle: OrderedDict[tuple[str, int], list[_Link]] = OrderedDict()  # peer -> idle connections
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False

    def request(self, address: str, message: msgspec.Struct, timeout_s: float) -> msgspec.Struct:
        return self.start(address, message).wait(timeout_s)

    def start(self, address: str, message: msgspec.Struct) -> PendingReply:
        """Send ``message`` now and wait for its reply later (:meth:`PendingReply.wait`), so the caller
        can work meanwhile; :meth:`PendingReply.close` drops a reply nobody will wait for."""
        payload = _encode_request(message, self._max_bytes)
        pending = PendingReply(self, address, split_address(address), payload)
        self._send(pending, self._checkout(pending))
        return pending

    def _seal(self, payload: bytes) -> tuple[bytes, bytes]:
        """The request as sent (sealed afresh for each try: a nonce is never sent twice) and its nonce."""
        if self._auth is None:
            return payload, b""
        sealed, nonce = self._auth.seal_request(payload)
        if len(sealed) > self._max_bytes:
            raise SideChannelError(f"sealed request of {len(sealed)} bytes exceeds the limit of {self._max_bytes}")
        return sealed, nonce

    def _checkout(self, pending: PendingReply) -> _Link:
        with self._lock:
            if self._closed:
                raise SideChannelError("side channel client is closed")
            if self._pid != os.getpid():  # forked: the parent's connections are not ours to use
                self._idle, self._pid = OrderedDict(), os.getpid()
            idle = self._idle.get(pending.peer)
            stale: list[_Link] = []
            link = None
            now = time.monotonic()
            while idle:
                candidate = idle.pop()
                if candidate.stale(now):
                    stale.append(candidate)
                else:
                    link = candidate
                    self._idle.move_to_end(pending.peer)
                    break
        for s in stale:
            s.close()
        pending.reused = link is not None
        if link is not None:
            return link
        try:
            return _Link(pending.peer, self._max_bytes)
        except OSError as exc:  # the host does not resolve, no file descriptors left
            raise SideChannelError(f"side channel to {pending.address} failed: {exc}") from exc

    def _send(self, pending: PendingReply, link: _Link) -> None:
        pending.link = link
        try:
            pending.wire, pending.nonce = self._seal(pending.payload)
            link.received_ns = 0  # a stamp from now on dates this request's reply
            pending.sent_at, pending.offset_at_send_ns = time.monotonic(), receive_stamp.wall_offset_ns()
            link.send(pending.wire)
        except OSError as exc:  # refused or reset: wait() tries a new connection
            pending.broken = exc
        except BaseException:
            pending.drop_link()
            raise

    def _finish(self, pending: PendingReply, timeout_s: float) -> msgspec.Struct:
        """The reply to ``pending``'s request within ``timeout_s``. A connection that broke before
        the reply is replaced and the request sent again (requests are idempotent), pausing between
        tries to a peer that refuses, until the deadline."""
        deadline = time.monotonic() + timeout_s
        tries = 0
        while True:
            try:
                raw = pending.take(deadline - time.monotonic())
            except WireError as exc:
                pending.drop_link()
                what = "a reply over the size limit" if isinstance(exc, FrameTooLarge) else \
                    "bytes that are not a side channel of this version"
                raise SideChannelError(f"{pending.address} sent {what}: {exc}") from None
            except OSError as exc:
                pending.drop_link()
                tries += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SideChannelTimeout(f"no reply from {pending.address} within {timeout_s:.3g}s "
                                             f"(connection: {exc})") from None
                if tries > 1 or not pending.reused:  # a kept connection gone stale is replaced at once
                    time.sleep(min(RECONNECT_PAUSE_S, left))
                self._send(pending, self._checkout(pending))
                continue
            except BaseException:
                pending.drop_link()
                raise
            if raw is None:
                pending.drop_link()
                raise SideChannelTimeout(f"no reply from {pending.address} within {timeout_s:.3g}s")
            break
        link, pending.link = pending.link, None
        assert link is not None
        self._checkin(pending.peer, link)
        if self._auth is not None:
            raw = self._open_reply(raw, pending.nonce, pending.address)
        return _decode_reply(self._decoder, raw, pending.address)

    def _open_reply(self, raw: bytes, nonce: bytes, address: str) -> bytes:
        """The body of the reply sealed to our request; a plain reply can only be a refusal."""
        assert self._auth is not None
        try:
            sealed = decode_sealed(raw)
        except AuthError:
            try:
                refusal = msgspec.msgpack.decode(raw, type=ErrorReply)
            except (msgspec.DecodeError, msgspec.ValidationError):
                raise SideChannelRefused(f"{address} sent an unauthenticated reply (it has no side-channel "
                                       f"secret, or is not a side channel)") from None
            raise SideChannelRefused(f"{address} refused the request: "
                                   f"{refusal.message[:_SHOWN_ERROR_CHARS]}") from None
        try:
            return self._auth.open_reply(sealed, nonce)
        except AuthError as exc:
            raise SideChannelError(f"reply from {address} failed authentication: {exc}") from None

    def _checkin(self, peer: tuple[str, int], link: _Link) -> None:
        dropped: list[_Link] = []
        with self._lock:
            if self._closed or self._pid != os.getpid():
                dropped.append(link)
            else:
                idle = self._idle.setdefault(peer, [])
                self._idle.move_to_end(peer)
                (idle if len(idle) < self._max_idle else dropped).append(link)
                while len(self._idle) > self._max_peers:
                    dropped.extend(self._idle.popitem(last=False)[1])
        for s in dropped:
            s.close()

    def forget(self, address: str) -> None:
        """Drop the kept connections to ``address`` (a peer that went away)."""
        with self._lock:
            idle = self._idle.pop(split_address(address), [])
        for s in idle:
            s.close()

    def idle_socket_count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, OrderedDict()
        if self._pid == os.getpid():
            for links in idle.values():
                for s in links:
                    s.close()


class PendingReply:
    """A request sent by :meth:`SideChannelClient.start` whose reply is not read yet. Wait for it
    once, or close it (its connection is then closed: a late reply is never read as another's)."""

    def __init__(self, client: SideChannelClient, address: str, peer: tuple[str, int], payload: bytes):
        self._client = client
        self.address, self.peer, self.payload = address, peer, payload
        self.link: _Link | None = None
        self.wire, self.nonce = b"", b""  # the request as last sent, and its seal's nonce
        self.reused = False  # the connection was kept from an earlier request
        self.broken: OSError | None = None  # the connection failed before the reply
        # When the request last went out, and when its reply reached this host (receive_stamp;
        # 0.0 until read: then the kernel's stamp, or the moment it was read without one).
        self.sent_at, self.offset_at_send_ns, self.arrived_at = 0.0, 0, 0.0
        self._reply: bytes | None = None
        self._open = True

    def take(self, timeout_s: float) -> bytes | None:
        """The reply frame within ``timeout_s`` (None past it); raises what broke the connection."""
        if self.broken is not None:
            broken, self.broken = self.broken, None
            raise broken
        if self._reply is not None:
            reply, self._reply = self._reply, None
            return reply
        assert self.link is not None
        frame = self.link.reply(max(0.0, timeout_s))
        if frame is not None:
            self._note_arrival(self.link)
        return frame

    def _note_arrival(self, link: _Link) -> None:
        self.arrived_at = receive_stamp.arrival(link.received_ns, self.offset_at_send_ns,
                                                receive_stamp.wall_offset_ns(), self.sent_at, time.monotonic())

    def wait(self, timeout_s: float) -> msgspec.Struct:
        if not self._open:
            raise SideChannelError(f"the reply from {self.address} was already taken or dropped")
        self._open = False
        return self._client._finish(self, timeout_s)

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether the outcome is there to be taken by :meth:`wait` without waiting: the reply, or a
        broken connection (which ``wait`` then retries within its own timeout). ``timeout_s``: wait
        for it that long at most, woken by its arrival."""
        if not self._open:
            return False
        if self._reply is not None or self.broken is not None:
            return True
        assert self.link is not None
        try:
            self._reply = self.link.reply(max(0.0, timeout_s))
            if self._reply is not None:
                self._note_arrival(self.link)
        except OSError as exc:
            self.broken = exc
        except WireError:
            return True  # wait() reads it again and says what is wrong
        return self._reply is not None or self.broken is not None

    def drop_link(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def close(self) -> None:
        if self._open:
            self._open = False
            self.drop_link()
