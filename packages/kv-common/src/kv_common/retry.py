"""How often and for how long to try again: one immutable value for every loop that retries.

After urllib3's ``Retry``: a loop keeps its own counters (tries made, failures of each kind) and
asks the policy, which holds no state, what they allow. ``Retry`` bounds the tries (``total``,
an overall ``deadline_s``), spaces them (``backoff``: the pause after each failed try) and may
lengthen each try's own bound (``try_timeout``: a peer that answers in turn, late, gets through).

    policy = Retry(total=3, backoff=Backoff(0.05, factor=2.0, max_s=1.0))
    tries = 0
    while True:
        tries += 1
        if try_once():
            return
        pause = policy.pause(tries)  # every try so far failed
        if not policy.allows(tries, deadline, pause=pause):
            raise GaveUp(...)
        time.sleep(pause)

``Backoff`` is the geometric schedule both use; :mod:`kv_common.breaker` takes one for the
cool-down of a breaker that opens again and again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import overload


@dataclass(frozen=True)
class Backoff:
    """``first_s``, then each value ``factor`` times the one before, never above ``max_s``."""

    first_s: float
    factor: float = 2.0
    max_s: float = math.inf

    def __post_init__(self) -> None:
        if not self.first_s >= 0 or not self.factor >= 1 or not self.max_s >= 0:
            raise ValueError(f"{self}: needs first_s >= 0, factor >= 1, max_s >= 0")

    def nth(self, n: int) -> float:
        """The ``n``-th value of the schedule (``nth(1) == min(first_s, max_s)``); 0 for ``n < 1``."""
        if n < 1:
            return 0.0
        try:
            value = self.first_s * self.factor ** (n - 1)
        except OverflowError:  # a float power past 1e308: the cap (or infinity) it would reach
            value = math.inf if self.first_s > 0 else 0.0
        return min(value, self.max_s)


@dataclass(frozen=True)
class Retry:
    """A retry policy: at most ``total`` tries (the first included; ``None``: no limit), within
    ``deadline_s`` of the first (``None``: only the caller's deadline, if any), ``backoff.nth(n)``
    apart after the ``n``-th failure, each bounded by ``try_timeout.nth(n + 1)`` (``None``:
    unbounded) or by the time left. Immutable: derive variants with ``dataclasses.replace``."""

    total: int | None = None
    deadline_s: float | None = None
    backoff: Backoff = Backoff(0.0)  # no pause
    try_timeout: Backoff | None = None

    def __post_init__(self) -> None:
        if self.total is not None and self.total < 1:
            raise ValueError(f"{self}: total counts the first try too (>= 1)")
        if self.deadline_s is not None and not self.deadline_s >= 0:
            raise ValueError(f"{self}: deadline_s must be >= 0")

    def deadline(self, start: float) -> float | None:
        """The monotonic deadline of a loop whose first try starts at ``start`` (``None``: none)."""
        return None if self.deadline_s is None else start + self.deadline_s

    def pause(self, failures: int) -> float:
        """The pause before the next try, after ``failures`` failed tries (0 before any)."""
        return self.backoff.nth(failures)

    @overload
    def timeout(self, failures: int, left: float) -> float: ...
    @overload
    def timeout(self, failures: int, left: None = None) -> float | None: ...

    def timeout(self, failures: int, left: float | None = None) -> float | None:
        """The bound of the next try after ``failures`` failed tries, never more than ``left``
        (the time to the deadline); ``None``: unbounded."""
        own = None if self.try_timeout is None else self.try_timeout.nth(failures + 1)
        if own is None or left is None:
            return left if own is None else own
        return min(own, left)

    def allows(self, tries: int, deadline: float | None = None, *, now: float | None = None,
               pause: float = 0.0) -> bool:
        """May another try start, ``tries`` made so far, after a ``pause``, before ``deadline``
        (monotonic; ``now`` defaults to ``time.monotonic()``)?"""
        if self.total is not None and tries >= self.total:
            return False
        if deadline is None:
            return True
        return (time.monotonic() if now is None else now) + pause < deadline
