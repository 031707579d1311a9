"""``UcmBackend``: the store core's ``Backend`` over one UCM store (``UcmStore``).

* Keys: the store core's string keys (``kv/<namespace>/<rank tag>/<hash hex>``) become 16-byte UCM
  block ids (``ucm_key_id``: BLAKE2b of the key).
* Values: one fixed-size value per block (all layers + the core's checksum trailer), stored as one
  UCM tensor of ``value_size`` bytes per block (``tensor_size == shard_size == block_size``).
  The size is given up front (``value_size``) or learnt from the first put/get; UCM's native store
  is opened for that size. A value of any other size is a per-key failure, never an overrun.
* Errors: a miss, an unreadable block or a size mismatch is that key's ``-1`` / ``False``; a
  failed dump is counted and logged (``counters``), never raised. Only ``batch_exists`` raises
  (``UcmError``, a ``BackendError``) when UCM cannot answer at all: the scheduler counts that as
  a miss.
* Roles: the scheduler needs lookups only (``lookup_only=True``: UCM's ``device_id=-1`` store).
* Disk cap (Posix pipelines, on by default): ``disk_capacity_bytes`` (None: 16 GiB or half the free
  space, 0: no cap) bounds the block files under ``storage_backends``; the least recently used
  blocks go first (``posix_cap``). Off when UCM's own garbage collector is enabled.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kv_common.backend import MEDIUM_STORAGE, Backend
from kv_common.logging_utils import get_logger

from kv_ucm.block_ids import ucm_key_id
from kv_ucm.posix_cap import PosixDiskCap, default_posix_capacity
from kv_ucm.ucm_store import UcmError, UcmStore

logger = get_logger(__name__)

_LOG_EVERY_S = 30.0


def _byte_view(buffer: Any) -> memoryview:
    view = memoryview(buffer)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _posix_backend_dirs(config: Mapping[str, Any]) -> list[str]:
    """The directories of a pipeline with a Posix tier ([] for any other pipeline)."""
    if "Posix" not in str(config.get("store_pipeline", "")).split("|"):
        return []
    raw = config.get("storage_backends") or []
    if isinstance(raw, (str, os.PathLike)):
        return [p for p in str(raw).split(":") if p]
    return [str(p) for p in raw]


class UcmBackend(Backend):
    name = "ucm"
    kv_event_medium = MEDIUM_STORAGE  # UCM's Posix store: local disk or NFS
    # Bytes per dump / load task: None, the whole request (as far as the staging rows reach) in one
    # task. A UCM task costs ~0.2-0.3 ms beyond its bytes (submit, its I/O threads' hand-offs, wait);
    # 32 MiB from the page cache in tasks of 1 / 4 / 8 / 16 / 32 MiB: 3.4 / 4.8-5.7 / 5.2-7.0 / 6.4-7.5
    # / 6.6-7.5 GB/s. Passes would let the store core check and scatter pass k while UCM loads pass
    # k + 1, but UCM's I/O threads and that work then share the same cores: measured on 2 cores, 64 MiB
    # loads of 128 KiB - 2 MiB values reached 0.29-0.35 of UCM's native load in 16 MiB passes and
    # 0.32-0.44 in one task (two runs each, bench_ucm_store).
    pass_bytes = None

    def __init__(
        self,
        entry: Mapping[str, Any],
        *,
        value_size: int | None = None,
        lookup_only: bool = False,
        store_factory: Any = None,
        disk_capacity_bytes: int | None = None,
    ) -> None:
        """``entry``: one ``ucm_connectors`` entry (``ucm_connector_name`` + ``ucm_connector_config``)
        or a bare ``ucm_connector_config``. With ``value_size`` the store opens now (errors surface
        at start-up); without it, at the first put/get (lookups open a lookup-only store)."""
        if "ucm_connector_config" in entry:
            self.connector_name = entry.get("ucm_connector_name") or None
            self.store_config = dict(entry.get("ucm_connector_config") or {})
        else:
            self.connector_name = None
            self.store_config = dict(entry)
        self.lookup_only = lookup_only
        self._factory = store_factory or UcmStore.from_config
        self._lock = threading.Lock()
        self._store: UcmStore | None = None
        self.value_size: int | None = None
        self.counters = {
            "put_ok": 0,
            "put_failed": 0,
            "put_errors": 0,
            "get_ok": 0,
            "get_missed": 0,
            "get_errors": 0,
            "size_mismatch": 0,
            "disk_evictions": 0,
        }
        self._count_lock = threading.Lock()  # saves and loads run on different threads
        self._last_log: dict[str, float] = {}
        self._closed = False
        self._backend_dirs = _posix_backend_dirs(self.store_config)
        self.disk_capacity_bytes = self._resolve_cap(disk_capacity_bytes)
        self._disk_cap: PosixDiskCap | None = None
        if value_size is not None:
            self.open(value_size)

    def _resolve_cap(self, requested: int | None) -> int | None:
        if self.lookup_only or not self._backend_dirs or requested == 0:
            return None
        if self.store_config.get("posix_gc_enable") and requested is None:
            return None  # UCM's own collector caps the directory (posix_capacity_gb)
        if requested is not None and requested < 0:
            raise ValueError(f"disk_capacity_bytes must be >= 0, got {requested}")
        return int(requested) if requested is not None else default_posix_capacity(self._backend_dirs)

    # -- the native store ----------------------------------------------------------------------

    def open(self, value_size: int | None) -> UcmStore:
        """Open the UCM store for ``value_size``-byte values (None: lookups only). Idempotent."""
        with self._lock:
            if self._closed:
                raise UcmError("open", None, "backend is closed")
            store = self._store
            if store is not None:
                if value_size is None or value_size == self.value_size or self.lookup_only:
                    return store
                if self.value_size is not None:
                    raise ValueError(f"UCM store already open for {self.value_size}-byte values, not {value_size}")
                # a lookup-only store opened before the first transfer: replace it
                self._store = None
                store.close()
            if value_size is not None and value_size <= 0:
                raise ValueError(f"value_size must be positive, got {value_size}")
            kwargs: dict[str, Any] = {"lookup_only": self.lookup_only}
            if self.connector_name:
                kwargs["connector_name"] = self.connector_name
            if value_size is not None:
                kwargs["tensor_size"] = int(value_size)
                kwargs["tensors_per_block"] = 1
            t0 = time.perf_counter()
            store = self._factory(self.store_config, **kwargs)
            self._store = store
            if value_size is not None:
                self.value_size = int(value_size)
                if self.disk_capacity_bytes and self._disk_cap is None:
                    shard_digits = int(self.store_config.get("data_dir_shard_bytes", 3))
                    self._disk_cap = PosixDiskCap(self._backend_dirs, self.disk_capacity_bytes, shard_digits=shard_digits)
                    self._sync_evictions()
            logger.info(
                "UCM store %s opened in %.2f s (%s, value size %s)",
                store, time.perf_counter() - t0, "lookup only" if self.lookup_only else "transfers",
                self.value_size,
            )
            return store

    def _transfer_store(self, size: int) -> UcmStore | None:
        """The store for ``size``-byte values, or None when the store is open for another size."""
        if self._closed:
            raise UcmError("use", None, "backend is closed")
        if self.value_size is None and not self.lookup_only:
            self.open(size)
        if self.value_size != size or self._store is None:
            return None
        return self._store

    def _lookup_store(self) -> UcmStore:
        store = self._store
        return store if store is not None else self.open(None)

    @property
    def store(self) -> UcmStore | None:
        return self._store

    def _count(self, name: str, n: int) -> None:
        if n:
            with self._count_lock:
                self.counters[name] += n

    def _sync_evictions(self) -> None:
        cap = self._disk_cap
        if cap is not None:
            with self._count_lock:
                self.counters["disk_evictions"] = cap.evictions

    def _log(self, what: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_log.get(what, -1e9) >= _LOG_EVERY_S:
            self._last_log[what] = now
            logger.warning(message, *args)

    # -- Backend API -----------------------------------------------------------------------------

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return self._lookup_store().lookup([ucm_key_id(k) for k in keys])

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        """Number of leading keys present (UCM's ``lookup_on_prefix``)."""
        if not keys:
            return 0
        return self._lookup_store().lookup_on_prefix([ucm_key_id(k) for k in keys])

    def batch_put(self, keys: Sequence[str], values: Sequence[memoryview | bytes]) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return []
        views = [_byte_view(v) for v in values]
        results = [False] * len(keys)
        try:
            sizes = {v.nbytes for v in views}
            store = self._transfer_store(views[0].nbytes)
            if store is None:
                self._count("size_mismatch", len(keys))
                self._log("size", "UCM dump: values of %s bytes, the store holds %s-byte values", sizes, self.value_size)
                self._count("put_failed", len(keys))
                return results
            ids = [ucm_key_id(k) for k in keys]
            todo = [i for i, v in enumerate(views) if v.nbytes == self.value_size]
            self._count("size_mismatch", len(keys) - len(todo))
            # A key that already exists keeps its value (UCM itself would overwrite it).
            present = store.lookup([ids[i] for i in todo])
            for i, p in zip(todo, present, strict=True):
                results[i] = bool(p)
            todo = [i for i, p in zip(todo, present, strict=True) if not p]
            if todo:
                ok = store.dump([ids[i] for i in todo], [views[i] for i in todo])
                for i, good in zip(todo, ok, strict=True):
                    results[i] = bool(good)
                cap = self._disk_cap
                if cap is not None:
                    cap.wrote(sum(1 for good in ok if good) * int(self.value_size or 0))
                    self._sync_evictions()
        except (UcmError, ValueError, OSError) as exc:
            self._count("put_errors", 1)
            self._log("put", "UCM dump of %d block(s) failed: %s", len(keys), exc)
        stored = sum(results)
        self._count("put_ok", stored)
        self._count("put_failed", len(keys) - stored)
        if stored < len(keys):
            self._log("put_failed", "UCM dump: %d of %d block(s) not stored", len(keys) - stored, len(keys))
        return results

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        views = [_byte_view(b) for b in buffers]
        results = [-1] * len(keys)
        try:
            store = self._transfer_store(views[0].nbytes)
            if store is None:
                self._count("size_mismatch", len(keys))
                self._count("get_missed", len(keys))
                return results
            todo = [i for i, v in enumerate(views) if v.nbytes == self.value_size]
            self._count("size_mismatch", len(keys) - len(todo))
            if todo:
                ids = [ucm_key_id(keys[i]) for i in todo]
                ok = store.load(ids, [views[i] for i in todo])
                for i, good in zip(todo, ok, strict=True):
                    if good:
                        results[i] = views[i].nbytes
                cap = self._disk_cap
                if cap is not None:
                    cap.touch(bid for bid, good in zip(ids, ok, strict=True) if good)
        except (UcmError, ValueError, OSError) as exc:
            self._count("get_errors", 1)
            self._log("get", "UCM load of %d block(s) failed: %s", len(keys), exc)
        hits = sum(1 for r in results if r >= 0)
        self._count("get_ok", hits)
        self._count("get_missed", len(keys) - hits)
        return results

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            store.close()
        if self.counters["put_failed"] or self.counters["get_errors"]:
            logger.info("UCM backend closed: %s", self.counters)

    def __repr__(self) -> str:
        return f"UcmBackend({self.store_config.get('store_pipeline', '?')}, value_size={self.value_size})"
