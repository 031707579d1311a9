"""Request/reply side channel over ZeroMQ: a ROUTER server thread and REQ clients (one-shot, or kept
open per peer by :class:`SideChannelClient`).

Messages are msgspec Structs encoded with msgpack; a peer can only ever make us build the Struct
types we list, never arbitrary objects (no pickle). Every socket has a size limit and a deadline
so a bad or silent peer costs at most one warning line per period (rate limited per peer), not a
hung engine or a flooded log.

With a ``SideChannelAuth`` (a shared secret, ``kv_mooncake.side_channel_auth``) both ends seal every
message: the server answers only authentic, fresh, first-seen requests, and tells anyone else one
fixed line. ``trusted_only`` request types (leak queries) are answered only to authenticated peers,
or, without a secret, to loopback peers.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Union

import msgspec
import zmq
from kv_common.logging_utils import get_logger

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

logger = get_logger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
_POLL_MS = 50  # how often the server thread looks at its stop flag
WARNING_PERIOD_S = 60.0  # one bad-message line per peer per period
_SHOWN_ERROR_CHARS = 300  # of an unauthenticated peer's error text, in our exceptions


class SideChannelError(RuntimeError):
    """The peer answered with an error, or its reply could not be decoded."""


class SideChannelTimeout(SideChannelError):
    """No reply before the deadline."""


class SideChannelRefused(SideChannelError):
    """The peer refuses us for good (the side-channel secrets differ, or one side has none): a
    retry, sealed afresh, would be refused the same way."""


class ErrorReply(msgspec.Struct, tag=True, frozen=True):
    """What the server answers when it cannot (or would not) handle a request."""

    message: str


Handler = Callable[[msgspec.Struct], Union[msgspec.Struct, None]]

# One context per process: a context inherited through fork() must not be used by the child.
_context: zmq.Context | None = None
_context_pid = -1
_context_lock = threading.Lock()
_open_sockets = 0


def _get_context() -> zmq.Context:
    global _context, _context_pid
    with _context_lock:
        if _context is None or _context_pid != os.getpid():
            _context, _context_pid = zmq.Context(), os.getpid()
        return _context


def _new_socket(kind: int, max_message_bytes: int) -> zmq.Socket:
    global _open_sockets
    sock = _get_context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # close() must never block on unsent messages
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # zmq drops the peer on bigger frames
    with _context_lock:
        _open_sockets += 1
    return sock


def _close_socket(sock: zmq.Socket) -> None:
    global _open_sockets
    if not sock.closed:
        sock.close(linger=0)
        with _context_lock:
            _open_sockets -= 1


def open_socket_count() -> int:
    """Sockets this module has opened and not yet closed in this process (for leak checks)."""
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


def _endpoint(address: str) -> str:
    """'host:port' (or 'tcp://host:port', '[v6]:port') -> zmq endpoint."""
    address = address.removeprefix("tcp://")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"side channel address must be 'host:port', got {address!r}")
    return f"tcp://{host}:{port}"


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
        self._sock: zmq.Socket | None = None
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

    def start(self) -> SideChannelServer:
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: already started")
        # Bind in the caller's thread so a busy port raises here; the thread then owns the socket.
        sock = _new_socket(zmq.ROUTER, self._max_bytes)
        try:
            if ":" in self.host:
                sock.setsockopt(zmq.IPV6, 1)
            if self._requested_port == 0:
                self._port = sock.bind_to_random_port(f"tcp://{self.host}")
            else:
                sock.bind(f"tcp://{self.host}:{self._requested_port}")
                self._port = self._requested_port
        except zmq.ZMQError as exc:
            _close_socket(sock)
            raise SideChannelError(
                f"{self.name}: cannot bind {self.host}:{self._requested_port}: {exc}"
            ) from exc
        self._sock = sock
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

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                try:
                    received = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                reply = self._answer([f.bytes for f in received], _peer_address(received[-1]))
                if reply is not None:
                    try:
                        sock.send_multipart(reply, zmq.NOBLOCK)
                    except zmq.ZMQError as exc:  # peer gone or its queue full: nothing to do
                        logger.debug("%s: reply dropped: %s", self.name, exc)
        except Exception:  # noqa: BLE001 - the thread must report, not vanish silently
            logger.exception("%s: server thread failed", self.name)
        finally:
            _close_socket(sock)

    def _warn(self, peer: str, message: str, *args: object) -> None:
        """A bad message's warning, at most one line per peer per period (a flood costs a line)."""
        suppressed = self._warnings.allow(peer)
        if suppressed is not None:
            logger.warning("%s: peer %s: " + message + "%s", self.name, peer, *args,
                           f" ({suppressed} more from this peer suppressed)" if suppressed else "")

    def _answer(self, frames: list[bytes], peer: str = "?") -> list[bytes] | None:
        """Route envelope + encoded reply for one request, or None to drop it."""
        # ROUTER gives [peer, payload] from a DEALER and [peer, b"", payload] from a REQ.
        if len(frames) < 2 or len(frames) > 3 or (len(frames) == 3 and frames[1] != b""):
            self._warn(peer, "dropped a message with %d frames", len(frames))
            return None
        envelope, payload = frames[:-1], frames[-1]
        if len(payload) > self._max_bytes:
            self._warn(peer, "dropped a %d-byte message (limit %d)", len(payload), self._max_bytes)
            return envelope + [self._encoder.encode(ErrorReply("message too large"))]
        nonce = None
        if self._auth is not None:
            assert self._replays is not None
            try:
                sealed = decode_sealed(payload)
                payload, nonce = self._auth.open_request(sealed, self._replays), sealed.nonce
            except AuthError as exc:  # the peer learns nothing of why: our log does
                self._warn(peer, "refused a message (%s; this side channel needs the secret from %s)",
                           exc, self._auth.source)
                return envelope + [self._encoder.encode(ErrorReply(NOT_AUTHENTICATED))]
        return envelope + [self._sealed(self._reply(payload, peer, nonce), nonce)]

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


