"""Waiting for the TransferEngine without spinning.

Mooncake's Python ``batch_transfer_sync_*`` and ``get_batch_transfer_status`` release the GIL and
spin on the transfer's status with no yield: on a machine with few cores the spinner competes with
both sides' TCP threads for the core the transfer needs (measured on 2 cores: a 1 MiB read 2.57 ms
spinning, 1.66 ms when the caller slept ~0.3 ms before asking; raw 32 MiB reads 0.78 GB/s spinning,
1.24 GB/s sleeping). So a read is submitted asynchronously and the caller sleeps for most of the
time the read is expected to take before it asks for the status (which then spins only for the
rest). Mooncake offers no status query that does not spin for a whole batch (``transfer_check_status``
looks at the batch's first transfer only, and after it saw a failed transfer the batch's
``get_batch_transfer_status`` never returned here), so there is one sleep, then the one status call.

Threads reading the same peer at once ask one at a time (``engine.transfer_engine._Peer.asking``): each
status call spins on a core of its own, so four pull threads asking together took the cores the
transfer itself needs (measured on 2 cores, 16 pulls of 2 MiB in flight from 4 threads: 277-443
pulls/s asking together, 588-611 one at a time). The one asking spins only until its batch is done;
the others sleep on the lock meanwhile (at most ``ASK_TURN_WAIT_S``: a status call stuck on a
stalled read answers only at Mooncake's transfer timeout), and another peer's reads never wait.

The expected time comes from a per-peer throughput estimate, learnt from finished reads. The first
guess is high (a short first sleep: sleeping too little costs some spinning, sleeping too long
costs latency), every sample and the estimate are bounded, and the sleep never passes the read's
deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

FIRST_GUESS_BYTES_PER_S = 8e9  # above any loopback TCP rate measured here: the first sleeps are short
MIN_BYTES_PER_S = 20e6  # a stalled sample (a frozen peer) must not make later sleeps seconds long
MAX_BYTES_PER_S = 200e9
SLEEP_SHARE = 0.8  # of the expected time: oversleeping delays the read, undersleeping only spins a little
MIN_SLEEP_S = 200e-6  # below this a sleep costs more than the spin it saves (a loaded core wakes us late)
MAX_SLEEP_S = 2.0  # one sleep at most: the status call is bounded by Mooncake's transfer timeout anyway
SMOOTHING = 0.3  # weight of a slower sample (a faster one is taken at once)
OVERSLEPT_S = 100e-6  # a status call that answered this fast found the read done: we slept too long
MIN_SAMPLE_BYTES = 64 << 10  # smaller reads are all fixed cost: they say nothing about throughput
PERIOD_READS = 8  # a peer never idle is sampled every this many finished reads
ASK_TURN_WAIT_S = 0.1  # at most this long behind another status call to the peer (one stuck on a stalled read)


class ThroughputEstimate:
    """One peer's read throughput, and when the reads in flight to it are expected to be done.

    The reads to a peer share its link: a read submitted behind others is expected once the ones
    before it are (``begin``). The throughput is learnt from the link's busy periods, not from one
    read's time: from when a read went to an idle peer until no read is left in flight (or until
    ``PERIOD_READS`` reads finished, for a peer that is never idle), the bytes of the reads that
    finished over the time taken. Reads of several pulls are served interleaved, all of them
    finishing near the end: one read's own time would read as a slow link, and the gaps between
    their completions as a near-infinite one. The estimate leans fast: a faster sample is taken at
    once, a slower one is smoothed, and a period with a read found done the moment we asked (we
    overslept, its time is unknown but shorter) doubles it, so one stall does not make many reads
    oversleep; a period with a failed read teaches nothing. Thread-safe."""

    def __init__(self, first_guess: float = FIRST_GUESS_BYTES_PER_S):
        self._bytes_per_s = _bounded(first_guess)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_until = 0.0  # when the reads in flight are expected to be done (time.monotonic)
        self._period = _BusyPeriod()

    @property
    def bytes_per_s(self) -> float:
        with self._lock:
            return self._bytes_per_s

    def begin(self, nbytes: int, submitted_at: float) -> float:
        """A read of ``nbytes`` was submitted at ``submitted_at``: when it is expected to be done."""
        with self._lock:
            if self._in_flight:
                start = max(submitted_at, self._busy_until)
            else:
                start = submitted_at
                self._period = _BusyPeriod(submitted_at)
            self._in_flight += 1
            self._busy_until = start + nbytes / self._bytes_per_s
            return self._busy_until

    def end(self, nbytes: int, done_at: float, ok: bool = True, overslept: bool = False) -> None:
        """A read of ``nbytes`` was waited for at ``done_at`` (``overslept``: it was done before we
        asked); a failed one teaches nothing. Its period, not its submission, times it."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            if not self._in_flight:
                self._busy_until = 0.0
            period = self._period
            period.finished(nbytes, ok, overslept)
            if self._in_flight and period.reads < PERIOD_READS:
                return
            self._period = _BusyPeriod(done_at)  # reads still in flight count in the next one
            sample = period.throughput(done_at)
            if sample is None:
                return
            if period.overslept:
                sample = max(sample, 2 * self._bytes_per_s)
            if sample >= self._bytes_per_s:
                self._bytes_per_s = _bounded(sample)
            else:
                self._bytes_per_s = _bounded((1 - SMOOTHING) * self._bytes_per_s + SMOOTHING * sample)


@dataclass
class _BusyPeriod:
    """The reads to one peer finished since it was last idle (or last sampled)."""

    start: float = 0.0
    bytes: int = 0
    reads: int = 0
    failed: bool = False
    overslept: bool = False

    def finished(self, nbytes: int, ok: bool, overslept: bool) -> None:
        self.reads += 1
        self.bytes += nbytes if ok else 0
        self.failed |= not ok
        self.overslept |= ok and overslept

    def throughput(self, now: float) -> float | None:
        """Bytes per second over the period, or None when it says nothing (a failed read, reads
        too small on average: all fixed cost, however many)."""
        elapsed = now - self.start
        if self.failed or self.bytes < MIN_SAMPLE_BYTES * self.reads or elapsed <= 0:
            return None
        return _bounded(self.bytes / elapsed)


def _bounded(bytes_per_s: float) -> float:
    return min(MAX_BYTES_PER_S, max(MIN_BYTES_PER_S, bytes_per_s))


def sleep_until_expected(expected_done: float, submitted_at: float, deadline: float | None,
                         sleep: Callable[[float], None] = time.sleep) -> float:
    """Sleep through ``SLEEP_SHARE`` of the time from ``submitted_at`` to ``expected_done``, never
    past ``deadline`` (time.monotonic); returns the seconds slept."""
    wake = submitted_at + min(MAX_SLEEP_S, SLEEP_SHARE * (expected_done - submitted_at))
    if deadline is not None:
        wake = min(wake, deadline)
    left = wake - time.monotonic()
    if left < MIN_SLEEP_S:
        return 0.0
    sleep(left)
    return left
