"""Circuit breakers: stop calling what keeps failing, and try it again after a cool-down.

One state machine for every place that gives up on something for a while (kv-store's lookups, a
decode rank's prefill peers, the proxy's instances)::

    closed --threshold failures in a row--> open --cool-down over, allow()--> half_open
    half_open --a success--> closed            half_open --a failure--> open (the next cool-down)

``cooldown`` is a :class:`~kv_common.retry.Backoff`: the n-th opening in a row (no success in
between) lasts ``cooldown.nth(n)``; ``None``: open until a success is recorded (something else
probes, a health check). Once the cool-down is over, ``half_open="one"`` lets one probe through
(the others are refused until it ends), ``"all"`` lets every call through (the first failure opens
it again). A failure recorded while open and cooling down (a call started before it opened) only
counts with ``failure_while_open="count"``; ``"reopen"`` opens it again at once, for the next
cool-down (a peer still failing is presumed down for longer). ``threshold < 1``: never opens.

:class:`Breaker` is one such thing, not thread-safe; :class:`KeyedBreaker` holds one per key (a
peer's address) behind a lock. The clock is injectable (monotonic seconds).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, Literal, TypeVar

from kv_common.retry import Backoff

State = Literal["closed", "open", "half_open"]
HalfOpen = Literal["one", "all"]
FailureWhileOpen = Literal["count", "reopen"]
K = TypeVar("K", bound=Hashable)


class Breaker:
    def __init__(self, threshold: int = 1, cooldown: Backoff | None = Backoff(1.0), *,
                 half_open: HalfOpen = "one", failure_while_open: FailureWhileOpen = "count",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold, self.cooldown, self.half_open = threshold, cooldown, half_open
        self.failure_while_open = failure_while_open
        self._clock = clock
        self._state: State = "closed"
        self._failures = 0  # in a row
        self._openings = 0  # in a row: which cool-down comes next
        self._retry_at: float | None = None  # while open: when the cool-down ends (None: never)

    @property
    def state(self) -> State:
        """As last recorded: an open breaker whose cool-down is over reads "open" until ``allow()``."""
        return self._state

    @property
    def failures(self) -> int:
        """Failures in a row (reset by a success)."""
        return self._failures

    @property
    def cooling_down(self) -> bool:
        """Open and its cool-down not over: every call is refused."""
        return self._state == "open" and not self._cooled()

    def _cooled(self) -> bool:
        return self._retry_at is not None and self._clock() >= self._retry_at

    def allow(self) -> bool:
        """May a call go through now? The first call after the cool-down half-opens the breaker."""
        if self._state == "closed":
            return True
        if self._state == "half_open":
            return self.half_open == "all"
        if not self._cooled():
            return False
        self._state = "half_open"
        return True

    def failure(self) -> bool:
        """Record a failed call; True when this one opened the breaker (or, ``failure_while_open=
        "reopen"``, opened it again while cooling down)."""
        self._failures += 1
        if self.threshold < 1 or (self.cooling_down and self.failure_while_open == "count"):
            return False
        if self._state == "closed" and self._failures < self.threshold:
            return False
        self._openings += 1
        self._state = "open"
        self._retry_at = None if self.cooldown is None else self._clock() + self.cooldown.nth(self._openings)
        return True

    def success(self) -> bool:
        """Record a call that went through: closed again, counts reset. True when it was not closed."""
        was_closed = self._state == "closed"
        self._state, self._failures, self._openings, self._retry_at = "closed", 0, 0, None
        return not was_closed


class KeyedBreaker(Generic[K]):
    """A breaker per key, made by ``make`` on the key's first failure and dropped on its success
    (only keys failing now take memory); thread-safe."""

    def __init__(self, make: Callable[[], Breaker] = Breaker) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._breakers: dict[K, Breaker] = {}

    def allow(self, key: K) -> bool:
        with self._lock:
            b = self._breakers.get(key)
            return b is None or b.allow()

    def failure(self, key: K) -> bool:
        with self._lock:
            b = self._breakers.get(key)
            if b is None:
                b = self._breakers[key] = self._make()
            return b.failure()

    def success(self, key: K) -> bool:
        with self._lock:
            b = self._breakers.pop(key, None)
            return b is not None and b.success()

    def state(self, key: K) -> State:
        with self._lock:
            b = self._breakers.get(key)
            return "closed" if b is None else b.state

    def cooling_down(self, key: K) -> bool:
        with self._lock:
            b = self._breakers.get(key)
            return b is not None and b.cooling_down

    def failures(self, key: K) -> int:
        with self._lock:
            b = self._breakers.get(key)
            return 0 if b is None else b.failures

    def forget(self, key: K) -> None:
        """Drop ``key``'s state (a peer gone for good)."""
        with self._lock:
            self._breakers.pop(key, None)

    def __len__(self) -> int:
        """Keys with a failure recorded since their last success."""
        with self._lock:
            return len(self._breakers)
