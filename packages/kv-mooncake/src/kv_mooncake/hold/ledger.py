"""Blocks a producer keeps after a request finished, until its remote readers have pulled them.

A producer (prefill instance) must not free a finished request's KV blocks while a consumer may
still read them, yet must not keep them forever when a consumer dies. Each held request has a
deadline; each reader that starts a pull takes a lease it renews while the pull runs. Blocks are
freed when every expected reader said ``done`` and no other reader's lease is current (a proxy's
retry or a re-sent request makes a reader nobody expected), when the deadline passed and no lease
is current, or on abort. A reader's ``done`` tells it whether its lease held to the end: only then
are the bytes it read the request's. ``free_fn`` runs exactly once per request, outside the lock. All that is kept about a
held request is one ``HeldRequest``: freeing it removes it whole.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from kv_common.logging_utils import get_logger

logger = get_logger(__name__)

FreeReason = Literal["done", "expired", "aborted"]


class ReadEnd(NamedTuple):
    """What a reader's ``done`` did: whether its lease on these very blocks held from ``begin_read``
    to now (False: the blocks may have been freed and reused under the read), and whether it freed."""

    held_throughout: bool
    freed: bool


@dataclass(frozen=True, eq=False)
class HeldBlocks:
    """A held request's blocks: what a reader may read, and (``verify_kv``) their digests."""

    num_blocks: int = 0
    block_ids: frozenset[int] = frozenset()
    digests: dict[int, list[int]] | None = None  # block id -> one digest per head
    prompt_digest: str | None = None  # the prompt they were computed for (None: not checked)


@dataclass(eq=False)
class HeldRequest:
    """Everything kept about one held request; it goes, in one piece, when the blocks are freed."""

    expected_done: int
    deadline: float
    ttl_s: float
    created: float = 0.0
    blocks: HeldBlocks = field(default_factory=HeldBlocks)
    blocks_since: float = 0.0  # since when these very blocks are held (a re-hold may change them)
    readers_known: bool = False  # a reader announced how many readers to wait for
    readers_done: set[str] = field(default_factory=set)
    # Reader in flight (between its PullStarted and its DONE) -> its lease's deadline.
    leases: dict[str, float] = field(default_factory=dict)
    aborted: bool = False

    def has_current_lease(self, now: float) -> bool:
        return any(deadline > now for deadline in self.leases.values())

    def all_read(self) -> bool:
        return len(self.readers_done) >= self.expected_done


