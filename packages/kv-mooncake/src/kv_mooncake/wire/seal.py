"""An optional shared secret for the side channel: every message in both directions is sealed.

Without it anyone who reaches a side-channel port gets the TransferEngine address and the KV base
addresses (the handshake), and can free any request it can name (FreeNow, PullDone). With the secret
(env ``KV_SECRET``, or the env var that ``side_channel_secret_env`` names: never the secret itself in
a config, configs get logged) a message travels as a :class:`Sealed` envelope around the exact bytes
of the msgpack message: an HMAC-SHA256 over those bytes, a timestamp and a random nonce. The server
refuses a message that is not sealed, sealed with another secret, older or newer than the clock-skew
window, or whose nonce it has seen within the window (a replay); the peer gets one fixed answer that
tells it nothing (not which check failed, not the engine id). Replies are sealed too and bound to the
request's nonce, so an old reply cannot answer a new request.

What it does not do: encrypt (anyone on the path reads the messages), or protect the TransferEngine
port, which accepts reads and writes of registered memory from whoever knows its addresses.
"""

from __future__ import annotations

import heapq
import hmac
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from kv_mooncake.errors import AuthError

DEFAULT_SECRET_ENV = "KV_SECRET"
MIN_SECRET_CHARS = 16  # a shorter secret can be guessed offline from one captured MAC
DEFAULT_WINDOW_S = 30.0  # clock skew accepted between two hosts; nonces are kept this long
NONCE_BYTES = 16
MAX_REMEMBERED_NONCES = 1 << 17  # per server; beyond it the oldest go and older messages are refused
_DOMAIN = b"kv-mooncake side channel v1"  # KV_SECRET may serve other uses: derive our own key
_REQUEST, _REPLY = b"Q", b"R"

# What an unauthenticated peer is told, whatever failed. Says how to fix a setup, nothing about us.
NOT_AUTHENTICATED = ("not authenticated: this side channel needs the shared side-channel secret "
                     "(KV_SECRET or side_channel_secret_env) on both sides; a missing or different secret, "
                     f"a clock more than {DEFAULT_WINDOW_S:g} s off, or a replay (the peer's log says which)")
NO_SECRET_HERE = ("this side channel has no side-channel secret but the request was sealed with one: "
                  "set the same secret (KV_SECRET or side_channel_secret_env) on both sides, or on neither")


class Sealed(msgspec.Struct, tag="kv-sealed", frozen=True, kw_only=True):
    """The envelope on the wire. ``body`` is decoded only after ``mac`` checked out."""

    ts_ms: int  # sender's wall clock
    nonce: bytes
    reply_to: bytes = b""  # a reply: the nonce of the request it answers
    body: bytes
    mac: bytes


_sealed_decoder = msgspec.msgpack.Decoder(Sealed)


class SideChannelAuth:
    """Seals and opens side-channel messages with one shared secret. Immutable: share it freely."""

    def __init__(self, secret: bytes, *, window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.time, source: str = DEFAULT_SECRET_ENV):
        if not secret:
            raise ValueError("a side-channel secret must not be empty")
        self._key = hmac.new(secret, _DOMAIN, "sha256").digest()
        self.window_s = window_s
        self.source = source  # the env var it came from: for messages, never the secret
        self._clock = clock

    def __repr__(self) -> str:  # never the key
        return f"SideChannelAuth(from {self.source})"

    def _mac(self, kind: bytes, ts_ms: int, nonce: bytes, reply_to: bytes, body: bytes) -> bytes:
        mac = hmac.new(self._key, kind, "sha256")
        for part in (ts_ms.to_bytes(8, "big", signed=True), nonce, len(reply_to).to_bytes(1, "big"), reply_to, body):
            mac.update(part)
        return mac.digest()

    def _seal(self, kind: bytes, body: bytes, reply_to: bytes) -> tuple[bytes, bytes]:
        ts_ms, nonce = int(self._clock() * 1000), secrets.token_bytes(NONCE_BYTES)
        sealed = Sealed(ts_ms=ts_ms, nonce=nonce, reply_to=reply_to, body=body,
                        mac=self._mac(kind, ts_ms, nonce, reply_to, body))
        return msgspec.msgpack.encode(sealed), nonce

    def seal_request(self, body: bytes) -> tuple[bytes, bytes]:
        """(wire bytes, nonce): keep the nonce to open the reply."""
        return self._seal(_REQUEST, body, b"")

    def seal_reply(self, body: bytes, request_nonce: bytes) -> bytes:
        return self._seal(_REPLY, body, request_nonce)[0]

    def _check_mac(self, kind: bytes, sealed: Sealed) -> None:
        if len(sealed.nonce) != NONCE_BYTES:
            raise AuthError("malformed envelope (nonce)")
        expected = self._mac(kind, sealed.ts_ms, sealed.nonce, sealed.reply_to, sealed.body)
        if not hmac.compare_digest(expected, sealed.mac):
            raise AuthError("bad MAC (a different secret, or the message was changed)")

    def open_request(self, sealed: Sealed, replays: ReplayGuard) -> bytes:
        """The body of an authentic, fresh, first-seen request; else :class:`AuthError`."""
        self._check_mac(_REQUEST, sealed)
        skew_s = sealed.ts_ms / 1000 - self._clock()
        if abs(skew_s) > self.window_s:
            raise AuthError(f"timestamp {skew_s:+.1f} s off this host's clock (window {self.window_s:g} s)")
        if not replays.first_time(sealed.nonce, sealed.ts_ms / 1000, self._clock()):
            raise AuthError("replayed message (nonce seen before)")
        return sealed.body

    def open_reply(self, sealed: Sealed, request_nonce: bytes) -> bytes:
        self._check_mac(_REPLY, sealed)
        if not hmac.compare_digest(sealed.reply_to, request_nonce):
            raise AuthError("reply to another request")
        return sealed.body


