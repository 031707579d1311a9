"""Per-peer budgets of a TransferEngine: how many reads may be queued to one peer, who reads next,
and the first contact with a peer, bounded by the reader's deadline.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

Transfer = Callable[[list[int], list[int], list[int]], int]  # one synchronous read: the engine's return code
# A read that fails faster than this did not time out: the peer refused (transfer_engine says more).
FAST_FAILURE_S = 1.0




@dataclass(eq=False)
class ReadItem:
    local: list[int]
    remote: list[int]
    lengths: list[int]
    rc: int = 0
    taken: bool = False  # in a batch the engine is reading: its bytes may still land
    done: bool = False


class PeerBudget:
    """Transfers in flight towards one peer, counted across threads and both read paths: Mooncake's
    TCP transport fails (and can hang) above its per-peer queue, so the synchronous batches and the
    asynchronous pipelines share one limit."""

    def __init__(self, limit: int):
        self.limit = limit
        self._used = 0
        self._waiting = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, give_up: float | None) -> bool:
        """Take ``n`` (at most ``limit``) slots; False when ``give_up`` (time.monotonic) passed first."""
        n = min(n, self.limit)
        with self._cond:
            self._waiting += 1
            try:
                while self._used + n > self.limit:
                    if give_up is None:
                        self._cond.wait()
                        continue
                    left = give_up - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                self._used += n
                return True
            finally:
                self._waiting -= 1

    def try_acquire(self, n: int) -> bool:
        """Take ``n`` slots if free and nobody waits for slots: a pipeline that keeps the budget
        full then completes its oldest call instead, and a second pull to the peer gets its turn."""
        n = min(n, self.limit)
        with self._cond:
            if self._waiting or self._used + n > self.limit:
                return False
            self._used += n
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= min(n, self.limit)
            self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._used


class PeerReads:
    """Reads towards one peer, batched. Threads reading from the same peer at the same time are
    served together by one ``batch_transfer_sync_read`` of at most ``limit`` transfers (Mooncake's
    TCP transport fails above its per-peer queue). One big batch runs at the engine's speed, while
    concurrent calls to one peer slow each other down (measured here: 8 concurrent calls 0.1 GB/s,
    one call of the same blocks 0.25-0.3 GB/s), and a lock per peer made concurrent pulls take turns.

    The first caller leads: it reads batches (its own and whatever is queued, in arrival order)
    until its own read is done, then hands over to a waiting caller. The engine call comes with each
    read, never kept here: kept, it made the engine, which keeps this, a reference cycle (freed by a
    later collection, whose Mooncake teardown held the GIL for 0.2-0.4 s in another worker's pulls).
    """

    def __init__(self, limit: int, budget: PeerBudget):
        self._budget = budget
        self._limit = limit
        self._cond = threading.Condition()
        self._queue: deque[ReadItem] = deque()
        self._leading = False

    def read(self, transfer: Transfer, local: list[int], remote: list[int], lengths: list[int],
             timeout_s: float | None) -> int | None:
        """The engine's return code (``transfer`` reads one batch), or None when ``timeout_s`` passed
        before the read started."""
        item = ReadItem(local, remote, lengths)
        give_up = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._queue.append(item)
            while True:
                if item.done:
                    return item.rc
                if not self._leading and not item.taken:
                    self._leading = True
                    break
                if item.taken or give_up is None:
                    self._cond.wait()  # being read: never leave while its bytes may still land
                    continue
                left = give_up - time.monotonic()
                if left <= 0:
                    self._queue.remove(item)
                    return None
                self._cond.wait(left)
        try:
            while not item.done:
                self._serve_one_batch(transfer)
        finally:
            with self._cond:
                self._leading = False
                self._cond.notify_all()
        return item.rc

    def _read(self, transfer: Transfer, local: list[int], remote: list[int], lengths: list[int]) -> int:
        self._budget.acquire(len(lengths), None)  # async batches in flight end within Mooncake's timeout
        try:
            return transfer(local, remote, lengths)
        finally:
            self._budget.release(len(lengths))

    def _serve_one_batch(self, transfer: Transfer) -> None:
        with self._cond:
            batch: list[ReadItem] = []
            n = 0
            while self._queue and (not batch or n + len(self._queue[0].lengths) <= self._limit):
                it = self._queue.popleft()
                it.taken = True
                batch.append(it)
                n += len(it.lengths)
        try:
            if len(batch) == 1:
                batch[0].rc = self._read(transfer, batch[0].local, batch[0].remote, batch[0].lengths)
            else:
                started = time.monotonic()
                rc = self._read(transfer, [a for it in batch for a in it.local], [a for it in batch for a in it.remote],
                                [x for it in batch for x in it.lengths])
                # Refused at once (an invalid read, not a stalled peer): read each alone, so one bad
                # read does not fail the others. A slow failure fails all; each caller retries.
                split = rc != 0 and time.monotonic() - started < FAST_FAILURE_S
                for it in batch:
                    it.rc = self._read(transfer, it.local, it.remote, it.lengths) if split else rc
        except BaseException:
            for it in batch:
                it.rc = it.rc or -1
            raise
        finally:
            with self._cond:
                for it in batch:
                    it.done = True
                self._cond.notify_all()


# ---- first contact ----
# Whether a peer's TransferEngine answers, asked before the first read to it, within the reader's deadline.
#
# Mooncake opens a peer's segment inside the first read's submit: a handshake with the peer whose
# answer it awaits for a fixed 60 s (its transfer timeouts do not bound it), holding the engine-wide
# lock that every submit takes. A peer that froze after it answered our side channel (a stopped
# process, a descheduled VM) therefore held the pull past its deadline, and every read to any peer
# behind it (seen in CI: pulls failed after 60 s and 121 s against a 45 s deadline). The engine's own
# probe (``send_probe``: the same handshake listener, no lock, the GIL released) runs on a thread of
# its own instead, and the reader waits for it only until its deadline: a frozen peer fails the read
# with nothing submitted. One probe per peer at a time. Once it answered, the peer is not probed again:
# Mooncake keeps the opened peer for the engine's life (its asynchronous reads never open it again),
# so a later stall is a read's, bounded by the transfer timeouts; probing again after a failed read
# would only hold reads back behind a probe still stuck on a link that came back.

Probe = Callable[[], int]  # the engine's probe of one peer: 0 when it answered


class FirstContact:
    """One peer's answer to the probe: asked until it answered once, then kept."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._answered = False
        self._probing = False
        self._last_rc = 0  # of the last probe that ended without an answer

    def answered(self, probe: Probe, give_up: float | None) -> str | None:
        """None once the peer answered (now or before); otherwise why not: its probe failed, or
        ``give_up`` (time.monotonic; None: wait for the probe's end) passed first. The engine call
        comes with each ask and is never kept: kept, the engine holding this would be a cycle."""
        if self._answered:  # every read asks: no lock once answered (a stale False only waits below)
            return None
        with self._cond:
            if self._answered:
                return None
            if not self._probing:
                self._probing = True
                threading.Thread(target=self._run, args=(probe,), name="kv-mooncake-probe", daemon=True).start()
            while self._probing:
                left = None if give_up is None else give_up - time.monotonic()
                if left is not None and left <= 0:
                    return "its TransferEngine did not answer before the read's deadline (frozen or overloaded?)"
                self._cond.wait(left)
            if self._answered:
                return None
            return f"its TransferEngine did not answer a probe (code {self._last_rc})"

    def _run(self, probe: Probe) -> None:
        rc = -1
        try:
            rc = int(probe())
        except Exception:  # noqa: BLE001 - e.g. the engine closed meanwhile: no answer, never a dead thread
            rc = -1
        finally:
            with self._cond:
                self._probing = False
                self._answered = rc == 0
                self._last_rc = rc
                self._cond.notify_all()
