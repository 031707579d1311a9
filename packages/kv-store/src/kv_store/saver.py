"""Saves: whole blocks from the paged cache into the store, off the forward's critical path.

- Queued in ``wait_for_save`` (the forward has written the blocks) and run by one background
  thread. A request with a save in flight is reported in ``finished_sending`` only when its saves
  are done; the scheduler side keeps its blocks alive until then (the pending frees).
- On a device, a save first waits for an event recorded on the forward's stream when it was queued.
- Deadline (a slow or hung backend never stalls the engine): a save not done within
  ``save_timeout_s`` is given up: its request is reported finished (vLLM frees its blocks), no
  later chunk of it is gathered, and new saves are skipped while the backend stays stuck. Results
  of a late call touch no report. A save given up while vLLM preempts its request is remembered
  until that request finishes and is reported (vLLM holds its blocks for it by then).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from kv_common import device
from kv_common.logging_utils import get_logger

from kv_store.codec import TRAILER_SIZE
from kv_store.config import StoreConnectorConfig
from kv_store.kv_view import CacheBuffers, KVBlockView
from kv_store.metadata import BlockTransfer, StorePlan
from kv_store.passes import blocks_per_call, double_buffered, io_executor, puts_overlapped, spans
from kv_store.staging import TrailerArea
from kv_store.store_access import StoreAccess

logger = get_logger(__name__)

# Where a joined value's trailer goes until its seal is written over it.
_TRAILER_ROOM = memoryview(bytes(TRAILER_SIZE))


@dataclass
class _SaveJob:
    future: Future
    submitted: float  # time.monotonic()


class StoreSaver:
    def __init__(self, store: StoreAccess, config: StoreConnectorConfig, *, writes_blocks: bool,
                 on_done: Callable[[], None] = lambda: None) -> None:
        self._store = store
        self._on_done = on_done  # a save ended: news for an idle step's wait (kv_common.idle_step)
        self.config = config
        # False on a rank whose tag another rank already writes (MLA, replicated GQA heads).
        self.writes_blocks = writes_blocks
        self._cache: CacheBuffers | None = None  # from register_kv_caches
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-save")
        self._io = io_executor(store.backend.calls_release_gil, "store-put")  # puts beside the seal
        self._lock = threading.Lock()
        self._pending: dict[str, list[_SaveJob]] = defaultdict(list)
        # Saves given up after save_timeout_s: no later chunk of them is gathered (their blocks
        # may belong to other requests by then). Held under _gather_lock while gathering.
        self._gather_lock = threading.Lock()
        self._released: dict[str, list[_SaveJob]] = {}
        # Given up before vLLM finished them (a preemption waited past the deadline): vLLM holds
        # their blocks once they finish, so each must be reported then, even with no save left.
        self._released_unreported: set[str] = set()
        self._saving_since: float | None = None  # when the running save started
        self._finished: set[str] = set()  # vLLM finished these; report once their saves are done

    def attach(self, cache: CacheBuffers) -> None:
        self._cache = cache

    def submit(self, plan: StorePlan) -> None:
        if not self.writes_blocks:
            # Nothing to write, but vLLM frees a held request only when every rank reports it
            # finished: remember it with no pending saves.
            self._hold_without_saves(plan.saves)
            return
        if self.stalled():
            blocks = sum(len(t.block_hashes) for t in plan.saves)
            self._store.stats.record_failure("save_skipped_backend_stalled")
            self._store.stats.incr("blocks_save_failed", blocks)
            logger.warning("store save of %d block(s) skipped: the backend has not finished a save in %.0fs",
                           blocks, self.config.save_timeout_s)
            self._hold_without_saves(plan.saves)
            return
        assert self._cache is not None
        view = self._cache.view
        # The forward that wrote these blocks may still run on the device: the save waits for it.
        fence = None if view.host_kv else device.record_event(view.kv_device)
        for transfer in plan.saves:
            job = _SaveJob(self._executor.submit(self._save, transfer, fence), time.monotonic())
            job.future.add_done_callback(lambda _f: self._on_done())
            with self._lock:
                self._pending[transfer.request_id].append(job)

    def _hold_without_saves(self, saves: Sequence[BlockTransfer]) -> None:
        with self._lock:
            for transfer in saves:
                self._pending.setdefault(transfer.request_id, [])

    def _parts_saves_safe(self) -> bool:
        """A zero-copy put lets the backend read the KV blocks themselves, possibly late: after a
        save was given up (save_timeout_s), from blocks vLLM gave to another request. The check
        sealed before the release catches that at load time; without one, saves use staging."""
        return self._store.seal.detects_stale_bytes or self.config.save_timeout_s <= 0

    def stalled(self) -> bool:
        """True while the running save has taken longer than ``save_timeout_s``."""
        since = self._saving_since
        timeout = self.config.save_timeout_s
        return timeout > 0 and since is not None and time.monotonic() - since > timeout

    def _save(self, transfer: BlockTransfer, fence: object = None) -> None:
        self._saving_since = time.monotonic()
        try:
            device.wait_event(fence)
            self._save_blocks(transfer)
        finally:
            self._saving_since = None

    def _save_blocks(self, transfer: BlockTransfer) -> None:
        assert self._cache is not None
        view, staging, trailers = self._cache.view, self._cache.staging, self._cache.trailers
        if transfer.request_id in self._released:
            return
        # No exists round trip first: a put of a key already stored is a success that keeps the
        # value (the Backend contract), and the scheduler asks for saves only past its hit.
        keys = self._store.keys(transfer.block_hashes)
        # trailers: the zero-copy path is on (host KV, a parts backend); the joined save needs no trailers
        if trailers is not None and self._store.backend.capabilities.owned_puts:
            self._save_joined(view, transfer, keys)
            return
        if trailers is not None and self._parts_saves_safe():
            self._save_parts(view, transfer, keys, trailers)
            return
        # Passes of the backend's size through two halves of the staging rows: gather and seal a
        # pass while the backend puts the previous one.
        passes, half = double_buffered(len(keys), view.value_size, self._store.backend.pass_bytes, staging.slots)

        def prepare(k: int) -> list[memoryview] | None:
            lo, hi = passes[k]
            row = (k % 2) * half
            with self._gather_lock:
                if transfer.request_id in self._released:
                    return None  # given up: its blocks may hold another request's KV by now
                view.gather(staging, transfer, lo, hi, row)
            values = staging.values(hi - lo, row)
            for value, key in zip(values, keys[lo:hi], strict=True):
                self._store.seal.write(value, view.payload_size, key)
            return values

        self._put_passes(view, transfer, keys, passes, half, prepare,
                         lambda k, keys, values: self._store.backend.batch_put(keys, values))

    def _save_joined(self, view: KVBlockView, transfer: BlockTransfer, keys: Sequence[str]) -> None:
        """A backend that keeps its own copy of each value (the embedded store) is handed that copy:
        each block's slices joined into a new value under the gather lock (as a staging gather),
        then sealed while it is still in cache. Sealing the KV slices first and joining them after
        read the KV twice: measured 11-13 ms against 8.6 ms per 64 MiB of 128 KiB values."""
        passes = spans(len(keys), blocks_per_call(view.value_size, self._store.backend.pass_bytes, len(keys)))

        def prepare(k: int) -> list[bytearray] | None:
            lo, hi = passes[k]
            values = []
            with self._gather_lock:
                if transfer.request_id in self._released:
                    return None
                for i in range(lo, hi):
                    value = bytearray().join(view.block_parts(transfer, i, _TRAILER_ROOM))
                    self._store.seal.write(memoryview(value), view.payload_size, keys[i])
                    values.append(value)
            return values

        backend = self._store.backend
        self._put_passes(view, transfer, keys, passes, 0, prepare,
                         lambda k, keys, values: backend.batch_put_owned(keys, values))

    def _save_parts(self, view: KVBlockView, transfer: BlockTransfer, keys: Sequence[str],
                    trailers: TrailerArea) -> None:
        # the backend reads the KV blocks themselves; the trailers alternate between two halves
        passes, half = double_buffered(len(keys), view.value_size, self._store.backend.pass_bytes, trailers.slots)

        def prepare(k: int) -> list[list[memoryview]] | None:
            lo, hi = passes[k]
            values = []
            with self._gather_lock:
                if transfer.request_id in self._released:
                    return None
                for slot, i in enumerate(range(lo, hi), (k % 2) * half):
                    parts = view.block_parts(transfer, i, trailers[slot])
                    self._store.seal.seal_parts(parts, keys[i])
                    values.append(parts)
            return values

        backend = self._store.backend
        by_address = backend.capabilities.parts_at_address

        def put(k: int, keys: list[str], values: list[list[memoryview]]) -> Sequence[bool]:
            if by_address:  # the same parts, by address: computed for the pass at once
                lo, hi = passes[k]
                rows = view.part_rows(transfer, lo, hi, trailers.addresses((k % 2) * half, hi - lo))
                return backend.batch_put_parts_at(keys, *rows)
            return backend.batch_put_parts(keys, values)

        self._put_passes(view, transfer, keys, passes, half, prepare, put)

    def _put_passes(self, view: KVBlockView, transfer: BlockTransfer, keys: Sequence[str],
                    passes: Sequence[tuple[int, int]], half: int, prepare: Callable[[int], list[Any] | None],
                    put: Callable[[int, list[str], list[Any]], Sequence[bool]]) -> None:
        """Each pass prepared here while the previous one's put runs on the I/O thread (when the
        rows alternate: ``half`` > 0). ``put(k, keys, values)``: the backend call of pass ``k``."""
        def call(k: int, values: list[Any]) -> tuple[Sequence[bool], float]:
            lo, hi = passes[k]
            return self._timed_put(transfer.request_id, list(keys[lo:hi]), values, lambda ks, vs: put(k, ks, vs))

        def finish(k: int, result: tuple[Sequence[bool], float]) -> None:
            lo, hi = passes[k]
            self._record_put(view, transfer.block_hashes[lo:hi], *result)

        puts_overlapped(self._io, len(passes), prepare, call, finish, overlap=half > 0,
                        proceed=lambda: transfer.request_id not in self._released)

    @staticmethod
    def _timed_put(request_id: str, keys: list[str], values: list[Any],
                   put: Callable[[list[str], list[Any]], Sequence[bool]]) -> tuple[Sequence[bool], float]:
        t0 = time.perf_counter()
        try:
            ok = put(keys, values)
        except Exception as exc:  # noqa: BLE001
            ok = [False] * len(keys)
            logger.warning("store put failed for %s: %s", request_id, exc)
        return ok, time.perf_counter() - t0

    def _record_put(self, view: KVBlockView, hashes: Sequence[bytes], ok: Sequence[bool], seconds: float) -> None:
        """Stats and the stored-blocks report of one put."""
        stored = [h for h, good in zip(hashes, ok, strict=True) if good]
        self._store.stats.record_put(len(stored) * view.value_size, seconds)
        self._store.stats.incr("blocks_saved", len(stored))
        if len(stored) < len(hashes):
            self._store.stats.record_failure("put_failed")
            self._store.stats.incr("blocks_save_failed", len(hashes) - len(stored))
        self._store.report.add_stored(stored)

    def wait_for(self, request_ids: Sequence[str]) -> None:
        """Block until the saves of ``request_ids`` finished (their blocks are about to be reused),
        at most until each save's deadline; a save still running then is given up."""
        timeout = self.config.save_timeout_s
        for req_id in request_ids:
            with self._lock:
                jobs = list(self._pending.get(req_id, ()))
            for job in jobs:
                try:
                    job.future.exception(timeout=max(0.0, job.submitted + timeout - time.monotonic())
                                         if timeout > 0 else None)
                except FutureTimeout:
                    self._release(req_id)
                    with self._lock:
                        self._released_unreported.add(req_id)
                    break

    def _release(self, req_id: str) -> None:
        """Give up the saves of ``req_id``: none of its blocks is read after this returns."""
        with self._gather_lock, self._lock:
            jobs = self._pending.pop(req_id, [])
            self._released[req_id] = jobs
            for job in jobs:
                job.future.cancel()
        self._store.stats.incr("save_timeouts")
        self._store.stats.record_failure("save_timeout")
        logger.warning("store save of %s not done within %.0fs: given up, its blocks are released",
                       req_id, self.config.save_timeout_s)

    def _overdue(self, jobs: Sequence[_SaveJob], now: float) -> bool:
        timeout = self.config.save_timeout_s
        return timeout > 0 and all(j.future.done() or now - j.submitted > timeout for j in jobs)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose saves are now over (done or given up): their blocks may
        be freed."""
        done: set[str] = set()
        overdue: list[str] = []
        now = time.monotonic()
        with self._lock:
            self._finished |= set(finished_req_ids)
            for req_id in list(self._finished):
                jobs = self._pending.get(req_id)
                if jobs is None:
                    self._finished.discard(req_id)  # never saved, or given up: nothing to wait for
                    if req_id in self._released_unreported:
                        self._released_unreported.discard(req_id)
                        done.add(req_id)
                    continue
                if all(j.future.done() for j in jobs):
                    del self._pending[req_id]
                    self._finished.discard(req_id)
                    self._released_unreported.discard(req_id)
                    done.add(req_id)
                elif self._overdue(jobs, now):
                    overdue.append(req_id)
            for req_id, jobs in list(self._released.items()):  # forget given-up saves once over
                if all(j.future.done() for j in jobs) and req_id not in self._finished:
                    del self._released[req_id]
        for req_id in overdue:
            self._release(req_id)  # its blocks are freed by vLLM once reported here
            with self._lock:
                self._finished.discard(req_id)
            done.add(req_id)
        return done

    def holds_requests(self) -> bool:
        """Whether a request's blocks wait for its saves (vLLM keeps stepping meanwhile)."""
        with self._lock:
            return bool(self._pending or self._released_unreported)

    def leak_report(self) -> dict[str, int]:
        with self._lock:
            pending = sum(1 for js in self._pending.values() for j in js if not j.future.done())
            held = len(self._pending) + len(self._released_unreported)
        return {"pending_saves": pending, "held_requests": held}

    def close(self, deadline: float) -> None:
        """Wait for the saves in flight until ``deadline`` (time.monotonic()), then stop."""
        with self._lock:
            futures = [j.future for js in self._pending.values() for j in js]
        for future in futures:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.warning("store worker: shutting down with saves still in flight")
                break
            try:
                future.exception(timeout=remaining)
            except Exception:  # noqa: BLE001 - timeout
                break
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False)
