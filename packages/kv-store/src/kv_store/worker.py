"""Worker side: whole KV blocks between the paged cache and the store.

- ``register_kv_caches``: learns the layout. CPU layout per layer is
  ``[num_blocks, num_kv_heads, block_size, 2*head_size]``; any layout whose first dimension is the
  block works, since whole blocks move.
- Values: one per block, all layers concatenated in registration order, then a checksum trailer
  (``codec``). Gathers and scatters go through a staging buffer registered with the backend once.
- Devices: every access to KV memory goes through ``kv_common.device``. KV caches in host memory
  (CPU) are read and written in place as bytes; on cuda / npu the blocks are gathered into pinned
  host staging (and scattered back) by the device's copy engine, and the copy's event is waited
  for before a host buffer is read, reused or handed to a backend. A background save first waits
  for an event recorded on the forward's stream when the save was queued.
- Zero-copy "parts" path: a backend that also offers ``batch_put_parts(keys, parts)`` and
  ``batch_get_parts(keys, parts)`` (each value given as a list of buffers: one block slice per
  layer, then its 16-byte trailer) moves values straight between the paged KV cache and the store:
  no staging copy, the checksum computed and verified over the KV slices in place. The worker
  registers every layer's KV tensor with such a backend (``register_buffer``).
- Loads: in ``start_load_kv`` before the forward ("sync"), or ("async") on the loader thread
  while vLLM keeps the request out of the batch (WAITING_FOR_REMOTE_KVS); the request is reported
  in ``finished_recving`` once its blocks are in place, so the forward never waits for a get. No
  layer-wise mode: a value holds every layer of its block, so the first layer would wait for the
  whole get (measured: no better than "sync"). A missing, resized or corrupt value
  becomes a load error for that block and every later block of the request (all KV-cache groups),
  through the ``FailureLedger``; vLLM then recomputes them.
- Saves: queued in ``wait_for_save`` (the forward has written the blocks) and run by one background
  thread. A request with a save in flight is reported in ``finished_sending`` only when its saves
  are done; the scheduler side keeps its blocks alive until then.
- Deadlines (a slow or hung backend never stalls the engine): a load not done within
  ``load_timeout_s`` is a load error for all its blocks (vLLM recomputes them). The late fetch
  keeps the load staging until it returns, and loads fail at once meanwhile; with a deadline loads
  always go through staging, so a late write can never land in KV blocks vLLM has recomputed.
  A save not done within ``save_timeout_s`` is given up: its request is reported finished (vLLM
  frees its blocks), no later chunk of it is gathered, and new saves are skipped while the backend
  stays stuck. Results of a late call touch neither the failure ledger nor the reports.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch
from kv_common import device
from kv_common.backend import Backend
from kv_common.failure_ledger import FailureLedger
from kv_common.logging_utils import get_logger

from kv_store import codec
from kv_store import keys as keys_mod
from kv_store.config import StoreConnectorConfig
from kv_store.metadata import BlockTransfer, StorePlan, StoreReport
from kv_store.stats import StoreStats

logger = get_logger(__name__)


@dataclass
class _Layer:
    name: str
    blocks: torch.Tensor  # uint8 view [num_blocks, bytes_per_block]
    offset: int  # where this layer's bytes start inside a value
    nbytes: int
    group: int
    flat: memoryview | None = None  # the layer's whole KV tensor as bytes (parts path)

    def block(self, block_id: int) -> memoryview:
        assert self.flat is not None
        return self.flat[block_id * self.nbytes : (block_id + 1) * self.nbytes]


class _Staging:
    """``slots`` contiguous value-sized buffers, registered with the backend once."""

    def __init__(self, value_size: int, total_bytes: int, backend: Backend, kv_device: object = "cpu") -> None:
        self.value_size = value_size
        self.slots = max(1, total_bytes // value_size)
        self.tensor = device.host_buffer(self.slots * value_size, kv_device)  # pinned for a device
        self.view = device.host_bytes(self.tensor)
        self.rows = self.tensor.view(self.slots, value_size)
        self._backend = backend
        backend.register_buffer(self.view)

    def values(self, n: int) -> list[memoryview]:
        vs = self.value_size
        return [self.view[i * vs : (i + 1) * vs] for i in range(n)]

    def close(self) -> None:
        try:
            self._backend.unregister_buffer(self.view)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass


@dataclass
class _Fetched:
    """Blocks fetched into staging for one request, waiting to be scattered. Filled on the
    loader thread; recorded (stats, failure ledger) only by the thread that waited for it."""

    transfer: BlockTransfer
    good: int  # blocks [0, good) verified in staging rows [row, row + good)
    row: int
    why: str = ""  # why block ``good`` is not usable ("" when all are)
    seconds: float = 0.0


@dataclass
class _AsyncLoad:
    """One request's load in ``load_mode`` "async", run on the loader thread while the request
    waits outside the forward (vLLM's WAITING_FOR_REMOTE_KVS). The loader appends each verified
    and scattered part to ``fetched``; ``given_up`` (set under ``StoreWorker._async_lock``) stops
    it before its next scatter, so nothing lands in the blocks once the request is reported."""

    transfer: BlockTransfer
    deadline: float | None  # time.monotonic(); None: no load_timeout_s
    future: Future | None = None  # None: failed at once (the backend is still stuck)
    fetched: list[_Fetched] = field(default_factory=list)
    given_up: str = ""  # "timeout" | "aborted" | "stalled" once given up
    aborted: bool = False  # vLLM finished (aborted) the request while it loaded


@dataclass
class _SaveJob:
    future: Future
    submitted: float  # time.monotonic()


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(i + size, n)) for i in range(0, n, size)]


class StoreWorker:
    def __init__(
        self,
        *,
        backend: Backend,
        namespace: str,
        rank_tag: str,
        config: StoreConnectorConfig,
        layer_groups: dict[str, int] | None = None,
        stats: StoreStats | None = None,
        ledger: FailureLedger | None = None,
        writes_blocks: bool = True,
        host_kv: bool | None = None,
    ) -> None:
        """``host_kv``: whether the KV caches are host memory (None: decided from their device).
        False forces the device copy path (tests prove it on CPU with guard tensors)."""
        self.backend = backend
        self.namespace = namespace
        self.rank_tag = rank_tag
        # False on a rank whose tag another rank already writes (MLA, replicated GQA heads).
        self.writes_blocks = writes_blocks
        self.config = config
        self.layer_groups = dict(layer_groups or {})
        self.stats = stats if stats is not None else StoreStats()
        self.ledger = ledger if ledger is not None else FailureLedger()
        self._mac_key = codec.mac_key_from_env(config.mac_key_env)  # fails at start-up when missing
        # 64-bit digest of this worker's layout (``manifest.layout_tag``), set by the connector
        # before the first step: sealed into every value and checked on every load (``codec``).
        self.layout_tag = 0
        self._layers: list[_Layer] = []
        self._host_kv_override = host_kv
        self.host_kv = True
        self.kv_device: object = "cpu"
        self._layer_index: dict[str, int] = {}
        self.payload_size = 0
        self.value_size = 0
        self._save_staging: _Staging | None = None
        self._load_staging: _Staging | None = None
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-save")
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-load")
        self._lock = threading.Lock()
        self._pending_saves: dict[str, list[_SaveJob]] = defaultdict(list)
        # Saves given up after save_timeout_s: no later chunk of them is gathered (their blocks
        # may belong to other requests by then). Held under _gather_lock while gathering.
        self._gather_lock = threading.Lock()
        self._released: dict[str, list[_SaveJob]] = {}
        self._saving_since: float | None = None  # when the running save started
        # A load that missed its deadline and still runs: it owns the load staging until done.
        self._late_fetch: Future | None = None
        self._finished: set[str] = set()  # vLLM finished these; report once their saves are done
        # load_mode "async": request id -> its load, until reported in finished_recving (once).
        self._async_lock = threading.Lock()
        self._async_loads: dict[str, _AsyncLoad] = {}
        self._async_late: Future | None = None  # a load given up at its deadline that still runs
        self._report = StoreReport()
        self._closed = False
        # Zero-copy parts path (see module docstring); decided for good in register_kv_caches.
        self._parts = callable(getattr(backend, "batch_put_parts", None)) and callable(
            getattr(backend, "batch_get_parts", None)
        )
        self._registered_kv: list[memoryview] = []
        self._save_trailers: memoryview | None = None
        self._load_trailers: memoryview | None = None
        self._trailer_tensors: list[torch.Tensor] = []

    # ---- layout ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        offset = 0
        num_blocks = None
        tensors = list(kv_caches.values())
        self.kv_device = tensors[0].device if tensors else "cpu"
        auto_host = all(device.is_host(t) for t in tensors)
        self.host_kv = auto_host if self._host_kv_override is None else (self._host_kv_override and auto_host)
        if not self.host_kv:
            self._parts = False  # backends register host memory: device KV always goes through staging
        for name, tensor in kv_caches.items():
            if not tensor.is_contiguous():
                raise ValueError(f"KV cache of layer {name} is not contiguous: cannot move whole blocks")
            if num_blocks is None:
                num_blocks = tensor.shape[0]
            elif tensor.shape[0] != num_blocks:
                raise ValueError(f"layer {name} has {tensor.shape[0]} blocks, others {num_blocks}")
            blocks = tensor.view(torch.uint8).reshape(tensor.shape[0], -1)
            nbytes = blocks.shape[1]
            self._layer_index[name] = len(self._layers)
            flat = device.host_bytes(blocks) if self.host_kv else None  # host: blocks move as memcpy
            self._layers.append(_Layer(name, blocks, offset, nbytes, self.layer_groups.get(name, 0), flat))
            offset += nbytes
        self.payload_size = offset
        self.value_size = offset + codec.TRAILER_SIZE
        self._save_staging = _Staging(self.value_size, self.config.staging_bytes, self.backend, self.kv_device)
        self._load_staging = _Staging(self.value_size, self.config.staging_bytes, self.backend, self.kv_device)
        if self._parts:
            self._parts = self._setup_parts(kv_caches)
        logger.info(
            "store worker: %d layers, %d bytes per block value, %d staging slots, %s path",
            len(self._layers), self.value_size, self._save_staging.slots,
            "zero-copy parts" if self._parts else "staging",
        )

    def _setup_parts(self, kv_caches: dict[str, torch.Tensor]) -> bool:
        """Register the KV tensors and two trailer areas; False (staging path) when it fails."""
        slots = self._save_staging.slots if self._save_staging is not None else 1
        seen: set[tuple[int, int]] = set()
        try:
            for layer in self._layers:
                span = (device.data_ptr(layer.blocks), layer.blocks.numel())
                if span not in seen:  # layers may share one allocation
                    seen.add(span)
                    assert layer.flat is not None  # every layer has one (register_kv_caches)
                    self.backend.register_buffer(layer.flat)
                    self._registered_kv.append(layer.flat)
            for _ in range(2):
                tensor = torch.zeros(slots * codec.TRAILER_SIZE, dtype=torch.uint8)
                view = device.host_bytes(tensor)
                self.backend.register_buffer(view)
                self._registered_kv.append(view)
                self._trailer_tensors.append(tensor)
            self._save_trailers, self._load_trailers = self._registered_kv[-2], self._registered_kv[-1]
            return True
        except Exception as exc:  # noqa: BLE001 - e.g. overlapping registrations: use staging
            logger.warning("store worker: zero-copy path unavailable (%s); using staging buffers", exc)
            self._unregister_parts()
            return False

    def _unregister_parts(self) -> None:
        for view in self._registered_kv:
            try:
                self.backend.unregister_buffer(view)
            except Exception:  # noqa: BLE001 - best effort
                pass
        self._registered_kv = []

    def _block_parts(self, transfer: BlockTransfer, i: int, trailers: memoryview, slot: int) -> list[memoryview]:
        parts = [layer.block(transfer.block_ids[layer.group][i]) for layer in self._layers]
        ts = codec.TRAILER_SIZE
        parts.append(trailers[slot * ts : (slot + 1) * ts])
        return parts

    def _keys(self, hashes: Sequence[bytes]) -> list[str]:
        return keys_mod.block_keys(self.namespace, self.rank_tag, hashes)

    # ---- gather / scatter -----------------------------------------------------------------
    def _gather(self, staging: _Staging, transfer: BlockTransfer, lo: int, hi: int) -> None:
        """Blocks ``lo:hi`` of ``transfer`` into staging rows ``0:hi-lo``; the rows are ready to
        read when this returns (a device copy is waited for)."""
        view, vs = staging.view, staging.value_size
        events = []
        for layer in self._layers:
            ids = transfer.block_ids[layer.group]
            if not self.host_kv:
                rows = staging.rows[: hi - lo, layer.offset : layer.offset + layer.nbytes]
                events.append(device.gather_rows(rows, layer.blocks, list(ids[lo:hi])))
                continue
            for j, i in enumerate(range(lo, hi)):
                start = j * vs + layer.offset
                view[start : start + layer.nbytes] = layer.block(ids[i])
        for event in events:
            device.wait_event(event)

    def _scatter_layer(self, layer: _Layer, staging: _Staging, transfer: BlockTransfer, row: int, n: int) -> None:
        """Staging rows ``row:row+n`` into the layer's blocks; staging may be reused on return."""
        ids = transfer.block_ids[layer.group]
        if n <= 0:
            return
        if not self.host_kv:
            rows = staging.rows[row : row + n, layer.offset : layer.offset + layer.nbytes]
            device.wait_event(device.scatter_rows(layer.blocks, list(ids[:n]), rows))
            return
        view, vs = staging.view, staging.value_size
        for j in range(n):
            start = (row + j) * vs + layer.offset
            layer.block(ids[j])[:] = view[start : start + layer.nbytes]

    def _scatter_fetched(self, staging: _Staging, fetched: _Fetched) -> None:
        """A fetch's intact leading blocks from staging into every layer's KV blocks."""
        for layer in self._layers:
            self._scatter_layer(layer, staging, fetched.transfer, fetched.row, fetched.good)

    # ---- saves ----------------------------------------------------------------------------
    def submit_saves(self, plan: StorePlan) -> None:
        if not self.writes_blocks:
            # Nothing to write, but vLLM frees a held request only when every rank reports it
            # finished: remember it with no pending saves.
            with self._lock:
                for transfer in plan.saves:
                    self._pending_saves.setdefault(transfer.request_id, [])
            return
        if self._saver_stalled():
            blocks = sum(len(t.block_hashes) for t in plan.saves)
            self.stats.record_failure("save_skipped_backend_stalled")
            self.stats.incr("blocks_save_failed", blocks)
            logger.warning("store save of %d block(s) skipped: the backend has not finished a save in %.0fs",
                           blocks, self.config.save_timeout_s)
            with self._lock:
                for transfer in plan.saves:
                    self._pending_saves.setdefault(transfer.request_id, [])
            return
        # The forward that wrote these blocks may still run on the device: the save waits for it.
        fence = None if self.host_kv else device.record_event(self.kv_device)
        for transfer in plan.saves:
            job = _SaveJob(self._saver.submit(self._save, transfer, fence), time.monotonic())
            with self._lock:
                self._pending_saves[transfer.request_id].append(job)

    def _parts_saves_safe(self) -> bool:
        """A zero-copy put lets the backend read the KV blocks themselves, possibly late: after a
        save was given up (save_timeout_s), from blocks vLLM gave to another request. The check
        sealed before the release catches that at load time; without one, saves use staging."""
        return self.config.checksum or self._mac_key is not None or self.config.save_timeout_s <= 0

    def _saver_stalled(self) -> bool:
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
        staging = self._save_staging
        assert staging is not None
        if transfer.request_id in self._released:
            return
        keys = self._keys(transfer.block_hashes)
        try:
            present = self.backend.batch_exists(keys)
        except Exception as exc:  # noqa: BLE001 - store down: nothing saved, nothing fails
            self.stats.record_failure("put_error")
            logger.warning("store save of %s skipped: exists check failed (%s)", transfer.request_id, exc)
            return
        todo = [i for i, p in enumerate(present) if not p]
        if self._parts and self._parts_saves_safe():
            self._save_parts(transfer, keys, todo)
            return
        # Runs of consecutive blocks to save, in cache-sized passes: gather, seal and put read
        # bytes the previous step just touched.
        for lo, hi in _chunks(len(todo), codec.blocks_per_pass(self.value_size, staging.slots)):
            idx = todo[lo:hi]
            sub = BlockTransfer(
                request_id=transfer.request_id,
                block_hashes=[transfer.block_hashes[i] for i in idx],
                block_ids=[[g[i] for i in idx] for g in transfer.block_ids],
            )
            n = len(idx)
            with self._gather_lock:
                if transfer.request_id in self._released:
                    return  # given up: its blocks may hold another request's KV by now
                self._gather(staging, sub, 0, n)
            values = staging.values(n)
            for value in values:
                codec.write_trailer(value, self.payload_size, self.config.checksum, self._mac_key, self.layout_tag)
            t0 = time.perf_counter()
            try:
                ok = self.backend.batch_put([keys[i] for i in idx], values)
            except Exception as exc:  # noqa: BLE001
                ok = [False] * n
                logger.warning("store put failed for %s: %s", transfer.request_id, exc)
            self._record_put(sub.block_hashes, ok, time.perf_counter() - t0)

    def _record_put(self, hashes: Sequence[bytes], ok: Sequence[bool], seconds: float) -> None:
        n = len(hashes)
        stored = [h for h, good in zip(hashes, ok, strict=True) if good]
        self.stats.record_put(len(stored) * self.value_size, seconds)
        self.stats.incr("blocks_saved", len(stored))
        if len(stored) < n:
            self.stats.record_failure("put_failed")
            self.stats.incr("blocks_save_failed", n - len(stored))
        with self._lock:
            self._report.stored.extend(stored)

    def _save_parts(self, transfer: BlockTransfer, keys: Sequence[str], todo: Sequence[int]) -> None:
        trailers = self._save_trailers
        assert trailers is not None
        slots = len(trailers) // codec.TRAILER_SIZE
        # cache-sized passes: the backend copies the bytes the seal has just read
        for lo, hi in _chunks(len(todo), codec.blocks_per_pass(self.value_size, slots)):
            idx = todo[lo:hi]
            values = []
            with self._gather_lock:
                if transfer.request_id in self._released:
                    return
                for slot, i in enumerate(idx):
                    parts = self._block_parts(transfer, i, trailers, slot)
                    codec.seal_parts(parts[:-1], parts[-1], self.config.checksum, self._mac_key, self.layout_tag)
                    values.append(parts)
            t0 = time.perf_counter()
            try:
                ok = self.backend.batch_put_parts([keys[i] for i in idx], values)  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001
                ok = [False] * len(idx)
                logger.warning("store put failed for %s: %s", transfer.request_id, exc)
            self._record_put([transfer.block_hashes[i] for i in idx], ok, time.perf_counter() - t0)

    def wait_for_request_saves(self, request_ids: Sequence[str]) -> None:
        """Block until the saves of ``request_ids`` finished (their blocks are about to be reused),
        at most until each save's deadline; a save still running then is given up."""
        timeout = self.config.save_timeout_s
        for req_id in request_ids:
            with self._lock:
                jobs = list(self._pending_saves.get(req_id, ()))
            for job in jobs:
                try:
                    job.future.exception(timeout=max(0.0, job.submitted + timeout - time.monotonic())
                                         if timeout > 0 else None)
                except FutureTimeout:
                    self._release(req_id)
                    break

    def _release(self, req_id: str) -> None:
        """Give up the saves of ``req_id``: none of its blocks is read after this returns."""
        with self._gather_lock, self._lock:
            jobs = self._pending_saves.pop(req_id, [])
            self._released[req_id] = jobs
            for job in jobs:
                job.future.cancel()
        self.stats.incr("save_timeouts")
        self.stats.record_failure("save_timeout")
        logger.warning("store save of %s not done within %.0fs: given up, its blocks are released",
                       req_id, self.config.save_timeout_s)

    def _overdue(self, jobs: Sequence[_SaveJob], now: float) -> bool:
        timeout = self.config.save_timeout_s
        return timeout > 0 and all(j.future.done() or now - j.submitted > timeout for j in jobs)

    # ---- loads ----------------------------------------------------------------------------
    def _fetch_into(self, plan_loads: Sequence[BlockTransfer], staging: _Staging) -> list[_Fetched]:
        """Fetch and verify values into staging rows (may run on the loader thread: records
        nothing, see ``_record_fetched``). Requests beyond the staging capacity are fetched in
        later rounds by the caller."""
        out: list[_Fetched] = []
        row = 0
        for transfer in plan_loads:
            n = len(transfer.block_hashes)
            keys = self._keys(transfer.block_hashes)
            values = staging.values(staging.slots)[row : row + n]

            def get(lo: int, hi: int, keys: list[str] = keys, values: list[memoryview] = values,
                    transfer: BlockTransfer = transfer) -> list[int]:
                try:
                    return self.backend.batch_get_into(keys[lo:hi], values[lo:hi])
                except Exception as exc:  # noqa: BLE001 - a dead store is a miss
                    logger.warning("store get failed for %s: %s", transfer.request_id, exc)
                    return [-1] * (hi - lo)

            good, why, seconds = _fetch_checked(
                n, codec.blocks_per_pass(self.value_size, n), get,
                lambda i, nbytes, values=values: codec.check_value(  # type: ignore[misc]
                    values[i], self.payload_size, nbytes, self._mac_key, self.layout_tag),
            )
            out.append(_Fetched(transfer, good, row, why, seconds))
            row += n
        return out

    def _record_fetched(self, fetched: Sequence[_Fetched]) -> None:
        for f in fetched:
            self._record_get(f.transfer, f.good, f.why, f.seconds)

    def _record_get(self, transfer: BlockTransfer, good: int, why: str, seconds: float) -> None:
        """Stats for a fetch; the first bad block and all after it are reported for recompute."""
        self.stats.record_get(good * self.value_size, seconds)
        self.stats.incr("blocks_loaded", good)
        if good < len(transfer.block_hashes):
            self._fail(transfer, good, why)

    def _fail(self, transfer: BlockTransfer, good: int, why: str) -> None:
        n = len(transfer.block_hashes)
        kind = why if why in ("miss", "timeout") else "corrupt"
        self.stats.record_failure(kind)
        self.stats.incr("blocks_load_failed", n - good)
        logger.warning(
            "store load of %s: block %d of %d %s; %d block(s) reported for recompute",
            transfer.request_id, good, n, why, n - good,
        )
        self.ledger.record_failed_load(transfer.request_id, [g[good:] for g in transfer.block_ids])
        if kind == "corrupt":
            # Self-healing: drop the bad value so the recomputed block can be saved in its place
            # (the scheduler rewinds that request's saves on the "removed" report).
            try:
                self.backend.batch_remove(self._keys([transfer.block_hashes[good]]))
            except Exception as exc:  # noqa: BLE001 - best effort: it stays a miss-then-recompute
                logger.warning("store: could not remove a corrupt value: %s", exc)
        if kind != "timeout":  # a block that timed out may well be in the store
            with self._lock:
                self._report.removed.append(transfer.block_hashes[good])

    def _fail_all(self, loads: Sequence[BlockTransfer], already: set[str], why: str) -> None:
        for transfer in loads:
            if transfer.request_id in already:
                self.ledger.record_failed_load(transfer.request_id, transfer.block_ids)
            else:
                already.add(transfer.request_id)
                self._fail(transfer, 0, why)

    def _loader_busy(self) -> bool:
        """True while a fetch that missed its deadline still runs (it owns the load staging)."""
        late = self._late_fetch
        if late is None:
            return False
        if late.done():
            self._late_fetch = None
            return False
        return True

    def _fetch_bounded(
        self, loads: Sequence[BlockTransfer], staging: _Staging, deadline: float | None
    ) -> list[_Fetched] | None:
        """``_fetch_into`` within ``deadline``; None when it missed it (or a late one still runs)."""
        if self._loader_busy():
            self.stats.incr("loads_skipped_backend_stalled")
            return None
        if deadline is None:
            return self._fetch_into(loads, staging)
        future = self._loader.submit(self._fetch_into, list(loads), staging)
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self._late_fetch = future
            self.stats.incr("load_timeouts")
            logger.warning("store load not done within %.1fs: its blocks are recomputed", self.config.load_timeout_s)
            return None

    def _rounds(self, loads: Sequence[BlockTransfer], slots: int) -> list[list[BlockTransfer]]:
        """Group loads so each round fits the staging rows (splitting large requests)."""
        rounds: list[list[BlockTransfer]] = [[]]
        used = 0
        for transfer in loads:
            n = len(transfer.block_hashes)
            for lo, hi in _chunks(n, slots):
                part = BlockTransfer(
                    request_id=transfer.request_id,
                    block_hashes=transfer.block_hashes[lo:hi],
                    block_ids=[g[lo:hi] for g in transfer.block_ids],
                )
                if used + (hi - lo) > slots:
                    rounds.append([])
                    used = 0
                rounds[-1].append(part)
                used += hi - lo
        return [r for r in rounds if r]

    def _load_parts(self, transfer: BlockTransfer) -> int:
        """Fetch ``transfer`` straight into its KV blocks; verify; record failures. Blocks at and
        after the first bad one are reported for recompute (whatever landed in them)."""
        trailers = self._load_trailers
        assert trailers is not None
        n = len(transfer.block_hashes)
        keys = self._keys(transfer.block_hashes)
        values = [self._block_parts(transfer, i, trailers, i) for i in range(n)]

        def get(lo: int, hi: int) -> list[int]:
            try:
                return self.backend.batch_get_parts(keys[lo:hi], values[lo:hi])  # type: ignore[attr-defined,no-any-return]
            except Exception as exc:  # noqa: BLE001 - a dead store is a miss
                logger.warning("store get failed for %s: %s", transfer.request_id, exc)
                return [-1] * (hi - lo)

        good, why, seconds = _fetch_checked(
            n, codec.blocks_per_pass(self.value_size, n), get,
            lambda i, nbytes: codec.check_parts(values[i][:-1], values[i][-1], nbytes, self._mac_key, self.layout_tag),
        )
        self._record_get(transfer, good, why, seconds)
        return good

    def _load_deadline(self) -> float | None:
        timeout = self.config.load_timeout_s
        return time.monotonic() + timeout if timeout > 0 else None

    def load_sync(self, plan: StorePlan) -> None:
        staging = self._load_staging
        if staging is None or not plan.loads:
            return
        failed: set[str] = set()
        deadline = self._load_deadline()
        if self._parts and deadline is None:  # zero copy into the KV cache: only without a deadline
            assert self._load_trailers is not None
            for part in self._rounds(plan.loads, len(self._load_trailers) // codec.TRAILER_SIZE):
                for transfer in part:
                    if transfer.request_id in failed:
                        self.ledger.record_failed_load(transfer.request_id, transfer.block_ids)
                    elif self._load_parts(transfer) < len(transfer.block_hashes):
                        failed.add(transfer.request_id)
            return
        rounds = self._rounds(plan.loads, staging.slots)
        for k, round_loads in enumerate(rounds):
            todo = []
            for load in round_loads:
                if load.request_id in failed:
                    # an earlier part of this request failed: nothing after it is valid
                    self.ledger.record_failed_load(load.request_id, load.block_ids)
                else:
                    todo.append(load)
            fetched = self._fetch_bounded(todo, staging, deadline)
            if fetched is None:
                self._fail_all([p for r in rounds[k:] for p in r], failed, "timeout")
                return
            self._record_fetched(fetched)
            for f in fetched:
                self._scatter_fetched(staging, f)
                if f.good < len(f.transfer.block_hashes):
                    failed.add(f.transfer.request_id)

    # ---- asynchronous loads (load_mode "async") -------------------------------------------
    def start_async(self, plan: StorePlan) -> None:
        """Queue each load on the loader thread and return at once: the forward never waits for
        it. Each request is reported by ``take_finished_loads`` once its blocks are in place (or
        failed, or given up at its deadline)."""
        if self._load_staging is None:
            return
        for transfer in plan.loads:
            if transfer.request_id in self._async_loads:  # started when the plan was bound
                continue
            job = _AsyncLoad(transfer, self._load_deadline())
            late = self._async_late
            if late is not None and not late.done():
                # A load given up at its deadline still holds the loader: fail this one at once
                # (reported next step) instead of queueing it behind the stuck call.
                job.given_up = "stalled"
                self.stats.incr("loads_skipped_backend_stalled")
            else:
                job.future = self._loader.submit(self._run_async, job)
            self._async_loads[transfer.request_id] = job

    def _run_async(self, job: _AsyncLoad) -> None:
        """Loader thread: fetch, verify and scatter ``job`` round by round through the load
        staging (only this thread uses it in async mode). Records nothing but ``job.fetched``."""
        staging = self._load_staging
        assert staging is not None
        for part in self._rounds([job.transfer], staging.slots):
            with self._async_lock:
                if job.given_up:
                    return
            fetched = self._fetch_into(part, staging)
            with self._async_lock:  # a give-up waits for this scatter (memory speed), never a get
                if job.given_up:
                    return
                for f in fetched:
                    self._scatter_fetched(staging, f)
                job.fetched.extend(fetched)
            if any(f.good < len(f.transfer.block_hashes) for f in fetched):
                return  # later blocks of the request are not valid after a bad one

    def take_finished_loads(self, finished_req_ids: set[str]) -> set[str]:
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
                with self._async_lock:
                    if not job.future.done():
                        job.given_up = why
                if job.given_up == "timeout":
                    self._async_late = job.future
                    self.stats.incr("load_timeouts")
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
            self.stats.record_failure("load_error")
            self.stats.incr("blocks_load_failed", len(remaining[0]) if remaining else 0)
            self.ledger.record_failed_load(transfer.request_id, remaining)

    # ---- per-step results -----------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        done: set[str] = set()
        overdue: list[str] = []
        now = time.monotonic()
        with self._lock:
            self._finished |= set(finished_req_ids)
            for req_id in list(self._finished):
                jobs = self._pending_saves.get(req_id)
                if jobs is None:
                    self._finished.discard(req_id)  # never saved (or given up): nothing held
                    if req_id in self._released:
                        done.add(req_id)
                    continue
                if all(j.future.done() for j in jobs):
                    del self._pending_saves[req_id]
                    self._finished.discard(req_id)
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

    def take_report(self) -> StoreReport | None:
        with self._lock:
            report, self._report = self._report, StoreReport()
        if not (report.stored or report.removed):
            return None
        # stored under this rank's tag: the scheduler announces a block once every tag stored it
        return StoreReport(stored_by_tag={self.rank_tag: report.stored} if report.stored else {},
                           removed=report.removed)

    def leak_report(self) -> dict[str, int]:
        with self._lock:
            pending = sum(1 for js in self._pending_saves.values() for j in js if not j.future.done())
            held = len(self._pending_saves)
        return {
            "pending_saves": pending,
            "pending_loads": len(self._async_loads),
            "held_requests": held,
        }

    def close(self, timeout_s: float) -> None:
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        with self._lock:
            futures = [j.future for js in self._pending_saves.values() for j in js]
        for future in futures:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.warning("store worker: shutting down with saves still in flight")
                break
            try:
                future.exception(timeout=remaining)
            except Exception:  # noqa: BLE001 - timeout
                break
        self._saver.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)
        for staging in (self._save_staging, self._load_staging):
            if staging is not None:
                staging.close()
        self._unregister_parts()


def _count_intact(results: Sequence[int], check: Callable[[int, int], str | None]) -> tuple[int, str]:
    """Leading blocks that arrived intact (``check(i, nbytes)`` names a problem or None), and why
    the next one is not ("" when all are)."""
    good = 0
    for i, nbytes in enumerate(results):
        if nbytes < 0:
            return good, "miss"
        problem = check(i, nbytes)
        if problem is not None:
            return good, f"corrupt ({problem})"
        good += 1
    return good, ""


def _fetch_checked(
    n: int, per: int, get: Callable[[int, int], Sequence[int]], check: Callable[[int, int], str | None]
) -> tuple[int, str, float]:
    """Fetch blocks ``[0, n)`` in passes of ``per`` (``get(lo, hi)`` gives their byte counts) and
    check each pass as soon as it landed, while its bytes are still in cache: (leading intact
    blocks, why the next is not, seconds in ``get``). Stops at the first bad block: the blocks
    after it are recomputed anyway."""
    good, seconds = 0, 0.0
    for lo, hi in _chunks(n, per):
        t0 = time.perf_counter()
        results = get(lo, hi)
        seconds += time.perf_counter() - t0
        ok, why = _count_intact(results, lambda i, nbytes, lo=lo: check(lo + i, nbytes))  # type: ignore[misc]
        good += ok
        if why:
            return good, why, seconds
    return good, "", seconds
