"""Decode side of the pull protocol: the messages a decode rank owes the prefill ranks.

Over the prefill ranks' side channels (connections kept open) a decode rank sends the handshake
(cached per prefill rank and engine, a bounded number of them, until the rank's boot id changes),
takes and renews the lease on the blocks it reads (``PullStarted`` / ``LeaseRenew``), says
``PullDone`` once it read (its reply confirms the lease held throughout) or gave up, ``FreeNow`` when
nobody reads, and keeps accepted requests' holds alive (``HoldKeepAlive``) until their pull takes a
lease. A peer silent for a whole pull is presumed down (``pull.peers.peer_breaker``): later
messages fail fast. How often each message is tried again is a ``kv_common.retry.Retry``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
from kv_common.logging_utils import get_logger
from kv_common.retry import Backoff, Retry

from kv_mooncake.config import MooncakeConfig
from kv_mooncake.errors import (
    PeerDown,
    PeerUnreachable,
    PullFailed,
    SideChannelError,
    SideChannelRefused,
    SideChannelTimeout,
)
from kv_mooncake.params import RemoteSource
from kv_mooncake.pipeline_stages import waive_stage_fields
from kv_mooncake.pull.lease import EarlyLease
from kv_mooncake.pull.peers import ReachabilityProbe, peer_breaker
from kv_mooncake.pull.plan import RankPull
from kv_mooncake.rank_layout import DecodeRank, PrefillLayout, PrefillRank
from kv_mooncake.wire import client as side_channel
from kv_mooncake.wire import messages as P
from kv_mooncake.wire.connection import rank_address
from kv_mooncake.wire.seal import auth_from_env

logger = get_logger(__name__)

HANDSHAKE_CACHE_SIZE = 256  # prefill ranks whose handshake is kept (least recently used go first)


def peer_address(source: RemoteSource, rank: PrefillRank, layout: PrefillLayout) -> str:
    """The side channel of ``rank`` of the prefill instance ``source`` names (one port per rank)."""
    return rank_address(source.host, source.port, rank.index(layout))


class PrefillMessenger:
    """One decode rank's side-channel messages to the prefill ranks it reads from."""

    def __init__(self, config: MooncakeConfig, *, reader_id: str, decode_rank: DecodeRank):
        self.config = config
        self.reader_id = reader_id
        self.decode_rank = decode_rank
        self.compatibility: P.Compatibility | None = None  # set when the KV cache is registered
        self._lock = threading.Lock()
        self._handshakes: OrderedDict[tuple[str, str], P.HandshakeReply] = OrderedDict()
        # Without ``start_threads`` (a kv_producer-only rank) DONE / FreeNow still go out, inline.
        self._notifier: ThreadPoolExecutor | None = None  # DONE / FreeNow delivery, off the pull threads
        # Hold heartbeats on their own thread: one to a frozen prefill must not delay a DONE.
        self._heartbeats: ThreadPoolExecutor | None = None
        self._heartbeats_queued: set[str] = set()
        self._breaker = peer_breaker()  # prefill ranks presumed down fail fast
        # Within a pull's deadline: after a Refused(retry=True) ("busy") a short pause, doubling;
        # after a try that timed out, at once a try twice as long (a starved prefill answers in turn).
        self._ask_retry = Retry(backoff=Backoff(0.005, 2.0, 0.1),
                                try_timeout=Backoff(config.handshake_timeout_s, 2.0))
        # DONE / FreeNow: for up to a lease, each try twice as long as the one before; to a peer
        # presumed down or unreachable, one short try.
        self._notify_retry = Retry(deadline_s=config.lease_s,
                                   try_timeout=Backoff(min(1.0, config.handshake_timeout_s), 2.0))
        self._notify_once = Retry(total=1, try_timeout=Backoff(0.2))
        # Addresses where nothing can answer (refused, no route) fail at once: the side channel would
        # retry quietly until the deadline.
        self._reachability = ReachabilityProbe(timeout_s=min(0.5, config.handshake_timeout_s))
        # Kept-open connections to the prefill ranks: a new one per message cost ~5 ms per pull.
        self._client = side_channel.SideChannelClient(
            P.REPLY_TYPES, config.max_message_bytes, auth=auth_from_env(config.side_channel_secret_env))

    def start_threads(self) -> None:
        self._notifier = ThreadPoolExecutor(2, thread_name_prefix="mooncake-done")
        self._heartbeats = ThreadPoolExecutor(1, thread_name_prefix="mooncake-heartbeat")

    # ---- during a pull -----------------------------------------------------------------------
    def check_not_down(self, address: str) -> None:
        """Before a pull: a rank presumed down fails it at once (after a back-off one pull probes)."""
        if not self._breaker.allow(address):
            raise PeerDown(f"{address} presumed down (silent for a whole pull); it is probed again later")
        self._check_reachable(address)

    def _check_reachable(self, address: str) -> None:
        why = self._reachability.unreachable(address)
        if why is not None:
            raise PeerUnreachable(f"side channel {address} unreachable: {why}")

    def handshake(self, address: str, engine_id: str, deadline: float) -> P.HandshakeReply:
        key = (address, engine_id)
        with self._lock:
            cached = self._handshakes.get(key)
            if cached is not None:
                self._handshakes.move_to_end(key)
                return cached
        assert self.compatibility is not None
        msg = P.Handshake(engine_id=engine_id, compatibility=self.compatibility, reader_id=self.reader_id)
        reply = self._ask(address, msg, deadline)
        if not isinstance(reply, P.HandshakeReply):
            raise PullFailed(f"handshake with {address} failed: {getattr(reply, 'reason', reply)}")
        if reply.heads_on_rank < 1 or len(reply.layer_names) != len(reply.base_addresses) or \
                len(reply.block_bytes) != len(reply.layer_names):
            raise PullFailed(f"malformed handshake reply from {address}")
        # Both sides compare: a prefill that skipped the check must not be read either.
        # A pipeline stage's layers are checked by name instead (pull.puller, pipeline_stages).
        diff = waive_stage_fields(self.compatibility, reply.compatibility).differences(reply.compatibility)
        if diff:
            raise PullFailed(f"handshake with {address}: incompatible KV caches: " + "; ".join(diff))
        with self._lock:
            self._handshakes[key] = reply
            while len(self._handshakes) > HANDSHAKE_CACHE_SIZE:
                self._handshakes.popitem(last=False)
        return reply

    def same_boot(self, address: str, engine_id: str, hs: P.HandshakeReply, boot_id: str,
                  deadline: float) -> P.HandshakeReply:
        """The handshake of the boot that granted the lease (``boot_id``, echoed by its Ack): a
        prefill restarted with a pinned engine_id may lay its KV out otherwise. A stale cached
        handshake is dropped and asked again; a rank that restarted once more meanwhile fails the pull."""
        if hs.boot_id == boot_id:
            return hs
        logger.info("MooncakeConnectorV1: %s (engine %s) restarted since its handshake: handshaking again",
                    address, engine_id)
        with self._lock:
            if self._handshakes.get((address, engine_id)) is hs:
                del self._handshakes[(address, engine_id)]
        fresh = self.handshake(address, engine_id, deadline)
        if fresh.boot_id != boot_id:
            raise PullFailed(f"{address} restarted during the pull (boot {boot_id!r}, now {fresh.boot_id!r})")
        return fresh

    def forget_handshakes(self, engine_id: str) -> None:
        """After a failed pull: the prefill may have restarted, ask it again next time."""
        with self._lock:
            for key in [k for k in self._handshakes if k[1] == engine_id]:
                del self._handshakes[key]

    def cached_handshakes(self) -> int:
        with self._lock:
            return len(self._handshakes)

    def take_lease(self, address: str, started: P.PullStarted, deadline: float) -> P.Ack:
        """``PullStarted``: the prefill keeps the blocks while the lease is current (its Ack may carry
        the ``verify_kv`` digests)."""
        reply = self._ask(address, started, deadline)
        if not isinstance(reply, P.Ack):
            raise PullFailed(f"{address} refused the pull: {getattr(reply, 'reason', reply)}")
        return reply

    def start_lease(self, address: str, started: P.PullStarted, deadline: float) -> EarlyLease:
        """``PullStarted`` sent now, its answer awaited later (``pull.lease``): the read goes meanwhile."""
        return EarlyLease(self._client, address, started, deadline, self.config.handshake_timeout_s, self.take_lease)

    def confirm_read(self, address: str, done: P.PullDone, deadline: float) -> bool:
        """Send the DONE of a read and wait for its reply: True only when the prefill says the lease
        held from PullStarted to now. A batch that landed within a third of a lease of the last
        renewal was never asked about; only this answer vouches for it. Raises when unanswered."""
        reply = self._ask(address, done, deadline)
        return isinstance(reply, P.PullDoneReply) and reply.held_throughout

    def lease_renewer(self, address: str, request_id: str, deadline: float) -> Callable[[], None]:
        """A call for each read batch that renews the lease once a third of it has passed."""
        renew = P.LeaseRenew(request_id=request_id, reader_id=self.reader_id)
        last_renew = [time.monotonic()]

        def renew_if_due() -> None:
            if time.monotonic() - last_renew[0] > self.config.lease_s / 3:
                last_renew[0] = time.monotonic()
                # A starved prefill answers late: retry until the pull's deadline, never fail early.
                reply = self._ask(address, renew, deadline)
                if not isinstance(reply, P.Ack):
                    raise PullFailed(f"{address} refused the lease renewal: {getattr(reply, 'reason', reply)}")

        return renew_if_due

    def _request(self, address: str, message: msgspec.Struct, timeout_s: float) -> msgspec.Struct:
        return self._client.request(address, message, max(0.05, timeout_s))

    def _ask(self, address: str, message: msgspec.Struct, deadline: float) -> msgspec.Struct:
        """``message`` until the pull's deadline, the first try bounded by ``handshake_timeout_s``."""
        return self._until(deadline, address, lambda timeout_s: self._request(address, message, timeout_s))

    def _until(self, deadline: float, address: str, call: Callable[[float], msgspec.Struct]) -> msgspec.Struct:
        """Repeat ``call`` while the peer answers Refused(retry=True) or not at all, until the deadline
        (``self._ask_retry``). A peer silent until the deadline is presumed down (``peer_breaker``); a
        pull waiting on a peer that another pull found down gives up at once. ``call(timeout_s)``: one
        try, bounded by ``handshake_timeout_s``, each try after a timeout twice as long as the one before."""
        policy = self._ask_retry
        refusals = timeouts = 0
        while True:
            if self._breaker.state(address) == "open":
                raise PeerDown(f"{address} presumed down (silent for a whole pull); it is probed again later")
            now = time.monotonic()
            if not policy.allows(refusals + timeouts, deadline, now=now):
                raise PullFailed("deadline passed")
            try:
                reply = call(policy.timeout(timeouts, deadline - now))
            except SideChannelTimeout:
                # A busy prefill (its side-channel thread starved on a shared core) gets until the
                # pull's deadline, not just one request's timeout; the request is idempotent.
                if deadline - time.monotonic() <= 0:
                    self._breaker.failure(address)
                    raise
                self._check_reachable(address)  # gone meanwhile (refused): no use waiting
                # The prefill still answers the request given up on (to nobody), in turn: asked again
                # at the same pace, one slower than a try never gets through its queue in time.
                timeouts += 1
                continue
            self._breaker.success(address)
            if not (isinstance(reply, P.Refused) and reply.retry):
                return reply
            refusals += 1
            time.sleep(min(policy.pause(refusals), max(0.0, deadline - time.monotonic())))

    # ---- after a pull ------------------------------------------------------------------------
    def pull_finished(self, source: RemoteSource, prefill: PrefillLayout, counts: dict[PrefillRank, int],
                      pulls: list[RankPull], failed: set[PrefillRank], told: frozenset[PrefillRank] = frozenset()) -> None:
        """The DONE / FreeNow owed to the prefill ranks once this rank's pull of ``source`` ended
        (``counts``: this request's readers per prefill rank, empty without a plan; ``told``: ranks
        whose DONE ``confirm_read`` delivered). Always DONE, also after a failure: the prefill must
        not wait for us until expiry."""
        owed: list[tuple[str, msgspec.Struct]] = []
        if not counts:
            # No plan: nobody will read any rank. Every decode rank that gets here says so (FreeNow is
            # idempotent), so the prefill frees now even if decode rank 0 is gone.
            for rank in prefill.ranks():
                owed.append((peer_address(source, rank, prefill),
                             P.FreeNow(request_id=source.request_id, reader_id=self.reader_id)))
        for rank, n in counts.items():
            if n == 0 and self.decode_rank == DecodeRank(0):  # one decode rank tells the idle ranks
                owed.append((peer_address(source, rank, prefill),
                             P.FreeNow(request_id=source.request_id, reader_id=self.reader_id)))
        for pull in pulls:
            if pull.source in told:
                continue
            owed.append((peer_address(source, pull.source, prefill),
                         P.PullDone(request_id=source.request_id, reader_id=self.reader_id,
                                    ok=pull.source not in failed, expected_readers=counts[pull.source])))
        if not owed:
            return
        if self._notifier is None:
            self._send_done(owed)
        else:
            try:
                self._notifier.submit(self._send_done, owed)
            except RuntimeError:  # shutting down
                self._send_done(owed)

    def _send_done(self, owed: list[tuple[str, msgspec.Struct]]) -> None:
        for address, message in owed:
            self._notify(address, message)

    def _notify(self, address: str, message: msgspec.Struct) -> None:
        """Deliver a DONE / FreeNow, retrying for up to ``lease_s``: a busy prefill (its side channel
        thread starved on a loaded host) must not keep the blocks until expiry because one answer
        came late. DONE and FreeNow are idempotent on the prefill, so a repeat is harmless. A peer
        presumed down (``peer_breaker``) or where nothing can answer (refused, no route) gets one short
        try per message; a refusal for the side-channel secret is final (secrets never start to match)."""
        start = time.monotonic()
        presumed_dead = self._breaker.state(address) != "closed" or \
            self._reachability.unreachable(address) is not None
        policy = self._notify_once if presumed_dead else self._notify_retry
        give_up = policy.deadline(start)
        failures = 0
        left = math.inf  # the first try: its own bound only
        while True:
            try:
                self._request(address, message, policy.timeout(failures, left))
                self._breaker.success(address)
                return
            except SideChannelError as exc:
                failures += 1
                now = time.monotonic()
                if not policy.allows(failures, give_up, now=now) or isinstance(exc, SideChannelRefused):
                    if isinstance(exc, SideChannelTimeout) and not presumed_dead:
                        self._breaker.failure(address)
                    self._client.forget(address)
                    logger.warning("MooncakeConnectorV1: %s to %s not delivered: %s",
                                   type(message).__name__, address, exc)
                    return
                # Each try twice as long (as in ``_until``): a starved prefill answers in turn.
                left = math.inf if give_up is None else max(0.05, give_up - now)

    # ---- without a pull ----------------------------------------------------------------------
    def keep_alive(self, source: RemoteSource, prefill: PrefillLayout) -> None:
        """An accepted request with no pull yet: its hold must outlive the wait (decode rank 0 says so)."""
        if self._heartbeats is None or self.decode_rank != DecodeRank(0):
            return
        with self._lock:  # one queued heartbeat per request: a silent peer cannot pile them up
            queued = source.request_id in self._heartbeats_queued
            self._heartbeats_queued.add(source.request_id)
        if not queued:
            self._heartbeats.submit(self._send_keep_alive, source, prefill)

    def _send_keep_alive(self, source: RemoteSource, prefill: PrefillLayout) -> None:
        """One short try per prefill rank: the next heartbeat comes a third of a lease later."""
        with self._lock:
            self._heartbeats_queued.discard(source.request_id)
        message = P.HoldKeepAlive(request_id=source.request_id, reader_id=self.reader_id)
        for rank in prefill.ranks():
            address = peer_address(source, rank, prefill)
            if self._breaker.state(address) != "closed":
                continue  # presumed down: its pulls fail fast anyway
            try:
                self._request(address, message, min(1.0, self.config.lease_s / 3, self.config.handshake_timeout_s))
                self._breaker.success(address)
            except SideChannelError as exc:
                logger.debug("MooncakeConnectorV1: keep-alive to %s not delivered: %s", address, exc)

    def free_now(self, source: RemoteSource, prefill: PrefillLayout) -> None:
        """Nothing will be pulled for this request (aborted, or a full local hit): free it there."""
        if self._notifier is not None:
            self._notifier.submit(self._tell_free, source, prefill)
        else:  # kv_producer only: still answer the protocol, inline
            self._tell_free(source, prefill)

    def _tell_free(self, source: RemoteSource, prefill: PrefillLayout) -> None:
        if self.decode_rank != DecodeRank(0):
            return
        for rank in prefill.ranks():
            self._notify(peer_address(source, rank, prefill),
                         P.FreeNow(request_id=source.request_id, reader_id=self.reader_id))

    def close(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.shutdown(wait=True, cancel_futures=True)
        if self._notifier is not None:
            self._notifier.shutdown(wait=True)  # owed DONEs go out (each bounded by lease_s)
        self._client.close()