def decode_sealed(raw: bytes) -> Sealed:
    try:
        return _sealed_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AuthError("not sealed") from exc


def open_reply(auth: SideChannelAuth, raw: bytes, request_nonce: bytes) -> bytes:
    """The body of a sealed reply to the request sent with ``request_nonce`` (tests, raw sockets)."""
    return auth.open_reply(decode_sealed(raw), request_nonce)


class ReplayGuard:
    """Nonces of the requests accepted within the window (one per server, thread-safe).

    Bounded: past ``max_nonces`` the oldest are forgotten and every message no newer than the
    newest forgotten one is refused, so forgetting never lets a replay through."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_nonces: int = MAX_REMEMBERED_NONCES):
        self.window_s, self.max_nonces = window_s, max_nonces
        self._seen: set[bytes] = set()
        self._by_time: list[tuple[float, bytes]] = []
        self._floor = float("-inf")  # refuse messages stamped at or before this
        self._lock = threading.Lock()

    def first_time(self, nonce: bytes, stamped: float, now: float) -> bool:
        with self._lock:
            while self._by_time and self._by_time[0][0] < now - self.window_s:  # stale anyway now
                self._seen.discard(heapq.heappop(self._by_time)[1])
            if nonce in self._seen or stamped <= self._floor:
                return False
            self._seen.add(nonce)
            heapq.heappush(self._by_time, (stamped, nonce))
            while len(self._by_time) > self.max_nonces:
                oldest, forgotten = heapq.heappop(self._by_time)
                self._seen.discard(forgotten)
                self._floor = max(self._floor, oldest)
            return True

    def __len__(self) -> int:
        return len(self._seen)


def auth_from_env(secret_env: str | None, environ: Mapping[str, str] = os.environ) -> SideChannelAuth | None:
    """The side channel's secret: from ``secret_env`` (which must then be set), else from
    ``KV_SECRET`` when set; None without one. Errors name the variable and the length, never the value."""
    name = secret_env or DEFAULT_SECRET_ENV
    value = environ.get(name, "")
    if not value:
        if secret_env:
            raise ValueError(f"side_channel_secret_env names {secret_env}, which is not set (or empty): "
                             "set it on every prefill and decode, or drop the key")
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"{name} holds {len(value)} characters; a side-channel secret needs at least "
                         f"{MIN_SECRET_CHARS}")
    return SideChannelAuth(value.encode(), source=name)


def secret_preflight(plan: Any, secret_env: str | None, listeners: list[tuple[str, int, str]]) -> None:
    """``python -m kv_common doctor``: the secret as this environment holds it (a
    ``kv_common.doctor.Preflight`` gets the findings)."""
    try:
        auth = auth_from_env(secret_env)
    except ValueError as exc:
        plan.problems.append(str(exc))
        return
    if auth is None:
        plan.unauthenticated_binds.extend(listeners)
    else:
        plan.notes.append(f"side channel: every message sealed with the secret from {auth.source} "
                          "(as set in this environment)")
    plan.notes.append("the TransferEngine port takes reads and writes of registered KV memory from anyone who "
                      "knows the addresses; the side-channel secret does not protect it: keep it on a private network")


def _is_sealed(payload: bytes) -> bool:
    try:
        decode_sealed(payload)
    except AuthError:
        return False
    return True
