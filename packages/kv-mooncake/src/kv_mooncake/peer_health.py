"""Decode side: keep one unreachable prefill from costing the pulls of every other.

``PeerBreaker`` is a circuit breaker per prefill rank address. A peer that stayed silent for a
whole pull (no reply at all until the pull's deadline: a frozen or dead process) is presumed down:
pulls to it fail at once instead of each waiting out its own deadline. After a back-off (doubling,
capped) one pull probes it again; any reply closes the breaker.

``PeerQueues`` gives every prefill rank its own small thread pool, so pulls for a healthy prefill
never queue behind pulls waiting on a silent one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

State = Literal["closed", "open", "probing"]


@dataclass
class _Peer:
    state: State = "closed"
    retry_at: float = 0.0
    backoff_s: float = 0.0


class PeerBreaker:
    def __init__(self, first_backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self._first, self._max = first_backoff_s, max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}

    def allow(self, peer: str) -> bool:
        """May a new pull talk to ``peer``? When the back-off has passed, the first caller probes."""
        with self._lock:
            p = self._peers.get(peer)
            if p is None or p.state == "closed":
                return True
            if p.state == "open" and self._clock() >= p.retry_at:
                p.state = "probing"
                return True
            return False

    def is_open(self, peer: str) -> bool:
        """Presumed down and not being probed: pulls already waiting on it should give up."""
        with self._lock:
            p = self._peers.get(peer)
            return p is not None and p.state == "open"

    def silent(self, peer: str) -> None:
        """``peer`` did not answer for a whole pull (or a whole DONE delivery): open the breaker."""
        with self._lock:
            p = self._peers.setdefault(peer, _Peer())
            p.backoff_s = self._first if p.state == "closed" else min(self._max, 2 * p.backoff_s)
            p.state, p.retry_at = "open", self._clock() + p.backoff_s

    def answered(self, peer: str) -> None:
        with self._lock:
            self._peers.pop(peer, None)

    def state(self, peer: str) -> State:
        with self._lock:
            p = self._peers.get(peer)
            return "closed" if p is None else p.state


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
