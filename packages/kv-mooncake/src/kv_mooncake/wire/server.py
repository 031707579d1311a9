"""The side channel's server: one ``selectors`` loop answers every connection of a rank, with a
per-peer warning limiter and the loopback check for requests only trusted peers may make.

Request/reply side channel over plain TCP: a server thread (one ``selectors`` loop for all its
connections) and clients that keep one connection per request in flight, open per peer.

The bytes are :mod:`kv_mooncake.wire.framing`'s: a greeting, then length-prefixed frames.
ZeroMQ carried them before; its I/O threads cost a thread wake-up on each side of every message,
~0.25 ms per round trip on a 2-core host against ~0.015 ms for a TCP socket, and a pull makes two.

Messages are msgspec Structs encoded with msgpack; a peer can only ever make us build the Struct
types we list, never arbitrary objects (no pickle). Every message has a size limit and every wait
a deadline, so a bad or silent peer costs at most one warning line per period (rate limited per
peer), not a hung engine or a flooded log. The server bounds its connections, and drops one that
stalls inside a message, never says a word, or idles for long.

Requests must be idempotent: a request whose connection broke before its reply (the peer restarted,
a kept connection had gone stale) is sent again on a new connection, as long as its deadline allows.

With a ``SideChannelAuth`` (a shared secret, ``kv_mooncake.wire.seal``) both ends seal every
message: the server answers only authentic, fresh, first-seen requests, and tells anyone else one
fixed line. ``trusted_only`` request types (leak queries) are answered only to authenticated peers,
or, without a secret, to loopback peers.
"""

from __future__ import annotations

import ipaddress
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Union

import msgspec
from kv_common.logging_utils import get_logger

from kv_mooncake.errors import AuthError, FrameTooLarge, ProtocolMismatch, SideChannelError, WireError
from kv_mooncake.wire.connection import _RECV_BYTES, _closed, _opened, _resolve
from kv_mooncake.wire.framing import DEFAULT_MAX_MESSAGE_BYTES, GREETING, FrameReader, frame
from kv_mooncake.wire.messages import ErrorReply, MessageCodec, bare_error, mismatch_text
from kv_mooncake.wire.seal import (
    NO_SECRET_HERE,
    NOT_AUTHENTICATED,
    ReplayGuard,
    SideChannelAuth,
    _is_sealed,
    decode_sealed,
)

logger = get_logger(__name__)

_POLL_S = 0.05  # how often the server thread looks at its stop flag


WARNING_PERIOD_S = 60.0  # one bad-message line per peer per period


MAX_CONNECTIONS = 1024  # per server: each is a file descriptor


STALLED_S = 10.0  # a connection inside a message (or with a reply unread) for this long is dropped


SERVER_IDLE_S = 300.0  # a connection silent for this long is closed by the server...


Handler = Callable[[msgspec.Struct], Union[msgspec.Struct, None]]


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
        self._codec = MessageCodec(request_types, with_error=False)
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
                conn.out += frame(bare_error("message too large"))
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
                return bare_error(NOT_AUTHENTICATED)
        return self._sealed(self._reply(payload, peer, nonce), nonce)

    def _reply(self, payload: bytes, peer: str, nonce: bytes | None) -> bytes:
        """The encoded reply to one (authentic, when a secret is set) request."""
        try:
            request = self._codec.decode(payload)
        except ProtocolMismatch as exc:
            if self._auth is None and _is_sealed(payload):
                self._warn(peer, "got a sealed message but has no side-channel secret (set the same one on "
                                 "both sides, or on neither)")
                return bare_error(NO_SECRET_HERE)
            self._warn(peer, "refused a message: %s", mismatch_text(exc.peer_version))
            return bare_error(mismatch_text(exc.peer_version))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._warn(peer, "dropped an undecodable message: %s", exc)
            return bare_error(f"undecodable request: {exc}")
        if isinstance(request, self._trusted_only) and nonce is None and not is_loopback_peer(peer):
            self._warn(peer, "refused a %s (answered only to loopback or authenticated peers)", type(request).__name__)
            return self._codec.encode(ErrorReply(
                f"{type(request).__name__} is answered only to loopback peers or peers with the side-channel secret"))
        try:
            result: Any = self._handler(request)
        except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the server
            if self._warnings.allow(f"handler:{peer}") is not None:
                logger.exception("%s: handler failed on %s", self.name, type(request).__name__)
            result = ErrorReply(f"{type(exc).__name__}: {exc}")
        if result is None:
            result = ErrorReply("no reply")
        return self._codec.encode(result)

    def _sealed(self, encoded: bytes, nonce: bytes | None) -> bytes:
        """The reply as it goes out: sealed to the request when it was sealed, within the size limit."""
        def seal(body: bytes) -> bytes:
            return body if nonce is None or self._auth is None else self._auth.seal_reply(body, nonce)

        out = seal(encoded)
        if len(out) > self._max_bytes:
            logger.warning("%s: reply of %d bytes exceeds the limit", self.name, len(out))
            out = seal(self._codec.encode(ErrorReply("reply too large")))
        return out


def is_loopback_peer(address: str | None) -> bool:
    """A peer's literal IP address (as its connection reports it) is a loopback one."""
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


class WarningLimiter:
    """One warning line per peer per ``period_s``; the next line says how many were suppressed.
    At most ``max_peers`` peers are tracked (least recently seen forgotten), and at most
    ``max_lines_per_period`` lines go out per period whatever the number of peers."""

    def __init__(self, period_s: float = 60.0, *, max_peers: int = 1024, max_lines_per_period: int = 20,
                 clock: Callable[[], float] = time.monotonic):
        self.period_s, self.max_peers, self.max_lines = period_s, max_peers, max_lines_per_period
        self._clock = clock
        self._peers: OrderedDict[str, list[float | int]] = OrderedDict()  # peer -> [last line at, suppressed]
        self._period_start, self._lines_in_period = float("-inf"), 0
        self._lock = threading.Lock()

    def allow(self, peer: str) -> int | None:
        """None: stay quiet. Else log now, mentioning the returned count of suppressed lines."""
        now = self._clock()
        with self._lock:
            if now - self._period_start >= self.period_s:
                self._period_start, self._lines_in_period = now, 0
            state = self._peers.get(peer)
            if state is None:
                state = self._peers[peer] = [float("-inf"), 0]
                while len(self._peers) > self.max_peers:
                    self._peers.popitem(last=False)
            self._peers.move_to_end(peer)
            if now - state[0] < self.period_s or self._lines_in_period >= self.max_lines:
                state[1] += 1
                return None
            suppressed = int(state[1])
            state[0], state[1] = now, 0
            self._lines_in_period += 1
            return suppressed

    def tracked_peers(self) -> int:
        with self._lock:
            return len(self._peers)
