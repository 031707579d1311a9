"""Loads: whole blocks from the store into the paged cache, each value verified before use.

- In ``start_load_kv`` before the forward ("sync"), or ("async") on the loader thread while vLLM
  keeps the request out of the batch (WAITING_FOR_REMOTE_KVS); the request is reported in
  ``finished_recving`` once its blocks are in place, so the forward never waits for a get. No
  layer-wise mode: a value holds every layer of its block, so the first layer would wait for the
  whole get (measured: no better than "sync"). A missing, resized or corrupt value becomes a load
  error for that block and every later block of the request (all KV-cache groups), through the
  ``FailureLedger``; vLLM then recomputes them.
- Deadline (a slow or hung backend never stalls the engine): a load not done within
  ``load_timeout_s`` is a load error for all its blocks (vLLM recomputes them). A backend that
  ends its own calls within the deadline (``Backend.call_bound_s``: the embedded store, Mooncake
  with its timeouts under ``load_timeout_s``) loads straight into the KV blocks and is waited for:
  no call outlives the load. Any other backend loads through staging on the loader thread: a late
  fetch keeps the load staging until it returns, loads fail at once meanwhile, and a late write
  never lands in KV blocks vLLM has recomputed. Results of a late call touch neither the failure
  ledger nor the reports.
- "async" loads from such a backend go straight into the KV blocks too; a request aborted or past
  its deadline is then stopped between rounds and reported only once no call of it runs.
- Each pass is checked while the backend fetches the next one (``passes``); the pass size is the
  backend's (cache-sized in memory, the whole request over RPC). Through staging, a pass's intact
  blocks are scattered into the KV cache as soon as they are checked (while the next pass is
  fetched, its bytes still in cache), through a ``passes.KVWriteGate`` that whoever waits for the
  fetch closes when it gives up: no write starts after that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from kv_common.failure_ledger import FailureLedger
from kv_common.logging_utils import get_logger

from kv_store.config import StoreConnectorConfig
from kv_store.kv_view import CacheBuffers, KVBlockView
from kv_store.metadata import BlockTransfer, StorePlan
from kv_store.passes import (
    KVWriteGate,
    blocks_per_call,
    calls_bound_s,
    gets_overlapped,
    io_executor,
    rounds,
    spans,
)
from kv_store.staging import Staging, TrailerArea
from kv_store.store_access import StoreAccess

logger = get_logger(__name__)


@dataclass
class _Fetched:
    """Blocks of one request fetched through staging, verified and scattered into the KV cache.
    Filled on the loader thread; recorded (stats, failure ledger) only by the thread that waited
    for it."""

    transfer: BlockTransfer
    good: int  # blocks [0, good) verified (staging rows [row, row + good)) and in the KV cache
    row: int
    why: str = ""  # why block ``good`` is not usable ("" when all are)
    seconds: float = 0.0


@dataclass
class _AsyncLoad:
    """One request's load in ``load_mode`` "async", run on the loader thread while the request
    waits outside the forward (vLLM's WAITING_FOR_REMOTE_KVS). The loader appends each verified
    and scattered part to ``fetched``; ``given_up`` (set under ``StoreLoader._async_lock``) stops
    it before its next scatter, so nothing lands in the blocks once the request is reported."""

    transfer: BlockTransfer
    deadline: float | None  # time.monotonic(); None: no load_timeout_s
    future: Future | None = None  # None: failed at once (the backend is still stuck)
    fetched: list[_Fetched] = field(default_factory=list)
    given_up: str = ""  # "timeout" | "aborted" | "stalled" once given up
    aborted: bool = False  # vLLM finished (aborted) the request while it loaded
    # Straight into the KV blocks (the backend bounds its calls within the deadline): reported
    # only once no call runs, never given up in the middle of one.
    zero_copy: bool = False


class StoreLoader:
    def __init__(self, store: StoreAccess, config: StoreConnectorConfig, *, ledger: FailureLedger,
                 on_done: Callable[[], None] = lambda: None) -> None:
        self._store = store
        self._on_done = on_done  # an async load ended: news for an idle step's wait
        self.config = config
        self.ledger = ledger
        self._cache: CacheBuffers | None = None  # from register_kv_caches
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-load")
        self._io = io_executor(store.backend.calls_release_gil, "store-get")  # gets beside the check
        # A load that missed its deadline and still runs: it owns the load staging until done.
        self._late_fetch: Future | None = None
        # load_mode "async": request id -> its load, until reported in finished_recving (once).
        self._async_lock = threading.Lock()
        self._async_loads: dict[str, _AsyncLoad] = {}
        self._async_late: Future | None = None  # a load given up at its deadline that still runs

    def attach(self, cache: CacheBuffers) -> None:
        self._cache = cache

    @property
    def pending(self) -> int:
        """Async loads not yet reported."""
        return len(self._async_loads)

    # ---- fetch and verify -----------------------------------------------------------------
    def _fetch_into(self, plan_loads: Sequence[BlockTransfer], staging: Staging, gate: KVWriteGate) -> list[_Fetched]:
        """Fetch values into staging rows, verify them and scatter the intact ones into the KV
        cache through ``gate``, a pass at a time (may run on the loader thread: records nothing,
        see ``_record_fetched``). Requests beyond the staging capacity are fetched in later rounds
        by the caller."""
        assert self._cache is not None
        view = self._cache.view
        out: list[_Fetched] = []
        row = 0
        for transfer in plan_loads:
            n = len(transfer.block_hashes)
            keys = self._store.keys(transfer.block_hashes)
            values = staging.values(n, row)

            def scatter(lo: int, hi: int, transfer: BlockTransfer = transfer, row: int = row) -> bool:
                return gate.write(lambda: view.scatter(staging, transfer, row, lo, hi))

            def fetch(lo: int, hi: int, keys: list[str] = keys, values: list[memoryview] = values) -> Sequence[int]:
                return self._store.backend.batch_get_into(keys[lo:hi], values[lo:hi])

            good, why, seconds = self._fetch_checked(
                transfer, keys, values, fetch,
                lambda value, nbytes, key: self._store.seal.check(value, view.payload_size, nbytes, key),
                scatter,
            )
            out.append(_Fetched(transfer, good, row, why, seconds))
            row += n
        return out

    def _fetch_checked(self, transfer: BlockTransfer, keys: list[str], values: list[Any],
                       fetch: Callable[[int, int], Sequence[int]],
                       check: Callable[[Any, int, str], str | None],
                       landed: Callable[[int, int], bool] | None = None) -> tuple[int, str, float]:
        """Fetch ``values`` in passes of the backend's size (``fetch(lo, hi)``: the get of blocks
        ``lo:hi``) and check each pass as soon as it landed (while the next one is fetched):
        (leading intact blocks, why the next is not, seconds in the get). Stops at the first bad
        block: the blocks after it are recomputed anyway; returns only once no get is in flight.
        A get that raises is a miss (a dead store).
        ``landed(lo, hi)``: blocks ``lo:hi`` of a pass are intact (they count only if it returns
        True: the staging path's scatter, refused once the load is given up)."""
        assert self._cache is not None
        passes = spans(len(keys), blocks_per_call(self._cache.view.value_size, self._store.backend.pass_bytes,
                                                  len(keys)))
        state = _Fetched(transfer, good=0, row=0)  # its tally: leading intact blocks, why not more, get time

        def call(k: int) -> Sequence[int]:
            lo, hi = passes[k]
            t0 = time.perf_counter()
            try:
                return fetch(lo, hi)
            except Exception as exc:  # noqa: BLE001 - a dead store is a miss
                logger.warning("store get failed for %s: %s", transfer.request_id, exc)
                return [-1] * (hi - lo)
            finally:
                state.seconds += time.perf_counter() - t0

        def finish(k: int, results: Sequence[int]) -> bool:
            start = passes[k][0]
            intact = True
            for i, nbytes in enumerate(results, start):
                if nbytes < 0:
                    state.why = "miss"
                    intact = False
                    break
                problem = check(values[i], nbytes, keys[i])  # sealed for this very key
                if problem is not None:
                    state.why = f"corrupt ({problem})"
                    intact = False
                    break
                state.good += 1
            if landed is not None and state.good > start and not landed(start, state.good):
                state.good, state.why = start, "given up"
                return False
            return intact

        gets_overlapped(self._io, len(passes), call, finish)
        return state.good, state.why, state.seconds

    def _record_fetched(self, fetched: Sequence[_Fetched]) -> None:
        for f in fetched:
            self._record_get(f.transfer, f.good, f.why, f.seconds)

    def _record_get(self, transfer: BlockTransfer, good: int, why: str, seconds: float) -> None:
        """Stats for a fetch; the first bad block and all after it are reported for recompute."""
        assert self._cache is not None
        self._store.stats.record_get(good * self._cache.view.value_size, seconds)
        self._store.stats.incr("blocks_loaded", good)
        if good < len(transfer.block_hashes):
            self._fail(transfer, good, why)

    def _fail(self, transfer: BlockTransfer, good: int, why: str) -> None:
        n = len(transfer.block_hashes)
        kind = why if why in ("miss", "timeout") else "corrupt"
        self._store.stats.record_failure(kind)
        self._store.stats.incr("blocks_load_failed", n - good)
        logger.warning(
            "store load of %s: block %d of %d %s; %d block(s) reported for recompute",
            transfer.request_id, good, n, why, n - good,
        )
        self.ledger.record_failed_load(transfer.request_id, [g[good:] for g in transfer.block_ids])
        if kind == "corrupt":
            # Self-healing: drop the bad value so the recomputed block can be saved in its place
            # (the scheduler rewinds that request's saves on the "removed" report).
            try:
                self._store.backend.batch_remove(self._store.keys([transfer.block_hashes[good]]))
            except Exception as exc:  # noqa: BLE001 - best effort: it stays a miss-then-recompute
                logger.warning("store: could not remove a corrupt value: %s", exc)
        if kind != "timeout":  # a block that timed out may well be in the store
            self._store.report.add_removed(transfer.block_hashes[good])

    def _fail_all(self, loads: Sequence[BlockTransfer], already: set[str], why: str) -> None:
        for transfer in loads:
            if transfer.request_id in already:
                self.ledger.record_failed_load(transfer.request_id, transfer.block_ids)
            else:
                already.add(transfer.request_id)
                self._fail(transfer, 0, why)

    # ---- synchronous loads (before the forward) ------------------------------------------
    def busy(self) -> bool:
        """True while a fetch that missed its deadline still runs (it owns the load staging)."""
        late = self._late_fetch
        if late is None:
            return False
        if late.done():
            self._late_fetch = None
            return False
        return True

    def _fetch_bounded(
        self, loads: Sequence[BlockTransfer], staging: Staging, deadline: float | None
    ) -> list[_Fetched] | None:
        """``_fetch_into`` within ``deadline``; None when it missed it (or a late one still runs):
        its blocks are then recomputed, and what it fetches late never reaches them."""
        if self.busy():
            self._store.stats.incr("loads_skipped_backend_stalled")
            return None
        gate = KVWriteGate()
        if deadline is None:
            return self._fetch_into(loads, staging, gate)
        future = self._executor.submit(self._fetch_into, list(loads), staging, gate)
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            gate.close()  # from here on the late fetch writes only into staging
            self._late_fetch = future
            self._store.stats.incr("load_timeouts")
            logger.warning("store load not done within %.1fs: its blocks are recomputed", self.config.load_timeout_s)
            return None

    def _load_parts(self, view: KVBlockView, transfer: BlockTransfer, trailers: TrailerArea) -> int:
        """Fetch ``transfer`` straight into its KV blocks; verify; record failures. Blocks at and
        after the first bad one are reported for recompute (whatever landed in them)."""
        good, why, seconds = self._fetch_parts(view, transfer, trailers)
        self._record_get(transfer, good, why, seconds)
        return good

    def _fetch_parts(self, view: KVBlockView, transfer: BlockTransfer, trailers: TrailerArea) -> tuple[int, str, float]:
        """``_fetch_checked`` straight into the KV slices and trailers of ``transfer`` (as many
        blocks as trailers): given to the backend by address when it takes addresses (computed
        for a pass at once), else as buffers; checked over the slices either way."""
        backend = self._store.backend
        keys = self._store.keys(transfer.block_hashes)
        values = [view.block_parts(transfer, i, trailers[i]) for i in range(len(keys))]
        by_address = backend.capabilities.parts_at_address

        def fetch(lo: int, hi: int) -> Sequence[int]:
            if by_address:
                rows = view.part_rows(transfer, lo, hi, trailers.addresses(lo, hi - lo))
                return backend.batch_get_parts_at(keys[lo:hi], *rows)
            return backend.batch_get_parts(keys[lo:hi], values[lo:hi])

        return self._fetch_checked(transfer, keys, values, fetch, self._store.seal.check_parts)

    def _deadline(self) -> float | None:
        timeout = self.config.load_timeout_s
        return time.monotonic() + timeout if timeout > 0 else None

    def _waits_within(self, loads: Sequence[BlockTransfer], slots: int, deadline: float | None) -> bool:
        """True when every backend call of ``loads`` ends, by the backend's own bound, before
        ``deadline`` (None: no deadline). A late call could otherwise write into KV blocks vLLM
        is already recomputing."""
        if deadline is None:
            return True
        if self.busy():
            return False  # a late staging fetch still holds the backend: fail at once, as before
        assert self._cache is not None
        parts = [transfer for part in rounds(loads, slots) for transfer in part]
        bound = calls_bound_s(parts, self._cache.view.value_size, self._store.backend)
        return bound is not None and bound <= deadline - time.monotonic()

    def load_sync(self, plan: StorePlan) -> None:
        if self._cache is None or not plan.loads:
            return
        view, staging, trailers = self._cache.view, self._cache.staging, self._cache.trailers
        failed: set[str] = set()
        deadline = self._deadline()
        if trailers is not None and self._waits_within(plan.loads, trailers.slots, deadline):
            # Zero copy into the KV cache: without a deadline, or when the backend ends its own
            # calls before it. The calls are waited for here (never abandoned on a thread), so
            # nothing lands in a block after it is reported for recompute.
            for part in rounds(plan.loads, trailers.slots):
                for transfer in part:
                    if transfer.request_id in failed:
                        self.ledger.record_failed_load(transfer.request_id, transfer.block_ids)
                    elif self._load_parts(view, transfer, trailers) < len(transfer.block_hashes):
                        failed.add(transfer.request_id)
            return
        load_rounds = rounds(plan.loads, staging.slots)
        for k, round_loads in enumerate(load_rounds):
            todo = []
            for load in round_loads:
                if load.request_id in failed:
                    # an earlier part of this request failed: nothing after it is valid
                    self.ledger.record_failed_load(load.request_id, load.block_ids)
                else:
                    todo.append(load)
            fetched = self._fetch_bounded(todo, staging, deadline)
            if fetched is None:
                self._fail_all([p for r in load_rounds[k:] for p in r], failed, "timeout")
                return
            self._record_fetched(fetched)  # its intact blocks are in the KV cache already
            for f in fetched:
                if f.good < len(f.transfer.block_hashes):
                    failed.add(f.transfer.request_id)

    # ---- asynchronous loads (load_mode "async") -------------------------------------------
    def start_async(self, plan: StorePlan) -> None:
        """Queue each load on the loader thread and return at once: the forward never waits for
        it. Each request is reported by ``take_finished`` once its blocks are in place (or
        failed, or given up at its deadline)."""
        if self._cache is None:
            return
        for transfer in plan.loads:
            if transfer.request_id in self._async_loads:  # started when the plan was bound
                continue
            job = _AsyncLoad(transfer, self._deadline())
            trailers = self._cache.trailers
            job.zero_copy = trailers is not None and self._waits_within([transfer], trailers.slots, job.deadline)
            late = self._async_late
            if late is not None and not late.done():
                # A load given up at its deadline still holds the loader: fail this one at once
                # (reported next step) instead of queueing it behind the stuck call.
                job.given_up = "stalled"
                self._store.stats.incr("loads_skipped_backend_stalled")
            else:
                job.future = self._executor.submit(self._run_async, job)
                job.future.add_done_callback(lambda _f: self._on_done())
            self._async_loads[transfer.request_id] = job

    def _run_async(self, job: _AsyncLoad) -> None:
        """Loader thread: fetch, verify and scatter ``job`` round by round through the load
        staging (only this thread uses it in async mode). Records nothing but ``job.fetched``."""
        assert self._cache is not None
        view, staging, trailers = self._cache.view, self._cache.staging, self._cache.trailers
        if job.zero_copy and trailers is not None:
            self._run_async_parts(job, view, trailers)
            return
        # a give-up waits for a running scatter (memory speed), never for a get
        gate = KVWriteGate(self._async_lock, lambda: not job.given_up)
        for part in rounds([job.transfer], staging.slots):
            with self._async_lock:
                if job.given_up:
                    return
            fetched = self._fetch_into(part, staging, gate)
            with self._async_lock:
                if job.given_up:
                    return
                job.fetched.extend(fetched)
            if any(f.good < len(f.transfer.block_hashes) for f in fetched):
                return  # later blocks of the request are not valid after a bad one

    def _run_async_parts(self, job: _AsyncLoad, view: KVBlockView, trailers: TrailerArea) -> None:
        """Loader thread, zero copy: each round straight into the KV blocks, verified there; a
        give-up (abort, deadline) stops it between rounds."""
        for part in rounds([job.transfer], trailers.slots):
            for transfer in part:
                with self._async_lock:
                    if job.given_up:
                        return
                good, why, seconds = self._fetch_parts(view, transfer, trailers)
                with self._async_lock:
                    job.fetched.append(_Fetched(transfer, good, -1, why, seconds))
                if good < len(transfer.block_hashes):
                    return

    def take_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose async load is over, each reported exactly once: done, failed (its bad
        blocks and all after them are in the failure ledger, so vLLM recomputes only those),
        past ``load_timeout_s`` (given up: the rest is recomputed), or aborted by vLLM (its blocks
        are freed only once reported here)."""
        done: set[str] = set()
        if not self._async_loads:
            return done
        now = time.monotonic()
        for req_id, job in list(self._async_loads.items()):
            if req_id in finished_req_ids:
                job.aborted = True
            if job.future is not None and not job.future.done():
                if job.aborted:
                    why = "aborted"
                elif job.deadline is not None and now > job.deadline:
                    why = "timeout"
                else:
                    continue
                if job.zero_copy:
                    # Its calls write into the KV blocks: stop it between rounds and report it
                    # once no call runs (at once when it never started).
                    with self._async_lock:
                        job.given_up = job.given_up or why
                    if not job.future.cancel() and not job.future.done():
                        continue
                with self._async_lock:
                    if not job.future.done():
                        job.given_up = why
                if job.given_up == "timeout":
                    self._async_late = job.future
                    self._store.stats.incr("load_timeouts")
                    logger.warning("store load of %s not done within %.1fs: its blocks are recomputed",
                                   req_id, self.config.load_timeout_s)
            del self._async_loads[req_id]
            done.add(req_id)
            self._account_async(job)
        return done

    def _account_async(self, job: _AsyncLoad) -> None:
        """Stats and failure ledger for a finished async load (on the thread that reports it)."""
        with self._async_lock:
            fetched = list(job.fetched)
        self._record_fetched(fetched)  # a bad block: it and every later block of its part
        transfer = job.transfer
        covered = sum(len(f.transfer.block_hashes) for f in fetched)
        if job.aborted or covered >= len(transfer.block_hashes):
            return  # all accounted for (a bad block was reported above), or nobody reads them
        remaining = [g[covered:] for g in transfer.block_ids]  # blocks never fetched
        if fetched and fetched[-1].good < len(fetched[-1].transfer.block_hashes):
            self.ledger.record_failed_load(transfer.request_id, remaining)  # after a bad block
        elif job.given_up:  # timeout, or failed at once while the backend is stuck
            self._fail(BlockTransfer(request_id=transfer.request_id, block_hashes=transfer.block_hashes[covered:],
                                     block_ids=remaining), 0, "timeout")
        else:  # the loader raised
            error = job.future.exception() if job.future is not None else None
            logger.warning("store load of %s failed (%s): its blocks are recomputed", transfer.request_id, error)
            self._store.stats.record_failure("load_error")
            self._store.stats.incr("blocks_load_failed", len(remaining[0]) if remaining else 0)
            self.ledger.record_failed_load(transfer.request_id, remaining)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False)