def _peer_address(frame: zmq.Frame) -> str:
    """The sending peer's IP address as ZMQ saw the connection ('?' if it cannot tell)."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError):
        return "?"


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


def _connect(endpoint: str, max_message_bytes: int) -> zmq.Socket:
    sock = _new_socket(zmq.REQ, max_message_bytes)
    try:
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
    except zmq.ZMQError:
        _close_socket(sock)
        raise
    return sock


@contextlib.contextmanager
def _closed_on_error(sock: zmq.Socket, address: str) -> Iterator[None]:
    """A REQ socket whose exchange failed is mid-exchange: closed, never reused."""
    try:
        yield
    except zmq.ZMQError as exc:
        _close_socket(sock)
        raise SideChannelError(f"side channel to {address} failed: {exc}") from exc
    except BaseException:
        _close_socket(sock)
        raise


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


class SideChannelClient:
    """Requests to a set of peers over kept-open connections (thread-safe).

    A new TCP connection per message costs milliseconds (connect, ZMTP handshake); a decode rank
    talks to the same prefill ranks several times per pull. Each idle REQ socket is kept per peer
    and reused; a socket whose exchange failed or timed out is closed (a REQ socket is then stuck
    mid-exchange), so a late reply can never be read as the answer to a later request. At most
    ``max_idle_per_peer`` idle sockets per peer and ``max_peers`` peers are kept (least recently
    used peers are dropped first); with ``max_idle_per_peer=0`` every connection is closed after its
    request (what :func:`request` does). With ``auth`` every request is sealed and only a reply
    sealed to it is read (a peer's plain refusal is an error).
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
        self._idle: OrderedDict[str, list[zmq.Socket]] = OrderedDict()  # endpoint -> idle sockets
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False

    def request(self, address: str, message: msgspec.Struct, timeout_s: float) -> msgspec.Struct:
        return self.start(address, message).wait(timeout_s)

    def start(self, address: str, message: msgspec.Struct) -> PendingReply:
        """Send ``message`` now and wait for its reply later (:meth:`PendingReply.wait`), so the caller
        can work meanwhile; :meth:`PendingReply.close` drops a reply nobody will wait for."""
        payload = _encode_request(message, self._max_bytes)
        nonce = b""
        if self._auth is not None:
            payload, nonce = self._auth.seal_request(payload)
            if len(payload) > self._max_bytes:
                raise SideChannelError(f"sealed request of {len(payload)} bytes exceeds the limit of {self._max_bytes}")
        endpoint = _endpoint(address)
        try:
            sock = self._checkout(endpoint)
        except zmq.ZMQError as exc:
            raise SideChannelError(f"side channel to {address} failed: {exc}") from exc
        with _closed_on_error(sock, address):
            sock.send(payload, zmq.NOBLOCK)  # REQ queues until connected; wait()'s timeout covers it
        return PendingReply(self, address, endpoint, sock, nonce)

    def _finish(self, pending: PendingReply, timeout_s: float) -> msgspec.Struct:
        """The reply to ``pending``'s request within ``timeout_s``; its socket is kept only after a
        whole exchange (a REQ socket mid-exchange is closed, never reused)."""
        sock, address = pending.sock, pending.address
        with _closed_on_error(sock, address):
            if not sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
                raise SideChannelTimeout(f"no reply from {address} within {timeout_s:.3g}s")
            raw = sock.recv(zmq.NOBLOCK)
        self._checkin(pending.endpoint, sock)
        if self._auth is not None:
            raw = self._open_reply(raw, pending.nonce, address)
        return _decode_reply(self._decoder, raw, address)

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

    def _checkout(self, endpoint: str) -> zmq.Socket:
        with self._lock:
            if self._closed:
                raise SideChannelError("side channel client is closed")
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours to use
                self._idle, self._pid = OrderedDict(), os.getpid()
            idle = self._idle.get(endpoint)
            if idle:
                self._idle.move_to_end(endpoint)
                return idle.pop()
        return _connect(endpoint, self._max_bytes)

    def _checkin(self, endpoint: str, sock: zmq.Socket) -> None:
        dropped: list[zmq.Socket] = []
        with self._lock:
            if self._closed or self._pid != os.getpid():
                dropped.append(sock)
            else:
                idle = self._idle.setdefault(endpoint, [])
                self._idle.move_to_end(endpoint)
                (idle if len(idle) < self._max_idle else dropped).append(sock)
                while len(self._idle) > self._max_peers:
                    dropped.extend(self._idle.popitem(last=False)[1])
        for s in dropped:
            _close_socket(s)

    def forget(self, address: str) -> None:
        """Drop the kept connections to ``address`` (a peer that went away)."""
        with self._lock:
            idle = self._idle.pop(_endpoint(address), [])
        for s in idle:
            _close_socket(s)

    def idle_socket_count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, OrderedDict()
        if self._pid == os.getpid():
            for socks in idle.values():
                for s in socks:
                    _close_socket(s)


class PendingReply:
    """A request sent by :meth:`SideChannelClient.start` whose reply is not read yet. Wait for it
    once, or close it (its socket is then closed: a late reply is never read as another's)."""

    def __init__(self, client: SideChannelClient, address: str, endpoint: str, sock: zmq.Socket, nonce: bytes):
        self._client = client
        self.address, self.endpoint, self.sock, self.nonce = address, endpoint, sock, nonce
        self._open = True

    def wait(self, timeout_s: float) -> msgspec.Struct:
        if not self._open:
            raise SideChannelError(f"the reply from {self.address} was already taken or dropped")
        self._open = False
        return self._client._finish(self, timeout_s)

    def ready(self) -> bool:
        """Whether the reply is there to be taken (without waiting)."""
        return self._open and bool(self.sock.poll(0, zmq.POLLIN))

    def close(self) -> None:
        if self._open:
            self._open = False
            _close_socket(self.sock)
