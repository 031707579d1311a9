"""A request's blocks cut into backend calls ("passes"), and each call overlapped with the CPU work
on its neighbour: the value check of a pass runs on the caller's thread while the backend moves
the next (loads) or the previous (saves) pass on a second thread. Loads larger than the buffer
rows go in ``rounds``; ``calls_bound_s`` is how long the backend lets their calls run.

- Pass size is the backend's (``Backend.pass_bytes``): cache-sized for a memory backend, so the
  check reads bytes the copy just brought into cache; the whole request for an RPC backend, whose
  every call costs a round trip.
- The overlap pays only where the call leaves the GIL (``Backend.calls_release_gil``: Mooncake's
  calls). A backend that copies under the GIL (the embedded store) is called on the caller's
  thread (``io_executor``): beside the check, a second thread only added GIL hand-offs (measured
  ~10 % slower at 128 KiB values).
- Every call is waited for before these functions return, even after a failure: nothing a call
  writes lands in a buffer the caller has already handed back (a KV block vLLM recomputes). A
  fetch that its waiter may give up on at a deadline writes into the KV cache only through a
  ``KVWriteGate``, which the waiter closes before it reports the blocks for recompute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

from kv_common.backend import Backend

from kv_store.metadata import BlockTransfer

T = TypeVar("T")
R = TypeVar("R")


class InlineExecutor(Executor):
    """Runs each call at ``submit``, on the caller's thread; the future is done on return."""

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future[R]:
        future: Future[R] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits, as a thread would
            future.set_exception(exc)
        return future


def io_executor(calls_release_gil: bool, name: str) -> Executor:
    """The executor backend calls run on: a thread of their own when they leave the GIL (they then
    overlap the caller's check), the caller's thread otherwise."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) if calls_release_gil else InlineExecutor()


def spans(n: int, size: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``(lo, hi)`` passes of at most ``size``."""
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def blocks_per_call(value_size: int, pass_bytes: int | None, limit: int) -> int:
    """Blocks of ``value_size`` bytes per backend call: ``pass_bytes`` worth (None: no cap), at most
    ``limit`` (the buffer rows there are), at least 1."""
    per = limit if pass_bytes is None else pass_bytes // max(1, value_size)
    return max(1, min(limit, per))


def double_buffered(n: int, value_size: int, pass_bytes: int | None, slots: int) -> tuple[list[tuple[int, int]], int]:
    """Passes over ``n`` blocks through ``slots`` buffer rows, and the row offset of the second of
    two alternating halves (0 when one pass is all there is, or the rows do not halve): pass ``k``
    uses rows from ``(k % 2) * offset``, so preparing a pass never writes rows the previous call
    still reads."""
    per = blocks_per_call(value_size, pass_bytes, slots)
    if per >= n:
        return [(0, n)] if n else [], 0
    per = blocks_per_call(value_size, pass_bytes, max(1, slots // 2))
    return spans(n, per), per if 2 * per <= slots else 0


def rounds(loads: Sequence[BlockTransfer], slots: int) -> list[list[BlockTransfer]]:
    """Group loads so each round fits ``slots`` buffer rows (splitting large requests)."""
    out: list[list[BlockTransfer]] = [[]]
    used = 0
    for transfer in loads:
        n = len(transfer.block_hashes)
        for lo, hi in spans(n, slots):
            part = BlockTransfer(
                request_id=transfer.request_id,
                block_hashes=transfer.block_hashes[lo:hi],
                block_ids=[g[lo:hi] for g in transfer.block_ids],
            )
            if used + (hi - lo) > slots:
                out.append([])
                used = 0
            out[-1].append(part)
            used += hi - lo
    return [r for r in out if r]


def calls_bound_s(loads: Iterable[BlockTransfer], value_size: int, backend: Backend) -> float | None:
    """Seconds within which the backend itself ends every call moving ``loads`` (each cut into
    passes of the backend's size), by ``Backend.call_bound_s``; None when a call is unbounded."""
    total = 0.0
    for transfer in loads:
        n = len(transfer.block_hashes)
        for lo, hi in spans(n, blocks_per_call(value_size, backend.pass_bytes, n)):
            bound = backend.call_bound_s((hi - lo) * value_size)
            if bound is None:
                return None
            total += bound
    return total


class KVWriteGate:
    """The KV-cache writes of a fetch that another thread waits for, with a deadline: each write runs
    under ``lock`` while the gate is open; once the waiter closes it (``close``: it gave up and is
    about to report the blocks for recompute), no write starts, and one running is waited for (a
    copy at memory speed, never a backend call). ``is_open``: another condition under the same lock
    (an async load's give-up)."""

    def __init__(self, lock: threading.Lock | None = None, is_open: Callable[[], bool] | None = None) -> None:
        self._lock = lock or threading.Lock()
        self._closed = False
        self._is_open = is_open or (lambda: True)

    def write(self, copy: Callable[[], None]) -> bool:
        """Run ``copy`` unless closed; whether it ran."""
        with self._lock:
            if self._closed or not self._is_open():
                return False
            copy()
            return True

    def close(self) -> None:
        with self._lock:
            self._closed = True


def puts_overlapped(io: Executor, count: int, prepare: Callable[[int], T | None],
                    call: Callable[[int, T], R], finish: Callable[[int, R], None], *, overlap: bool = True,
                    proceed: Callable[[], bool] = lambda: True) -> None:
    """Saves: ``prepare(k)`` (gather, seal) on this thread while ``call(k - 1)`` (the put) runs on
    ``io``; ``finish`` on this thread, in order. ``prepare`` returning None stops (calls already
    started are still finished). With alternating buffers prepare(k) never touches call(k - 1)'s:
    call(k - 2) is finished before prepare(k) starts. ``overlap`` False (one set of buffers):
    each call is finished before the next pass is prepared. ``proceed()`` is asked again before
    each call: a pass prepared while the previous call hung is not put once the save is given up."""
    pending: tuple[int, Future] | None = None
    try:
        for k in range(count):
            if not overlap and pending is not None:
                finish(pending[0], pending[1].result())
                pending = None
            prepared = prepare(k)
            if pending is not None:
                finish(pending[0], pending[1].result())
                pending = None
            if prepared is None or not proceed():
                return
            pending = (k, io.submit(call, k, prepared))
        if pending is not None:
            finish(pending[0], pending[1].result())
            pending = None
    finally:
        if pending is not None:
            pending[1].exception()  # drain: the put may still read the buffers


def gets_overlapped(io: Executor, count: int, call: Callable[[int], R], finish: Callable[[int, R], bool]) -> None:
    """Loads: ``call(k + 1)`` (the get) runs on ``io`` while ``finish(k)`` (the check) runs here;
    ``finish`` returning False stops. Returns only once no call is in flight. With an
    ``InlineExecutor`` each pass is fetched, then checked while its bytes are still in cache."""
    if count <= 0:
        return
    if isinstance(io, InlineExecutor):
        for k in range(count):
            if not finish(k, call(k)):
                return
        return
    future: Future | None = io.submit(call, 0)
    try:
        for k in range(count):
            assert future is not None
            result = future.result()
            future = io.submit(call, k + 1) if k + 1 < count else None
            if not finish(k, result):
                return
    finally:
        if future is not None:
            future.exception()  # drain: never return while a get still writes into the buffers