class DelayedFreeTracker:
    def __init__(
        self,
        free_fn: Callable[[str, FreeReason], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self._free_fn = free_fn
        self._clock = clock
        self._lock = threading.Lock()
        self._holds: dict[str, HeldRequest] = {}

    def hold(self, request_id: str, expected_done: int, ttl_s: float, blocks: HeldBlocks | None = None) -> None:
        """Keep ``request_id``'s blocks until ``expected_done`` distinct readers finish or ``ttl_s`` passes."""
        if expected_done <= 0:  # nobody will read: nothing to wait for
            self._free([(request_id, "done")])
            return
        now = self._clock()
        with self._lock:
            current = self._holds.get(request_id)
            if current is None:
                self._holds[request_id] = HeldRequest(expected_done, now + ttl_s, ttl_s, created=now,
                                                      blocks=blocks or HeldBlocks(), blocks_since=now)
                return
            # Held twice (e.g. a retried finish): keep the readers seen, widen the limits.
            current.expected_done = max(current.expected_done, expected_done)
            current.deadline = max(current.deadline, now + ttl_s)
            if blocks is not None:
                if blocks.block_ids != current.blocks.block_ids:
                    current.leases.clear()  # other blocks now: no read in flight may vouch for them
                    current.blocks_since = now
                current.blocks = blocks
            logger.debug("request %s held again", request_id)

    def expect_readers(self, request_id: str, expected_done: int) -> None:
        """The number of readers to wait for, as the first reader announces it (the producer cannot
        know it earlier); later announcements change nothing. Leaves the deadline alone: a hold a
        client shortened stays short."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is not None and not hold.readers_known:
                hold.readers_known = True
                hold.expected_done = max(hold.expected_done, expected_done)

    def blocks(self, request_id: str) -> HeldBlocks | None:
        """The blocks held for ``request_id``; None when it is not held (yet, or any more)."""
        with self._lock:
            hold = self._holds.get(request_id)
            return None if hold is None else hold.blocks

    def held_for(self, request_id: str) -> float | None:
        """Seconds these very blocks have been held for ``request_id`` (None: not held): a read that
        began earlier than that may have read other bytes."""
        now = self._clock()
        with self._lock:
            hold = self._holds.get(request_id)
            return None if hold is None else max(0.0, now - hold.blocks_since)

    def keep_alive(self, request_id: str, extend_s: float, limit_s: float) -> bool:
        """A reader will come (it waits on its side): move the deadline to ``now + extend_s``, but never
        past ``created + ttl + limit_s``. An expired or aborted hold is not revived."""
        now = self._clock()
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None or hold.aborted or (hold.deadline <= now and not hold.has_current_lease(now)):
                return False
            hold.deadline = max(hold.deadline, min(now + extend_s, hold.created + hold.ttl_s + limit_s))
            return True

    def begin_read(self, request_id: str, reader_id: str, lease_s: float | None = None) -> bool:
        """A reader starts pulling. False when the blocks are gone or going: it must not read them."""
        now = self._clock()
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None or hold.aborted or reader_id in hold.readers_done:
                return False
            if hold.deadline <= now and not hold.has_current_lease(now):
                return False  # expired, only waiting for expire() to free it
            hold.leases[reader_id] = now + (hold.ttl_s if lease_s is None else lease_s)
            return True

    def renew(self, request_id: str, ttl_s: float, reader_id: str | None = None) -> bool:
        """Extend one reader's lease (or the hold and all its leases). False when no longer held."""
        now = self._clock()
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return False
            if reader_id is not None:
                if reader_id not in hold.leases:
                    return False
                hold.leases[reader_id] = max(hold.leases[reader_id], now + ttl_s)
                return True
            hold.deadline = max(hold.deadline, now + ttl_s)
            for reader in hold.leases:
                hold.leases[reader] = max(hold.leases[reader], now + ttl_s)
            return True

    def done(self, request_id: str, reader_id: str) -> bool:
        """A reader finished. True when this call freed the blocks (it was the last expected reader)."""
        return self.end_read(request_id, reader_id).freed

    def end_read(self, request_id: str, reader_id: str) -> ReadEnd:
        """A reader finished (or gave up). Frees the blocks once every expected reader is done and no
        other reader's lease is current. ``held_throughout``: this reader's lease is still in this
        hold (a hold freed since, or replaced by a new one of the same id, does not have it)."""
        now = self._clock()
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                logger.debug("done(%s, %s) for a request not held (freed or unknown)", request_id, reader_id)
                return ReadEnd(held_throughout=False, freed=False)
            held = hold.leases.pop(reader_id, None) is not None
            hold.readers_done.add(reader_id)  # a set: a repeated done from one reader counts once
            if hold.has_current_lease(now):
                return ReadEnd(held, freed=False)  # another reader is still reading these blocks
            if hold.aborted:
                reason: FreeReason = "aborted"
            elif hold.all_read():
                reason = "done"
            else:
                return ReadEnd(held, freed=False)
            del self._holds[request_id]
        self._free([(request_id, reason)])
        return ReadEnd(held, freed=True)

    def abort(self, request_id: str, force: bool = False) -> bool:
        """Free an aborted request's blocks. Reads in flight under a current lease finish first
        (their ``done`` or lease expiry frees) unless ``force``. True when freed by this call."""
        now = self._clock()
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return False
            if not force and hold.has_current_lease(now):
                hold.aborted = True  # no new reader may begin
                return False
            del self._holds[request_id]
        self._free([(request_id, "aborted")])
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Free holds past their deadline, aborted, or read by every expected reader, with no
        current lease; returns their ids."""
        now = self._clock() if now is None else now
        freed: list[tuple[str, FreeReason]] = []
        with self._lock:
            for request_id, hold in list(self._holds.items()):
                if hold.has_current_lease(now):
                    continue
                if hold.aborted:
                    freed.append((request_id, "aborted"))
                elif hold.all_read():  # the last reader's lease lapsed: it is presumed dead
                    freed.append((request_id, "done"))
                elif hold.deadline <= now:
                    freed.append((request_id, "expired"))
                else:
                    continue
                del self._holds[request_id]
        self._free(freed)
        return [request_id for request_id, _ in freed]

    def held(self) -> set[str]:
        with self._lock:
            return set(self._holds)

    def counts(self) -> dict[str, int]:
        """What the holds keep, for the leak report: blocks, requests, readers in flight."""
        with self._lock:
            holds = list(self._holds.values())
            return {
                "held_blocks": sum(h.blocks.num_blocks for h in holds),
                "held_requests": len(holds),
                "active_reads": sum(len(h.leases) for h in holds),
            }

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._holds

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)

    def _free(self, items: list[tuple[str, FreeReason]]) -> None:
        # Outside the lock: free_fn may call back into the scheduler (or into this tracker).
        for request_id, reason in items:
            if reason == "expired":
                logger.warning("request %s: blocks held for remote readers expired, freeing", request_id)
            try:
                self._free_fn(request_id, reason)
            except Exception:  # noqa: BLE001 - one failing free must not leak the others
                logger.exception("free_fn failed for request %s (%s)", request_id, reason)
