"""Decode side: keep one unreachable prefill from costing the pulls of every other.

``peer_breaker`` is a circuit breaker per prefill rank address (``kv_common.breaker``). A peer
that stayed silent for a whole pull (no reply at all until the pull's deadline: a frozen or dead
process) is presumed down: pulls to it fail at once instead of each waiting out its own deadline.
After a back-off (doubling, capped) one pull probes it again; any reply closes the breaker.

``ReachabilityProbe`` tells at once an address where nothing can answer (connection refused, no
route): the side channel does not report those, it tries again quietly until the request's deadline
(a restarting prefill answers on a later try).

``PeerQueues`` gives every prefill rank its own small thread pool, so pulls for a healthy prefill
never queue behind pulls waiting on a silent one.
"""

from __future__ import annotations

import errno
import functools
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kv_common.breaker import Breaker, KeyedBreaker
from kv_common.retry import Backoff

from kv_mooncake.wire.connection import split_address


def peer_breaker(clock: Callable[[], float] = time.monotonic) -> KeyedBreaker[str]:
    """Per prefill rank address: open after one silence (no reply for a whole pull, or a whole DONE
    delivery: ``failure``), 1 s then doubling up to 30 s; one pull probes after it (``allow``),
    any reply closes it (``success``). Silent again while open: open again, for longer. ``state``
    "open" (presumed down, nobody probing): pulls already waiting on it give up."""
    return KeyedBreaker(functools.partial(Breaker, threshold=1, cooldown=Backoff(1.0, 2.0, 30.0), half_open="one",
                                          failure_while_open="reopen", clock=clock))


# What the kernel answers at once for an address where no side channel can answer: nothing listens
# on the port, or no route leads to the host. A connect that merely takes long is a slow peer (a
# loaded prefill, a slow link): not a verdict, the pull's own deadline decides.
_UNREACHABLE = {
    errno.ECONNREFUSED: "connection refused (nothing listens there)",
    errno.EHOSTUNREACH: "no route to host",
    errno.ENETUNREACH: "network unreachable",
    errno.EADDRNOTAVAIL: "address not available",
}


class ReachabilityProbe:
    """A TCP connect to a peer's side-channel address, bounded by ``timeout_s``; its verdict is kept
    for ``ttl_s`` per address, so pulls to a healthy peer pay one connect every ``ttl_s``, not one
    each, and a restarted peer is tried again soon after."""

    def __init__(self, timeout_s: float = 0.5, ttl_s: float = 2.0, max_peers: int = 256,
                 clock: Callable[[], float] = time.monotonic):
        self._timeout_s, self._ttl_s, self._max_peers = timeout_s, ttl_s, max_peers
        self._clock = clock
        self._lock = threading.Lock()
        self._verdicts: dict[str, tuple[float, str | None]] = {}  # address -> (when, why unreachable)

    def unreachable(self, address: str) -> str | None:
        """Why nothing at ``address`` ('host:port') can answer, or None (it accepted, or was slow)."""
        now = self._clock()
        with self._lock:
            cached = self._verdicts.get(address)
        if cached is not None and now - cached[0] < self._ttl_s:
            return cached[1]
        why = self._connect(address)
        with self._lock:
            if len(self._verdicts) >= self._max_peers:
                self._verdicts.clear()  # bounded: a verdict is cheap to learn again
            self._verdicts[address] = (self._clock(), why)
        return why

    def _connect(self, address: str) -> str | None:
        try:
            host, port = split_address(address)  # as the side channel reads it
        except ValueError:
            return f"{address!r} is not HOST:PORT"
        try:
            with socket.create_connection((host, port), timeout=self._timeout_s):
                return None
        except socket.gaierror as exc:
            return f"host {host!r} does not resolve ({exc.strerror or exc})"
        except OSError as exc:
            return _UNREACHABLE.get(exc.errno or 0)  # None: timed out or another error, not a verdict


class PeerQueues:
    """One pool of ``threads_per_peer`` threads per peer, created on first use. At most ``max_peers``
    pools: further peers share them by hash (bounded threads, never unbounded growth)."""

    def __init__(self, threads_per_peer: int, max_peers: int = 64, name: str = "pull"):
        self._threads, self._max_peers, self._name = threads_per_peer, max_peers, name
        self._lock = threading.Lock()
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._closed = False

    def _pool(self, peer: str) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("peer queues are closed")
            pool = self._pools.get(peer)
            if pool is None:
                if len(self._pools) >= self._max_peers:
                    return list(self._pools.values())[hash(peer) % len(self._pools)]
                pool = ThreadPoolExecutor(self._threads, thread_name_prefix=f"{self._name}-{len(self._pools)}")
                self._pools[peer] = pool
            return pool

    def submit(self, peer: str, fn: Callable[..., Any], *args: Any) -> None:
        self._pool(peer).submit(fn, *args)

    def close(self, cancel: bool = True) -> None:
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=cancel)
        for pool in pools:
            pool.shutdown(wait=True)
