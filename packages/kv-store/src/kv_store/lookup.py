"""How many tokens an external hit is worth, and when to stop asking a backend that does not
answer. No vLLM, no backend: pure functions and the lookups' settings of kv-common's breaker."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kv_common.breaker import Breaker
from kv_common.retry import Backoff


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


def lookup_breaker(threshold: int, backoff_s: float, clock: Callable[[], float] = time.monotonic) -> Breaker:
    """The lookups' circuit breaker: ``threshold`` timeouts in a row open it for ``backoff_s``.

    While open (``cooling_down``), ``allow()`` is False and the scheduler answers "miss" at once
    instead of waiting ``lookup_timeout_s`` per request on a backend that is hung. When the back-off
    ends, every lookup goes through again: an answer closes the breaker, another timeout opens it
    again at once (for ``backoff_s`` again). ``threshold <= 0`` disables it; ``backoff_s <= 0``
    lets the next lookup through at once.
    """
    return Breaker(threshold, Backoff(max(0.0, backoff_s), factor=1.0), half_open="all", clock=clock)
