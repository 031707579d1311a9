"""Request/reply side channel over ZeroMQ: a ROUTER server thread and short-lived REQ clients.

Messages are msgspec Structs encoded with msgpack; a peer can only ever make us build the Struct
types we list, never arbitrary objects (no pickle). Every socket has a size limit and a deadline
so a bad or silent peer costs one warning, not a hung engine.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Union

import msgspec
import zmq

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
_POLL_MS = 50  # how often the server thread looks at its stop flag


class SideChannelError(RuntimeError):
    """The peer answered with an error, or its reply could not be decoded."""


class SideChannelTimeout(SideChannelError):
    """No reply before the deadline."""


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
        untagged = [t.__name__ for t in all_types if t.__struct_config__.tag is None]
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
    ):
        self.host, self.name = host, name
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
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                reply = self._answer(frames)
                if reply is not None:
                    try:
                        sock.send_multipart(reply, zmq.NOBLOCK)
                    except zmq.ZMQError as exc:  # peer gone or its queue full: nothing to do
                        logger.debug("%s: reply dropped: %s", self.name, exc)
        except Exception:  # noqa: BLE001 - the thread must report, not vanish silently
            logger.exception("%s: server thread failed", self.name)
        finally:
            _close_socket(sock)

    def _answer(self, frames: list[bytes]) -> list[bytes] | None:
        """Route envelope + encoded reply for one request, or None to drop it."""
        # ROUTER gives [peer, payload] from a DEALER and [peer, b"", payload] from a REQ.
        if len(frames) < 2 or len(frames) > 3 or (len(frames) == 3 and frames[1] != b""):
            logger.warning("%s: dropped a message with %d frames", self.name, len(frames))
            return None
        envelope, payload = frames[:-1], frames[-1]
        if len(payload) > self._max_bytes:
            logger.warning(
                "%s: dropped a %d-byte message (limit %d)", self.name, len(payload), self._max_bytes
            )
            return envelope + [self._encoder.encode(ErrorReply("message too large"))]
        try:
            request = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("%s: dropped an undecodable message: %s", self.name, exc)
            return envelope + [self._encoder.encode(ErrorReply(f"undecodable request: {exc}"))]
        try:
            result: Any = self._handler(request)
        except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the server
            logger.exception("%s: handler failed on %s", self.name, type(request).__name__)
            result = ErrorReply(f"{type(exc).__name__}: {exc}")
        if result is None:
            result = ErrorReply("no reply")
        encoded = self._encoder.encode(result)
        if len(encoded) > self._max_bytes:
            logger.warning("%s: reply of %d bytes exceeds the limit", self.name, len(encoded))
            encoded = self._encoder.encode(ErrorReply("reply too large"))
        return envelope + [encoded]


def request(
    address: str,
    message: msgspec.Struct,
    reply_types: tuple[type, ...],
    timeout_s: float,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> msgspec.Struct:
    """Send one request to ``address`` ('host:port') and return its reply, within ``timeout_s``."""
    decoder = _decoder(reply_types, with_error=True)
    payload = msgspec.msgpack.encode(message)
    if len(payload) > max_message_bytes:
        raise SideChannelError(f"request of {len(payload)} bytes exceeds the limit of {max_message_bytes}")
    endpoint = _endpoint(address)
    deadline = time.monotonic() + timeout_s
    sock = _new_socket(zmq.REQ, max_message_bytes)
    try:
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        sock.send(payload, zmq.NOBLOCK)  # REQ queues until connected; the deadline covers it
        remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not sock.poll(remaining_ms, zmq.POLLIN):
            raise SideChannelTimeout(f"no reply from {address} within {timeout_s:.3g}s")
        raw = sock.recv(zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        raise SideChannelError(f"side channel to {address} failed: {exc}") from exc
    finally:
        _close_socket(sock)
    try:
        reply = decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SideChannelError(f"undecodable reply from {address}: {exc}") from exc
    if isinstance(reply, ErrorReply):
        raise SideChannelError(f"{address} answered with an error: {reply.message}")
    return reply
