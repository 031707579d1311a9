"""Thin wrapper over ``mooncake.engine.TransferEngine``: return codes become one ``TransferError``."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_common.logging_utils import get_logger
from kv_common.retry import Backoff, Retry

from kv_mooncake.engine.pacing import ASK_TURN_WAIT_S, OVERSLEPT_S, ThroughputEstimate, sleep_until_expected
from kv_mooncake.engine.peer_budgets import FAST_FAILURE_S, FirstContact, PeerBudget, PeerReads
from kv_mooncake.errors import TransferError

logger = get_logger(__name__)


_INSTALL_HINT = (
    "the Mooncake TransferEngine cannot be imported ({exc}). Install the Mooncake build for this device, "
    "one of them only: pip install 'kv-mooncake[cpu]' (CPU, plus apt-get install libibverbs1), "
    "'kv-mooncake[cuda]' (CUDA 12), 'kv-mooncake[cuda13]' or 'kv-mooncake[npu]'; "
    "python -m kv_common doctor names the build installed."
)


# Mooncake's own limits on one synchronous transfer (seconds). Left at their defaults (30 s each), a
# peer that stalls (a frozen process, a descheduled vCPU) holds one read for up to 30 s past our
# deadline; bounded per attempt, a stalled read fails early and is retried within the deadline.
_ATTEMPT_TIMEOUT_ENV = ("MC_TRANSFER_TIMEOUT", "MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
# An attempt that fails faster than this did not time out: the peer refused (gone, or the request is
# invalid). A few of those in a row end the read; timeouts are retried until the deadline. Against a
# dead peer Mooncake's TCP lane reconnects with a ~1 s back-off, so its attempts fail after 0-1.1 s;
# a stalled attempt fails after the attempt timeout: the bar sits between the two.
_FAST_FAILURE_SHARE = 0.6  # of the attempt timeout
_MAX_FAST_FAILURES = 3
# A failed read is read again until the deadline, after a pause doubling from 50 ms to 1 s; its
# ``total`` counts the fast failures in a row (a slow one, a timeout, starts the count over).
_READ_RETRY = Retry(total=_MAX_FAST_FAILURES, backoff=Backoff(0.05, 2.0, 1.0))


def _attempt_timeout_s() -> float:
    """Mooncake's limit on one transfer in this process (what the engine reads at start-up): the
    earliest of its timeouts that end a stalled transfer (another connector in the process, e.g.
    kv-store's Mooncake store client, may have set a shorter one first)."""
    def seconds(name: str) -> float:
        try:
            return float(os.environ.get(name, "30"))
        except ValueError:
            return 30.0  # unreadable: Mooncake keeps its default

    return min(seconds(name) for name in _ATTEMPT_TIMEOUT_ENV)


def bound_attempt_timeouts(attempt_timeout_s: float) -> None:
    """Set Mooncake's per-transfer timeouts for this process, unless the operator set them."""
    seconds = str(max(1, round(attempt_timeout_s)))
    for name in _ATTEMPT_TIMEOUT_ENV:
        os.environ.setdefault(name, seconds)


@dataclass(eq=False)
class _AsyncBatch:
    """One asynchronous engine call: a batch of ``read_batches``, or a part of one."""

    index: int  # the caller's batch
    local: list[int]
    remote: list[int]
    lengths: list[int]
    last: bool = True  # the batch's last part: on_batch runs after it
    bid: int | None = 0  # engine batch id while in flight; None: refused at submission
    started: float = 0.0
    expected: float = 0.0  # when it is expected to be done (0: nothing submitted to wait for)


@dataclass(eq=False)
class _Peer:
    """What the engine keeps per peer, made on its first read: the transfers in flight to it
    (``budget``), its batched synchronous reads, how long its reads take (``estimate``), and the
    turn to ask a status (``asking``, held through each status call: one thread per peer spins in
    it, see ``engine.pacing``), and whether its engine answered before the first read (``contact``)."""

    budget: PeerBudget
    reads: PeerReads
    estimate: ThroughputEstimate = field(default_factory=ThroughputEstimate)
    asking: threading.Lock = field(default_factory=threading.Lock)
    contact: FirstContact = field(default_factory=FirstContact)


def _engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT.format(exc=exc)) from exc
    return TransferEngine


