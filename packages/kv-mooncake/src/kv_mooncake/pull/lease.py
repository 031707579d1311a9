"""Read first, confirm after: the lease on a prefill rank's blocks, taken alongside the read.

The lease round trip (``PullStarted``) before a read cost more than the whole fixed cost a pull may
have (about 0.2 ms against a 0.3 ms target; vLLM's NIXL puts no round trip before its read). So the
PullStarted goes out, the read starts at once, and the answer is awaited once the first batch
landed. The bytes land only in the decode's own blocks and count only once confirmed:

* the Ack (lease granted, prompt digest and block ids accepted) says for how long the prefill has
  held these very blocks (``held_for_s``); the read counts only if they were held since before it
  began (else a re-hold, or bytes not yet final, may have been read) or if it began after the Ack
  came (under the lease, as before). Otherwise it is read again, now under the lease;
* a refusal (prompt digest, block ids, freed) fails the pull: what was read is never used;
* the DONE's reply (``held_throughout``) still says whether the lease lasted to the end of the read.

So a read counts only if these blocks were held from before it began until its DONE: the hold's
own guarantee (issue 23), without a round trip in front of the read.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from kv_mooncake.errors import PullFailed, SideChannelError
from kv_mooncake.wire import client as side_channel
from kv_mooncake.wire import messages as P

# Before a status call, how long in all to wait for the lease's answer (it comes in a round trip):
# taken only after a status call, it would date the hold from when that call returned (see settle).
SETTLE_S = 0.05


def lease_covers_read(read_started: float, answered_at: float, held_for_s: float) -> bool:
    """Whether blocks held for ``held_for_s`` seconds when the lease's Ack left the prefill (received
    at ``answered_at``) were held when a read began at ``read_started`` (all ``time.monotonic`` of the
    reader). The Ack left before it arrived, so ``answered_at - held_for_s`` is no earlier than when
    the hold began: conservative. A read begun after the Ack arrived is under the lease."""
    if read_started >= answered_at:
        return True
    return held_for_s >= 0 and answered_at - held_for_s <= read_started


class EarlyLease:
    """One ``PullStarted``: sent at construction, answered by :meth:`answer` (once, then cached).
    A first answer that is not an Ack in time (the hold not there yet, a lost reply) is asked again
    with ``take_lease``'s retries, until the pull's deadline."""

    def __init__(self, client: side_channel.SideChannelClient, address: str, started: P.PullStarted,
                 deadline: float, timeout_s: float, take_lease: Callable[[str, P.PullStarted, float], P.Ack]):
        self.address, self.started, self.deadline = address, started, deadline
        self._timeout_s = timeout_s
        self._take_lease = take_lease
        self._ack: P.Ack | None = None
        self._early: msgspec.Struct | None = None  # the first answer, taken while the read was in flight
        self.answered_at = 0.0
        self.read_started = 0.0
        self._pending: side_channel.PendingReply | None = None
        self._settle_until = 0.0
        try:
            self._pending = client.start(address, started)
        except SideChannelError:
            self._pending = None  # asked again, with retries, by answer()

    def reading(self) -> None:
        """A read of the blocks begins now."""
        self.read_started = time.monotonic()

    def idle(self, seconds: float) -> None:
        """Pass ``seconds`` while the read is in flight, taking the answer as soon as it is there: when
        it came bounds how young a hold may be for the read to count (``lease_covers_read``)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self._pending is None:
                time.sleep(left)
                return
            self._take_if_ready(left)

    def settle(self) -> None:
        """Before a status call: wait for the answer while it is due (at most ``SETTLE_S`` in all).
        A thread blocked in Mooncake's status call notices nothing; 16 pulls in flight from two
        prefills waited 6-20 ms there, so Acks taken after it dated reads begun well inside their
        holds as begun before them, and 12-27 % of the pulls were read twice. Waiting here costs
        nothing when the prefill answers: the first batch counts only once the answer is in."""
        if self._pending is None:
            return
        now = time.monotonic()
        if not self._settle_until:
            self._settle_until = min(now + SETTLE_S, self.deadline)
        if self._settle_until > now:
            self._take_if_ready(self._settle_until - now)

    def _take_if_ready(self, timeout_s: float) -> None:
        """Take the answer if it comes within ``timeout_s`` (woken by its arrival, not by a timer)."""
        assert self._pending is not None
        if not self._pending.ready(timeout_s):
            return
        pending, self._pending = self._pending, None
        try:
            self._early = pending.wait(0.0)
        except SideChannelError:
            self._early = None  # asked again, with retries, by answer()
        self.answered_at = pending.arrived_at or time.monotonic()  # the kernel's stamp (wire.connection)

    def answer(self) -> P.Ack:
        """The lease's Ack (raises PullFailed when refused)."""
        if self._ack is not None:
            return self._ack
        reply: msgspec.Struct | None = self._early
        answered_at = self.answered_at
        if reply is None and self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                reply = pending.wait(max(0.05, min(self._timeout_s, self.deadline - time.monotonic())))
            except SideChannelError:
                reply = None
            answered_at = pending.arrived_at or time.monotonic()
        if isinstance(reply, P.Refused) and not reply.retry:
            raise PullFailed(f"{self.address} refused the pull: {reply.reason}")
        if not isinstance(reply, P.Ack):
            reply = self._take_lease(self.address, self.started, self.deadline)
            answered_at = time.monotonic()
        self._ack, self.answered_at = reply, answered_at
        return reply

    def covers_read(self) -> bool:
        """Whether the read begun last (:meth:`reading`) counts once its DONE confirms it."""
        ack = self.answer()
        return lease_covers_read(self.read_started, self.answered_at, ack.held_for_s)

    def close(self) -> None:
        """Drop an answer nobody waited for (the DONE the pull owes ends the lease)."""
        if self._pending is not None:
            self._pending.close()
            self._pending = None
