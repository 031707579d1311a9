"""The hold ledger: blocks a producer keeps after a request finished, until its remote readers
have pulled them. Pure state (no sockets, no messages): one record per held request, one lock, and
every message a reader sends is one call here (``start_read``, ``renew_read``, ``finish_read``,
``free_now``, ``keep_hold``), so no message can see a request half-updated. The responder
(``hold.responder``) turns messages into these calls and their results into replies.

A producer (prefill instance) must not free a finished request's KV blocks while a consumer may
still read them, yet must not keep them forever when a consumer dies. Each held request has a
deadline; each reader that starts a pull takes a lease it renews while the pull runs. Blocks are
freed when every expected reader said ``done`` and no other reader's lease is current (a proxy's
retry or a re-sent request makes a reader nobody expected), when the deadline passed and no lease
is current, or on abort. A reader's ``done`` tells it whether its lease held to the end: only then
are the bytes it read the request's. ``free_fn`` runs exactly once per request, outside the lock. All that is kept about a
held request is one ``HeldRequest``: freeing it removes it whole.

Messages may overtake the hold they are about (the scheduler hands the hold over one step after the
decode may have heard of it): a DONE or FreeNow for a request not held yet is remembered and applied
when the hold comes. What outlives a hold is bounded (``RECENT`` requests): why it was freed (a late
reader is told "already freed", not "not held yet"), and which readers' DONE confirmed their lease (a
repeated DONE gets the same answer).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from kv_common.logging_utils import get_logger

logger = get_logger(__name__)

FreeReason = Literal["done", "expired", "aborted"]
RECENT = 4096  # remembered freed / overtaken / confirmed requests (bounded)


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

    def announce_readers(self, expected_done: int) -> None:
        """The number of readers to wait for, as the first reader announces it (the producer cannot
        know it earlier); later announcements change nothing."""
        if not self.readers_known:
            self.readers_known = True
            self.expected_done = max(self.expected_done, expected_done)

    def settled(self, now: float) -> FreeReason | None:
        """Why the blocks may go now that a reader finished (None: they stay)."""
        if self.has_current_lease(now):
            return None  # another reader is still reading these blocks
        if self.aborted:
            return "aborted"
        return "done" if self.all_read() else None


@dataclass
class Overtaken:
    """The DONEs / FreeNow that came before their request's hold, applied when the hold comes."""

    readers_done: set[str] = field(default_factory=set)
    expected_readers: int = 1  # as those DONEs announced it
    free_now: bool = False


class NotHeld(NamedTuple):
    """A reader's message about a request this rank does not hold: ``freed_reason`` when it was
    freed (the reader is too late), None when it is not held yet (the reader may retry)."""

    freed_reason: str | None


class ReadRefused(NamedTuple):
    """A reader asked for what it may not read (blocks not held for the request, another prompt)."""

    reason: str  # for the reader
    detail: str  # for this side's log


class ReadGranted(NamedTuple):
    blocks: HeldBlocks
    held_for_s: float  # how long these very blocks have been held: a read begun earlier read others


ReadStart = ReadGranted | ReadRefused | NotHeld