class MooncakeTransferEngine:
    """One engine per worker process, P2P handshake mode (no metadata server)."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 max_inflight: int = 512, attempt_timeout_s: float | None = 10.0):
        if attempt_timeout_s is not None:
            bound_attempt_timeouts(attempt_timeout_s)  # read by the engine: set before it starts
        self._engine = _engine_class()()
        self._fast_failure_s = max(FAST_FAILURE_S, _FAST_FAILURE_SHARE * _attempt_timeout_s())
        self.host = host
        self.max_inflight = max_inflight
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError("initialize", rc, f"host={host} protocol={protocol} device={device_name!r}")
        self._registered: list[int] = []
        # Per peer: concurrent reads batched together, at most ``max_inflight`` transfers queued.
        self._peers: dict[str, _Peer] = {}
        self._peers_guard = threading.Lock()
        self._closed = False

    @property
    def rpc_address(self) -> str:
        return f"{self.host}:{self._engine.get_rpc_port()}"

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register (address, length) regions (e.g. each layer's KV tensor) for remote access."""
        if not regions:
            return
        addrs, lengths = [a for a, _ in regions], [n for _, n in regions]
        rc = self._engine.batch_register_memory(addrs, lengths)
        if rc != 0:
            raise TransferError("register_memory", rc, f"{len(regions)} regions")
        self._registered.extend(addrs)

    def register_tensors(self, tensors: Sequence[Any]) -> None:  # torch tensors
        self.register([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors])

    def _peer(self, peer: str) -> _Peer:
        with self._peers_guard:
            known = self._peers.get(peer)
            if known is None:
                budget = PeerBudget(self.max_inflight)
                reads = PeerReads(self.max_inflight, budget)
                known = self._peers[peer] = _Peer(budget, reads)
            return known

    def _contact(self, peer: str, known: _Peer, op: str, deadline: float | None) -> None:
        """Raise TransferError, with nothing submitted, unless the peer's engine answers (engine.peer_budgets)."""
        probe = getattr(self._engine, "send_probe", None)
        if probe is None:  # a Mooncake build without the probe (before 0.3.11): reads as before
            return
        why = known.contact.answered(functools.partial(probe, peer), deadline)
        if why is not None:
            raise TransferError(op, -1, f"{peer}: {why}")

    def read_blocks(
        self,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
        deadline: float | None = None,
        on_chunk: Callable[[], None] | None = None,
        on_retry: Callable[[str], None] | None = None,
    ) -> int:
        """Read ``remote -> local`` in chunks of at most ``max_inflight`` requests; returns bytes.

        ``deadline`` (time.monotonic) is checked between chunks and attempts; ``on_chunk()`` runs after
        each chunk (lease renewal). With a deadline, a failed chunk is read again (reads are
        idempotent) until the deadline, or until the peer refused a few times in a row;
        ``on_retry(reason)`` runs before each retry. Raises TransferError when a chunk cannot be read.
        """
        n = len(lengths)
        if not (len(local_addrs) == len(remote_addrs) == n):
            raise ValueError("read_blocks: address and length lists differ in size")
        total = 0
        known = self._peer(peer)
        self._contact(peer, known, "batch_transfer_sync_read", deadline)
        for start in range(0, n, self.max_inflight):
            if deadline is not None and time.monotonic() > deadline:
                raise TransferError("batch_transfer_sync_read", -1, f"deadline passed after {start}/{n} reads from {peer}")
            end = min(n, start + self.max_inflight)
            self._read_chunk(peer, known.reads, local_addrs[start:end], remote_addrs[start:end], lengths[start:end],
                             deadline, on_retry)
            total += sum(lengths[start:end])
            if on_chunk is not None:
                on_chunk()
        return total

    def _read_chunk(self, peer: str, reads: PeerReads, local: Sequence[int], remote: Sequence[int],
                    lengths: Sequence[int], deadline: float | None, on_retry: Callable[[str], None] | None,
                    fast_failures: int = 0, attempts: int = 0) -> None:
        failures = 0  # in this loop: which pause comes next
        while True:
            attempts += 1
            # Waiting for the peer's reads counts against the pull's deadline like everything else.
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            started = time.monotonic()
            result = reads.read(functools.partial(self._transfer, peer), list(local), list(remote), list(lengths),
                                wait_s)
            if result is None:
                raise TransferError("batch_transfer_sync_read", -1, f"deadline passed waiting for {peer}")
            rc = result
            if rc == 0:
                return
            took = time.monotonic() - started
            fast_failures = fast_failures + 1 if took < self._fast_failure_s else 0
            what = f"{len(lengths)} reads from {peer}, attempt {attempts} failed after {took:.1f}s"
            failures += 1
            pause = _READ_RETRY.pause(failures)
            if deadline is None or not _READ_RETRY.allows(fast_failures, deadline, pause=pause):
                raise TransferError("batch_transfer_sync_read", rc, what)
            logger.warning("Mooncake: %s; reading again", what)
            if on_retry is not None:
                on_retry(what)
            time.sleep(pause)

    def read_batches(
        self,
        peer: str,
        batches: Iterable[tuple[Sequence[int], Sequence[int], Sequence[int]]],
        deadline: float | None = None,
        on_batch: Callable[[int], None] | None = None,
        on_retry: Callable[[str], None] | None = None,
        idle: Callable[[float], None] = time.sleep,
        before_status: Callable[[], None] | None = None,
    ) -> int:
        """Read ``batches`` of ``(local_addrs, remote_addrs, lengths)`` from ``peer`` with several
        asynchronous engine calls in flight (at most ``max_inflight`` transfers per peer, shared with
        other threads and with :meth:`read_blocks`); returns bytes read.

        One synchronous call at a time leaves the link idle between calls (measured on loopback TCP,
        2048 x 16 KiB: 64-block calls one at a time 297 ms, eight in flight 146 ms). ``batches`` is
        consumed lazily, so the caller's address arithmetic overlaps the reads in flight.
        ``on_batch(i)`` runs in batch order once batch ``i``'s bytes have landed (verification,
        progress, lease renewal); an exception from it ends the read. An exception from ``batches``
        itself (a batch that cannot be built) ends it after the batches before it were read and
        reported. A failed engine call is read
        again synchronously with :meth:`read_blocks`'s retry policy (with a deadline; without one
        the read fails at once), then the pipeline goes on. Raises TransferError with
        ``batches_done``, the number of batches read in full, in order, before the failure. Never
        returns or raises while a submitted engine call may still write into local memory.
        ``idle(seconds)`` passes the time while a read is expected to be in flight (by default it
        sleeps; the puller also watches for its lease's answer meanwhile); ``before_status()`` runs
        before each status call, before the wait for the turn to ask (the puller takes its lease's
        answer there: a thread blocked in a status call notices nothing).
        """
        known = self._peer(peer)
        self._contact(peer, known, "batch_transfer_async_read", deadline)
        budget = known.budget
        inflight: deque[_AsyncBatch] = deque()
        redo: deque[_AsyncBatch] = deque()  # waited for after a failure, read again in order
        parts = self._parts(batches)
        done = total = 0
        source_error: Exception | None = None
        try:
            while True:
                item = None
                if redo:
                    item = redo.popleft()
                elif source_error is None:
                    try:
                        item = next(parts, None)
                    except Exception as exc:  # noqa: BLE001 - a batch the caller could not build
                        source_error = exc  # the batches before it are read (and reported) first
                if item is None:
                    if not inflight:
                        if source_error is not None:
                            raise source_error
                        return total
                else:
                    if deadline is not None and time.monotonic() > deadline:
                        raise TransferError("batch_transfer_async_read", -1,
                                            f"deadline passed after {done} batches from {peer}")
                    # Our own calls in flight hold budget: complete the oldest rather than wait for it.
                    if budget.try_acquire(len(item.lengths)) or (
                            not inflight and budget.acquire(len(item.lengths), deadline)):
                        try:
                            self._submit(peer, item, known.estimate)
                        except BaseException:
                            budget.release(len(item.lengths))
                            raise
                        inflight.append(item)
                        continue
                    if not inflight:
                        raise TransferError("batch_transfer_async_read", -1,
                                            f"deadline passed waiting for reads in flight to {peer}")
                    redo.appendleft(item)
                item = inflight.popleft()
                nbytes = self._complete(peer, known, item, inflight, redo, deadline, on_retry, idle, before_status)
                total += nbytes
                if item.last:
                    done += 1
                    if on_batch is not None:
                        on_batch(item.index)
        except TransferError as exc:
            exc.batches_done = done
            raise
        finally:
            while inflight:  # never leave while bytes may still land
                self._wait(known, inflight.popleft())

    def _parts(self, batches: Iterable[tuple[Sequence[int], Sequence[int], Sequence[int]]]) -> Iterator[_AsyncBatch]:
        """Each batch as engine calls of at most ``max_inflight`` transfers (the last one marked)."""
        for i, (local, remote, lengths) in enumerate(batches):
            n = len(lengths)
            if not (len(local) == len(remote) == n):
                raise ValueError(f"read_batches: batch {i}: address and length lists differ in size")
            for s in range(0, n, self.max_inflight):
                e = min(n, s + self.max_inflight)
                yield _AsyncBatch(i, list(local[s:e]), list(remote[s:e]), list(lengths[s:e]), last=e == n)
            if n == 0:
                yield _AsyncBatch(i, [], [], [], last=True)

    def _submit(self, peer: str, item: _AsyncBatch, estimate: ThroughputEstimate) -> None:
        item.started = time.monotonic()
        item.bid = self._submit_async(peer, item.local, item.remote, item.lengths) if item.lengths else 0
        if item.bid:
            item.expected = estimate.begin(sum(item.lengths), item.started)

    def _complete(self, peer: str, known: _Peer, item: _AsyncBatch, inflight: deque[_AsyncBatch],
                  redo: deque[_AsyncBatch], deadline: float | None, on_retry: Callable[[str], None] | None,
                  idle: Callable[[float], None] = time.sleep, before_status: Callable[[], None] | None = None) -> int:
        """Wait for ``item``; a failed one is read again synchronously (after every later call in
        flight was waited for and queued to be read again). Returns its bytes."""
        if self._wait(known, item, deadline, idle, before_status):
            return sum(item.lengths)
        took = time.monotonic() - item.started
        what = f"{len(item.lengths)} reads from {peer} (batch {item.index}), attempt 1 failed after {took:.1f}s"
        drained = []
        while inflight:
            drained.append(inflight.popleft())
            self._wait(known, drained[-1])
        redo.extendleft(reversed(drained))  # before a batch put back unsubmitted: they came first
        if deadline is None or time.monotonic() >= deadline:
            raise TransferError("batch_transfer_async_read", -1, what)
        logger.warning("Mooncake: %s; reading again", what)
        if on_retry is not None:
            on_retry(what)
        # The failed asynchronous attempt counts: a refusing peer ends the read after a few in all.
        self._read_chunk(peer, known.reads, item.local, item.remote, item.lengths, deadline, on_retry,
                         fast_failures=1 if took < self._fast_failure_s else 0, attempts=1)
        return sum(item.lengths)

    def _wait(self, known: _Peer, item: _AsyncBatch, deadline: float | None = None,
              idle: Callable[[float], None] = time.sleep, before_status: Callable[[], None] | None = None) -> bool:
        """Wait for ``item``'s engine call (bounded by Mooncake's per-transfer timeout); True if read.
        Sleeps through most of its expected time first: the status call spins."""
        bid, item.bid = item.bid, None
        if bid is None:  # refused at submission: nothing in flight
            known.budget.release(len(item.lengths))
            return False
        try:
            if bid == 0:
                return True
            return self._status_after_sleep(known, bid, sum(item.lengths), item.started, item.expected, deadline,
                                            idle, before_status)
        finally:
            known.budget.release(len(item.lengths))

    def _status_after_sleep(self, known: _Peer, bid: int, nbytes: int, submitted_at: float,
                            expected: float, deadline: float | None, idle: Callable[[float], None] = time.sleep,
                            before_status: Callable[[], None] | None = None) -> bool:
        """The one status call of batch ``bid``, after sleeping through most of its expected time."""
        ok = slept = False
        asked = 0.0
        try:
            slept = sleep_until_expected(expected, submitted_at, deadline, idle) > 0
            asked = time.monotonic()  # before any wait (the caller's, our turn): found done after one is no oversleep
            if before_status is not None:
                before_status()
            # The status call spins: one thread per peer at a time, but never long behind one that
            # is stuck on a stalled read (it answers only at Mooncake's transfer timeout).
            turn = known.asking.acquire(timeout=ASK_TURN_WAIT_S)
            try:
                ok = self._engine.get_batch_transfer_status([bid]) == 0
            finally:
                if turn:
                    known.asking.release()
            return ok
        finally:
            done = time.monotonic()
            known.estimate.end(nbytes, done, ok, overslept=slept and done - asked < OVERSLEPT_S)

    def _submit_async(self, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> int | None:
        bid = int(self._engine.batch_transfer_async_read(peer, local, remote, lengths))
        # 0: refused at submission; (uint64)-1: the peer's segment could not be opened.
        return None if bid <= 0 or bid >= 1 << 63 else bid

    def _transfer(self, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        """One read, synchronous to the caller: submitted asynchronously and waited for with a sleep
        (``batch_transfer_sync_read`` spins on the status for the whole read)."""
        submitted_at = time.monotonic()
        bid = self._submit_async(peer, local, remote, lengths)
        if bid is None:
            return -1
        known = self._peer(peer)
        nbytes = sum(lengths)
        expected = known.estimate.begin(nbytes, submitted_at)
        return 0 if self._status_after_sleep(known, bid, nbytes, submitted_at, expected, None) else -1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._registered:
            rc = self._engine.batch_unregister_memory(self._registered)
            if rc != 0:
                logger.warning("Mooncake: unregister_memory returned %d", rc)
            self._registered = []
