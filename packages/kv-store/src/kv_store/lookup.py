"""How many tokens an external hit is worth, and when to stop asking a backend that does not
answer. No vLLM, no backend: pure functions and a clock-driven breaker."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def leading_present(present_per_rank: Sequence[Sequence[bool]]) -> int:
    """Blocks present, from the first, for every rank (a block missing for one rank is unusable,
    and so is everything after it: KV is only valid on top of its whole prefix)."""
    if not present_per_rank:
        return 0
    count = 0
    for column in zip(*present_per_rank, strict=False):
        if not all(column):
            break
        count += 1
    return count


def loadable_blocks(num_tokens: int, num_hashed_blocks: int, block_size: int) -> int:
    """Full blocks worth asking the store for. A partial last block is skipped (never stored), and
    a prompt that fills its last block exactly keeps that block to compute: vLLM needs at least one
    token to compute to produce logits, and blocks move whole."""
    if block_size <= 0 or num_tokens <= 0:
        return 0
    full = min(num_tokens // block_size, num_hashed_blocks)
    if full * block_size >= num_tokens:
        full -= 1
    return max(full, 0)


def external_tokens(num_computed_tokens: int, first_block: int, present_blocks: int, block_size: int) -> int:
    """Tokens to load beyond the local hit, given ``present_blocks`` consecutive blocks found in the
    store starting at block ``first_block`` (= ``num_computed_tokens // block_size``)."""
    if present_blocks <= 0:
        return 0
    end = (first_block + present_blocks) * block_size
    return max(0, end - num_computed_tokens)


class LookupBreaker:
    """Circuit breaker for lookups: ``threshold`` timeouts in a row open it for ``backoff_s``.

    While open, ``allow()`` is False and the scheduler answers "miss" at once instead of waiting
    ``lookup_timeout_s`` per request on a backend that is hung. When the back-off ends, the next
    lookup is a probe: an answer closes the breaker, another timeout opens it again at once.
    ``threshold <= 0`` disables it.
    """

    def __init__(self, threshold: int, backoff_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.backoff_s = backoff_s
        self._clock = clock
        self.consecutive_timeouts = 0
        self.open_until: float | None = None
        self.times_opened = 0

    def allow(self) -> bool:
        if self.open_until is None:
            return True
        if self._clock() >= self.open_until:
            self.open_until = None  # half-open: one more timeout re-opens it (count kept)
            return True
        return False

    @property
    def is_open(self) -> bool:
        return self.open_until is not None and self._clock() < self.open_until

    def record_answer(self) -> None:
        self.consecutive_timeouts = 0
        self.open_until = None

    def record_timeout(self) -> bool:
        """Count a timeout; True when this one opened the breaker."""
        self.consecutive_timeouts += 1
        if self.threshold <= 0 or self.consecutive_timeouts < self.threshold or self.is_open:
            return False
        self.open_until = self._clock() + self.backoff_s
        self.times_opened += 1
        return True