class HoldLedger:
    """What one prefill rank holds for its readers, under one lock."""

    def __init__(
        self,
        free_fn: Callable[[str, FreeReason], None] = lambda request_id, reason: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._free_fn = free_fn
        self._clock = clock
        self._lock = threading.Lock()
        self._holds: dict[str, HeldRequest] = {}
        self._freed: set[str] = set()  # freed since the last ``take_freed`` (vLLM's finished_sending)
        self._recently_freed: OrderedDict[str, FreeReason] = OrderedDict()  # request -> why
        self._overtaken: OrderedDict[str, Overtaken] = OrderedDict()
        # request -> readers whose DONE found their lease intact: a repeated DONE (its first answer
        # came too late) gets the same answer, also after that DONE freed the blocks.
        self._confirmed: OrderedDict[str, set[str]] = OrderedDict()

    # ---- holds -------------------------------------------------------------------------------
    def hold(self, request_id: str, expected_done: int, ttl_s: float, blocks: HeldBlocks | None = None) -> None:
        """Keep ``request_id``'s blocks until ``expected_done`` distinct readers finish or ``ttl_s``
        passes. DONEs and a FreeNow that came before the hold apply now, in the same step."""
        now = self._clock()
        with self._lock:
            overtaken = self._overtaken.pop(request_id, None)
            self._confirmed.pop(request_id, None)  # a new hold: no read of it is confirmed yet
            if overtaken is not None:
                expected_done = max(expected_done, overtaken.expected_readers)
            current = self._holds.get(request_id)
            if expected_done <= 0:  # nobody will read: nothing to wait for
                freed = [self._release(request_id, "done")]
            elif current is not None:  # held twice (a retried finish): nothing overtook a hold in place
                self._hold_again(request_id, current, expected_done, ttl_s, blocks, now)
                freed = []
            else:
                hold = self._holds[request_id] = HeldRequest(expected_done, now + ttl_s, ttl_s, created=now,
                                                             blocks=blocks or HeldBlocks(), blocks_since=now)
                freed = self._apply(request_id, hold, overtaken)
        self._free(freed)

    @staticmethod
    def _hold_again(request_id: str, current: HeldRequest, expected_done: int, ttl_s: float,
                    blocks: HeldBlocks | None, now: float) -> None:
        """Keep the readers seen, widen the limits."""
        current.expected_done = max(current.expected_done, expected_done)
        current.deadline = max(current.deadline, now + ttl_s)
        if blocks is not None:
            if blocks.block_ids != current.blocks.block_ids:
                current.leases.clear()  # other blocks now: no read in flight may vouch for them
                current.blocks_since = now
            current.blocks = blocks
        logger.debug("request %s held again", request_id)

    def _apply(self, request_id: str, hold: HeldRequest, overtaken: Overtaken | None) -> list[tuple[str, FreeReason]]:
        """Under the lock: the messages that overtook a new ``hold``, as if they came after it (it
        has no lease yet: nothing keeps it once they say so)."""
        if overtaken is None:
            return []
        if overtaken.readers_done:  # their count of readers is the one announced
            hold.announce_readers(overtaken.expected_readers)
            hold.readers_done |= overtaken.readers_done
            if hold.all_read():
                return [self._release(request_id, "done")]
        return [self._release(request_id, "aborted")] if overtaken.free_now else []

    def expect_readers(self, request_id: str, expected_done: int) -> None:
        """``HeldRequest.announce_readers`` for a held request. Leaves the deadline alone: a hold a
        client shortened stays short."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is not None:
                hold.announce_readers(expected_done)

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
            return self._keep_alive(self._holds.get(request_id), extend_s, limit_s, now)

    @staticmethod
    def _keep_alive(hold: HeldRequest | None, extend_s: float, limit_s: float, now: float) -> bool:
        if hold is None or hold.aborted or (hold.deadline <= now and not hold.has_current_lease(now)):
            return False
        hold.deadline = max(hold.deadline, min(now + extend_s, hold.created + hold.ttl_s + limit_s))
        return True

    def begin_read(self, request_id: str, reader_id: str, lease_s: float | None = None) -> bool:
        """A reader starts pulling. False when the blocks are gone or going: it must not read them."""
        now = self._clock()
        with self._lock:
            return self._begin_read(self._holds.get(request_id), reader_id, lease_s, now)

    @staticmethod
    def _begin_read(hold: HeldRequest | None, reader_id: str, lease_s: float | None, now: float) -> bool:
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
            return self._renew(self._holds.get(request_id), ttl_s, reader_id, now)

    @staticmethod
    def _renew(hold: HeldRequest | None, ttl_s: float, reader_id: str | None, now: float) -> bool:
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
            end, freed = self._end_read(request_id, reader_id, now)
        self._free(freed)
        return end

    def _end_read(self, request_id: str, reader_id: str, now: float) -> tuple[ReadEnd, list[tuple[str, FreeReason]]]:
        hold = self._holds.get(request_id)
        if hold is None:
            logger.debug("done(%s, %s) for a request not held (freed or unknown)", request_id, reader_id)
            return ReadEnd(held_throughout=False, freed=False), []
        held = hold.leases.pop(reader_id, None) is not None
        hold.readers_done.add(reader_id)  # a set: a repeated done from one reader counts once
        reason = hold.settled(now)
        if reason is None:
            return ReadEnd(held, freed=False), []
        return ReadEnd(held, freed=True), [self._release(request_id, reason)]

    def abort(self, request_id: str, force: bool = False) -> bool:
        """Free an aborted request's blocks. Reads in flight under a current lease finish first
        (their ``done`` or lease expiry frees) unless ``force``. True when freed by this call."""
        now = self._clock()
        with self._lock:
            freed = self._abort(request_id, force, now)
        self._free(freed)
        return bool(freed)

    def _abort(self, request_id: str, force: bool, now: float) -> list[tuple[str, FreeReason]]:
        hold = self._holds.get(request_id)
        if hold is None:
            return []
        if not force and hold.has_current_lease(now):
            hold.aborted = True  # no new reader may begin
            return []
        return [self._release(request_id, "aborted")]

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
                    freed.append(self._release(request_id, "aborted"))
                elif hold.all_read():  # the last reader's lease lapsed: it is presumed dead
                    freed.append(self._release(request_id, "done"))
                elif hold.deadline <= now:
                    freed.append(self._release(request_id, "expired"))
        self._free(freed)
        return [request_id for request_id, _ in freed]

    def take_freed(self) -> set[str]:
        """Requests freed since the last call (expired holds included)."""
        self.expire()
        with self._lock:
            freed, self._freed = self._freed, set()
        return freed

    # ---- the readers' messages: one call each --------------------------------------------------
    def start_read(self, request_id: str, reader_id: str, *, expected_readers: int, block_ids: Collection[int],
                   prompt_digest: str, lease_s: float) -> ReadStart:
        """A reader's PullStarted: it may read only blocks held for that very request, computed for
        its prompt; then it holds a lease of ``lease_s``."""
        now = self._clock()
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is not None:
                refused = _block_refusal(request_id, hold.blocks, block_ids) or \
                    _prompt_refusal(request_id, hold.blocks, prompt_digest)
                if refused is not None:
                    return refused
                hold.announce_readers(expected_readers)
                if self._begin_read(hold, reader_id, lease_s, now):
                    return ReadGranted(hold.blocks, max(0.0, now - hold.blocks_since))
            return NotHeld(self._recently_freed.get(request_id))

    def renew_read(self, request_id: str, reader_id: str, lease_s: float) -> NotHeld | None:
        """A reader's LeaseRenew (None: renewed)."""
        now = self._clock()
        with self._lock:
            if self._renew(self._holds.get(request_id), lease_s, reader_id, now):
                return None
            return NotHeld(self._recently_freed.get(request_id))

    def keep_hold(self, request_id: str, extend_s: float, limit_s: float) -> NotHeld | None:
        """A decode's HoldKeepAlive (None: kept)."""
        now = self._clock()
        with self._lock:
            if self._keep_alive(self._holds.get(request_id), extend_s, limit_s, now):
                return None
            return NotHeld(self._recently_freed.get(request_id))

    def finish_read(self, request_id: str, reader_id: str, expected_readers: int) -> bool:
        """A reader's PullDone: whether it read under a lease that held to this DONE (this one, or
        the same DONE sent before). A DONE before the hold is kept for it."""
        now = self._clock()
        freed: list[tuple[str, FreeReason]] = []
        with self._lock:
            hold = self._holds.get(request_id)
            held_throughout = False
            if hold is not None:
                hold.announce_readers(expected_readers)
                end, freed = self._end_read(request_id, reader_id, now)
                held_throughout = end.held_throughout
            elif request_id not in self._recently_freed:
                overtaken = self._overtaken_by(request_id)
                overtaken.readers_done.add(reader_id)
                overtaken.expected_readers = max(overtaken.expected_readers, expected_readers)
            readers = self._confirmed.get(request_id)
            if held_throughout:
                if readers is None:
                    readers = self._confirmed[request_id] = set()
                    _bound(self._confirmed)
                readers.add(reader_id)
            confirmed = readers is not None and reader_id in readers
        self._free(freed)
        return confirmed

    def free_now(self, request_id: str) -> None:
        """A decode's FreeNow: nobody will read (reads under a current lease finish first). Before
        the hold, kept for it."""
        now = self._clock()
        with self._lock:
            if request_id in self._holds:
                freed = self._abort(request_id, False, now)
            else:
                freed = []
                if request_id not in self._recently_freed:
                    self._overtaken_by(request_id).free_now = True
        self._free(freed)

    def freed_reason(self, request_id: str) -> str | None:
        with self._lock:
            return self._recently_freed.get(request_id)

    # ---- what is held --------------------------------------------------------------------------
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

    def _overtaken_by(self, request_id: str) -> Overtaken:
        """Under the lock: what overtook the hold of ``request_id`` so far (bounded)."""
        overtaken = self._overtaken.get(request_id)
        if overtaken is None:
            overtaken = self._overtaken[request_id] = Overtaken()
            _bound(self._overtaken)
        return overtaken

    def _release(self, request_id: str, reason: FreeReason) -> tuple[str, FreeReason]:
        """Under the lock: forget the hold and remember why, in the same step (a message that finds
        it gone finds the reason)."""
        self._holds.pop(request_id, None)
        self._freed.add(request_id)
        self._recently_freed[request_id] = reason
        _bound(self._recently_freed)
        return request_id, reason

    def _free(self, items: list[tuple[str, FreeReason]]) -> None:
        # Outside the lock: free_fn may call back into the scheduler (or into this ledger).
        for request_id, reason in items:
            if reason == "expired":
                logger.warning("request %s: blocks held for remote readers expired, freeing", request_id)
            try:
                self._free_fn(request_id, reason)
            except Exception:  # noqa: BLE001 - one failing free must not leak the others
                logger.exception("free_fn failed for request %s (%s)", request_id, reason)


def _bound(recent: OrderedDict) -> None:
    while len(recent) > RECENT:
        recent.popitem(last=False)


def _block_refusal(request_id: str, blocks: HeldBlocks, block_ids: Collection[int]) -> ReadRefused | None:
    """A reader may only read blocks this rank holds for that very request."""
    wanted = set(block_ids)
    bad = sorted(wanted - blocks.block_ids) if wanted else None
    if bad is not None and not bad:
        return None
    what = "no block ids" if bad is None else f"block ids {bad[:8]}{'...' if len(bad) > 8 else ''}"
    return ReadRefused(f"request {request_id}: {what} not held for this request", f"{what} not held for it")


def _prompt_refusal(request_id: str, blocks: HeldBlocks, prompt_digest: str) -> ReadRefused | None:
    """A reader reads only the prompt the blocks were computed for (kv_transfer_params can be forged
    to pass the decode's own check). The held digest is not echoed to the reader: it would let a
    stranger confirm a guess of another user's prompt."""
    if blocks.prompt_digest is None:
        return None  # a hold nobody computed a digest for
    if prompt_digest and prompt_digest == blocks.prompt_digest:
        return None
    return ReadRefused(f"request {request_id}: the reader's prompt_digest {prompt_digest or 'missing'!r} is not "
                       "the held prompt's", f"prompt digest {prompt_digest!r}, the request's {blocks.prompt_digest!r}")
