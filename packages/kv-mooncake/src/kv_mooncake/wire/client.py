"""The side channel's client: one request, or a client that keeps a connection per peer and
request in flight (:mod:`kv_mooncake.wire.connection`), sealing each message when it has a secret.

Requests must be idempotent: a request whose connection broke before its reply (the peer restarted,
a kept connection had gone stale) is sent again on a new connection, as long as its deadline allows.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict

import msgspec
from kv_common.logging_utils import get_logger

from kv_mooncake.errors import (
    AuthError,
    FrameTooLarge,
    ProtocolMismatch,
    SideChannelError,
    SideChannelRefused,
    SideChannelTimeout,
    WireError,
)
from kv_mooncake.wire.connection import KeptConnection, arrival, split_address, wall_offset_ns
from kv_mooncake.wire.framing import DEFAULT_MAX_MESSAGE_BYTES
from kv_mooncake.wire.messages import PROTOCOL_MISMATCH, ErrorReply, MessageCodec, read_bare_error
from kv_mooncake.wire.seal import (
    NO_SECRET_HERE,
    NOT_AUTHENTICATED,
    SideChannelAuth,
    decode_sealed,
)

logger = get_logger(__name__)

_SHOWN_ERROR_CHARS = 300  # of an unauthenticated peer's error text, in our exceptions
RECONNECT_PAUSE_S = 0.1  # between tries to reach a peer that refused or broke the connection


def _encode_request(message: msgspec.Struct, max_message_bytes: int) -> bytes:
    payload = MessageCodec.encode(message)
    if len(payload) > max_message_bytes:
        raise SideChannelError(f"request of {len(payload)} bytes exceeds the limit of {max_message_bytes}")
    return payload


def _decode_reply(codec: MessageCodec, raw: bytes, address: str) -> msgspec.Struct:
    try:
        reply = codec.decode(raw)
    except ProtocolMismatch as exc:
        # Outside the envelope: a refusal of a message the server could not read (any version reads
        # those), or a reply of a release from before the envelope.
        refusal = read_bare_error(raw)
        if refusal is None:
            raise SideChannelRefused(f"{address} answered in another side-channel protocol ({exc})") from None
        reply = refusal
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SideChannelError(f"undecodable reply from {address}: {exc}") from exc
    if isinstance(reply, ErrorReply):
        refused = reply.message in (NOT_AUTHENTICATED, NO_SECRET_HERE) or PROTOCOL_MISMATCH in reply.message
        error = SideChannelRefused if refused else SideChannelError
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
        self._codec = MessageCodec(reply_types, with_error=True)
        self._auth = auth
        self._max_bytes = max_message_bytes
        self._max_idle, self._max_peers = max_idle_per_peer, max_peers
        self._idle: OrderedDict[tuple[str, int], list[KeptConnection]] = OrderedDict()  # peer -> idle connections
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

    def _checkout(self, pending: PendingReply) -> KeptConnection:
        with self._lock:
            if self._closed:
                raise SideChannelError("side channel client is closed")
            if self._pid != os.getpid():  # forked: the parent's connections are not ours to use
                self._idle, self._pid = OrderedDict(), os.getpid()
            idle = self._idle.get(pending.peer)
            stale: list[KeptConnection] = []
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
            return KeptConnection(pending.peer, self._max_bytes)
        except OSError as exc:  # the host does not resolve, no file descriptors left
            raise SideChannelError(f"side channel to {pending.address} failed: {exc}") from exc

    def _send(self, pending: PendingReply, link: KeptConnection) -> None:
        pending.link = link
        try:
            pending.wire, pending.nonce = self._seal(pending.payload)
            link.received_ns = 0  # a stamp from now on dates this request's reply
            pending.sent_at, pending.offset_at_send_ns = time.monotonic(), wall_offset_ns()
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
        return _decode_reply(self._codec, raw, pending.address)

    def _open_reply(self, raw: bytes, nonce: bytes, address: str) -> bytes:
        """The body of the reply sealed to our request; a plain reply can only be a refusal."""
        assert self._auth is not None
        try:
            sealed = decode_sealed(raw)
        except AuthError:
            refusal = read_bare_error(raw)
            if refusal is None:
                raise SideChannelRefused(f"{address} sent an unauthenticated reply (it has no side-channel "
                                       f"secret, or is not a side channel)") from None
            raise SideChannelRefused(f"{address} refused the request: "
                                   f"{refusal.message[:_SHOWN_ERROR_CHARS]}") from None
        try:
            return self._auth.open_reply(sealed, nonce)
        except AuthError as exc:
            raise SideChannelError(f"reply from {address} failed authentication: {exc}") from None

    def _checkin(self, peer: tuple[str, int], link: KeptConnection) -> None:
        dropped: list[KeptConnection] = []
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
        self.link: KeptConnection | None = None
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

    def _note_arrival(self, link: KeptConnection) -> None:
        self.arrived_at = arrival(link.received_ns, self.offset_at_send_ns,
                                                wall_offset_ns(), self.sent_at, time.monotonic())

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
