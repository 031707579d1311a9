"""``Backend`` over a real Mooncake Store (``MooncakeDistributedStore``, zero-copy batch API).

Mooncake reports errors as return codes and crashes (SIGSEGV) when called before ``setup()``
succeeded; this wrapper turns codes into per-key results once, here:

- missing key (-704, or ``b''``) and any other negative code -> -1 (a miss);
- master gone (-900 RPC_FAIL) -> misses / failed puts, never an exception or a crash;
- the client holding a value gone (-800 TRANSFER_FAIL while the master still lists the key) -> a
  miss; no segment with room (-200 NO_AVAILABLE_HANDLE, e.g. every instance mounts nothing and no
  standalone ``mooncake_client`` runs) -> a failed put;
- every call is refused (misses) unless ``setup()`` returned 0;
- a put of a key that already exists is a success (0 from 0.3.13, -705 OBJECT_ALREADY_EXISTS from
  versions that report it): the value stays and the caller needs no exists round trip first.

An RPC per call: the whole request goes in one call (``pass_bytes`` None). A call is bounded by
Mooncake's own timeouts over TCP (``mooncake_call_bound_s``), so a caller with a longer deadline
may wait for it with the KV cache itself as the buffers.

Buffers given to ``batch_put`` / ``batch_get_into`` must lie inside a buffer announced with
``register_buffer`` for the zero-copy path; anything else is copied through a bytes call.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from kv_common.backend import Backend, BackendCapabilities, BackendError, scatter_into_parts
from kv_common.logging_utils import get_logger

logger = get_logger(__name__)

NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
RPC_FAIL = -900

_HINTS = {
    RPC_FAIL: " (master unreachable)",
    TRANSFER_FAIL: " (the client holding the value is gone: an exited instance or a stopped mooncake_client)",
    NO_AVAILABLE_HANDLE: " (no mounted segment has room: with mount_segment false a standalone mooncake_client "
                         "must hold the pool)",
}


# What ends a store call when a party stops answering (measured on 0.3.13.post1 over TCP, with
# SIGSTOP): the client's RPC to a frozen master returns -901 after MC_RPC_TIMEOUT_MS; a transfer
# to or from a frozen segment holder returns -800 after MC_TCP_PROGRESS_TIMEOUT_SEC (get and put;
# MC_TRANSFER_TIMEOUT did not end it, MC_TCP_STATUS_TIMEOUT_SEC only the get). Defaults 30 s each.
RPC_TIMEOUT_ENV, RPC_TIMEOUT_DEFAULT_MS = "MC_RPC_TIMEOUT_MS", 30000
TCP_PROGRESS_TIMEOUT_ENV, TCP_PROGRESS_TIMEOUT_DEFAULT_S = "MC_TCP_PROGRESS_TIMEOUT_SEC", 30
TRANSFER_S_PER_BYTE = 1e-9  # Mooncake's own allowance per byte on top of a transfer timeout
# kv-store's own values (an operator's setting wins): a call then ends within the default 10 s load
# deadline, so loads go straight into the KV cache, not through staging and a second copy (~120 ms
# per GB; gets measured 0.41-0.48 of raw through staging against 0.44-0.72 zero-copy). Generous on
# a LAN: a metadata RPC to the master, or a transfer that moved nothing at all for that long.
STORE_RPC_TIMEOUT_S, STORE_TCP_PROGRESS_TIMEOUT_S = 3.0, 5


def _env_number(environ: Mapping[str, str], name: str, default: float) -> float | None:
    """``name`` from ``environ`` as a non-negative number; None when it is set to anything else
    (what Mooncake then does we cannot tell: unbounded)."""
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


def mooncake_call_bound_s(protocol: str, nbytes: int, environ: Mapping[str, str] | None = None) -> float | None:
    """The longest a store call moving ``nbytes`` takes before Mooncake ends it itself, from the
    timeouts in ``environ`` (default: this process's environment); None where no bound was
    measured (protocols other than TCP, unreadable settings)."""
    environ = os.environ if environ is None else environ
    if protocol != "tcp":
        return None
    rpc_ms = _env_number(environ, RPC_TIMEOUT_ENV, RPC_TIMEOUT_DEFAULT_MS)
    progress_s = _env_number(environ, TCP_PROGRESS_TIMEOUT_ENV, TCP_PROGRESS_TIMEOUT_DEFAULT_S)
    if rpc_ms is None or progress_s is None:
        return None
    return rpc_ms / 1000 + progress_s + nbytes * TRANSFER_S_PER_BYTE


def call_timeouts_within(load_timeout_s: float) -> dict[str, str]:
    """Mooncake's two timeouts, as kv-store sets them for a store client over TCP, sized so that a
    call ends within ``load_timeout_s`` (3 s + 5 s at 10 s and more; shorter down to 1 s + 1 s,
    which fits deadlines from ~3 s; {} without a deadline: loads are zero-copy anyway, Mooncake keeps
    its own defaults). Never under 1 s each: a master RPC must not fail merely under load."""
    if load_timeout_s <= 0:
        return {}
    rpc_s = max(1.0, min(STORE_RPC_TIMEOUT_S, 0.3 * load_timeout_s))
    progress_s = max(1, min(STORE_TCP_PROGRESS_TIMEOUT_S, int(0.5 * load_timeout_s)))  # whole seconds
    return {RPC_TIMEOUT_ENV: str(int(rpc_s * 1000)), TCP_PROGRESS_TIMEOUT_ENV: str(progress_s)}


def bound_call_timeouts(load_timeout_s: float) -> None:
    """Set ``call_timeouts_within(load_timeout_s)`` for this process, unless the operator set them
    (read by the Mooncake client as it is set up: call before). Like kv-mooncake's attempt timeouts:
    in one process the first setting stays (kv-mooncake's 10 s progress timeout, set first, makes
    the store's calls outlast a 10 s deadline: its loads then go through staging, still correct)."""
    for name, value in call_timeouts_within(load_timeout_s).items():
        os.environ.setdefault(name, value)


def put_succeeded(code: int) -> bool:
    """A put's code: stored now, or already stored (kept; 0.3.13 says 0, later versions -705)."""
    return code == 0 or code == OBJECT_ALREADY_EXISTS


def _byte_view(buffer: memoryview | bytes) -> memoryview:
    """``buffer`` as a flat byte view; no new view when it is one already (the worker's parts are:
    a cast per part cost ~1 us, as much as the rest of a 128 KiB block's bookkeeping)."""
    view = memoryview(buffer)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def buffer_address(buffer: memoryview) -> int:
    view = memoryview(buffer)
    if view.readonly:
        import numpy as np

        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class MooncakeBackend(Backend):
    name = "mooncake"
    pass_bytes = None  # one RPC per request: a call costs a round trip to the master
    capabilities = BackendCapabilities(zero_copy_parts=True, parts_at_address=True)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        overrides = {"batch_put_parts", "batch_get_parts"} & set(cls.__dict__)
        if overrides and not {"batch_put_parts_at", "batch_get_parts_at"} & set(cls.__dict__):
            # the override sees every parts call
            cls.capabilities = replace(cls.capabilities, parts_at_address=False)

    def call_bound_s(self, nbytes: int) -> float | None:
        return mooncake_call_bound_s(str(self.options.get("protocol", "")), nbytes, self._timeouts)

    def __init__(self, options: dict[str, Any], setup_retries: int | None = 3, setup_timeout_s: float = 60.0) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        # The timeouts this client is set up with (a later change of the environment is not its).
        self._timeouts = {k: os.environ[k] for k in (RPC_TIMEOUT_ENV, TCP_PROGRESS_TIMEOUT_ENV) if k in os.environ}
        if setup_retries is not None:
            # Mooncake retries a missing master 20 times (~90 s) by default.
            os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(setup_retries))
        from mooncake.store import MooncakeDistributedStore

        self.options = dict(options)
        self._store = MooncakeDistributedStore()
        self._ready = False
        self._lock = threading.Lock()
        self._registered: list[tuple[int, int]] = []  # (address, size), sorted
        self._warned: set[str] = set()
        result: dict[str, int] = {}

        def _setup() -> None:
            result["rc"] = self._store.setup(
                options["local_hostname"], options["metadata_server"], int(options["global_segment_size"]),
                int(options["local_buffer_size"]), options["protocol"], options.get("device_name", ""),
                options["master_server_address"],
            )

        thread = threading.Thread(target=_setup, name="mooncake-setup", daemon=True)
        thread.start()
        thread.join(setup_timeout_s)
        if thread.is_alive():
            raise BackendError(self.name, "setup", None, f"no answer from master {options['master_server_address']} "
                               f"within {setup_timeout_s}s")
        rc = result.get("rc", -1)
        if rc != 0:
            raise BackendError(self.name, "setup", rc, f"master {options['master_server_address']}")
        self._ready = True
        segment = int(options["global_segment_size"])
        if segment:
            # Said once at start-up: which deployment this is decides what survives a restart.
            logger.info(
                "mooncake: this instance mounts %d MiB into the pool of %s; values the master places there "
                "leave with it (mount_segment false beside a standalone mooncake_client keeps the pool "
                "across instance restarts)", segment >> 20, options["master_server_address"],
            )

    # ---- helpers ----------------------------------------------------------------------------
    def _warn_once(self, what: str, code: int) -> None:
        tag = f"{what}:{code}"
        if tag not in self._warned:
            self._warned.add(tag)
            hint = _HINTS.get(code, "")
            logger.warning("mooncake %s returned %d%s; treated as a miss", what, code, hint)

    def _is_registered(self, address: int, size: int) -> bool:
        regs = self._registered
        i = bisect.bisect_right(regs, (address, 1 << 62)) - 1
        while i >= 0:  # ranges may nest (a sub-range registered again): look further left too
            start, length = regs[i]
            if address + size <= start + length:
                return True
            i -= 1
        return False

    # ---- Backend ----------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if not self._ready or not keys:
            return [False] * len(keys)
        codes = self._store.batch_is_exist(list(keys))
        out = []
        for code in codes:
            if code < 0:
                self._warn_once("batch_is_exist", code)
            out.append(code == 1)
        return out

    def batch_put(self, keys: Sequence[str], values: Sequence[memoryview | bytes]) -> list[bool]:
        if not self._ready or not keys:
            return [False] * len(keys)
        views = [_byte_view(v) for v in values]
        addresses = [buffer_address(v) for v in views]
        if all(self._is_registered(a, len(v)) for a, v in zip(addresses, views, strict=True)):
            codes = self._store.batch_put_from(list(keys), addresses, [len(v) for v in views])
        else:
            codes = [self._store.put(k, bytes(v)) for k, v in zip(keys, views, strict=True)]
        return self._put_results(codes)

    def _put_results(self, codes: Sequence[int]) -> list[bool]:
        out = []
        for code in codes:
            ok = put_succeeded(code)
            if not ok:
                self._warn_once("put", code)
            out.append(ok)
        return out

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        if not self._ready or not keys:
            return [-1] * len(keys)
        views = [_byte_view(b) for b in buffers]
        addresses = [buffer_address(v) for v in views]
        if all(self._is_registered(a, len(v)) for a, v in zip(addresses, views, strict=True)):
            # Mooncake checks the destination size (-600 when the value is larger): no overrun.
            codes = self._store.batch_get_into(list(keys), addresses, [len(v) for v in views])
        else:
            codes = []
            for key, view in zip(keys, views, strict=True):
                data = self._store.get(key)
                if not data or len(data) > len(view):
                    codes.append(OBJECT_NOT_FOUND if not data else -600)
                    continue
                view[: len(data)] = data
                codes.append(len(data))
        out = []
        for code in codes:
            if code < 0:
                if code != OBJECT_NOT_FOUND:
                    self._warn_once("get", code)
                out.append(-1)
            else:
                out.append(int(code))
        return out

    # ---- zero-copy parts (capabilities.zero_copy_parts) --------------------------------------
    def batch_put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Each value from several registered buffers (KV slices + trailer), no gather copy."""
        if not self._ready or not keys:
            return [False] * len(keys)
        ptrs, sizes = self._part_addresses(parts)
        if ptrs is None:
            return self.batch_put(keys, [b"".join(p) for p in parts])
        codes = self._store.batch_put_from_multi_buffers(list(keys), ptrs, sizes)
        return self._put_results(codes)

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[int]:
        """Each value straight into several registered buffers (KV slices + trailer)."""
        if not self._ready or not keys:
            return [-1] * len(keys)
        ptrs, sizes = self._part_addresses(parts)
        if ptrs is None or sizes is None:
            # A missing key reads as b'' here: no data, as for None.
            return [scatter_into_parts(self._store.get(key) or None, bufs) for key, bufs in zip(keys, parts, strict=True)]
        return self._get_results(self._store.batch_get_into_multi_buffers(list(keys), ptrs, sizes), sizes)

    # ---- the parts by address (capabilities.parts_at_address: computed for a whole pass) -----
    def batch_put_parts_at(self, keys: Sequence[str], addresses: Sequence[Sequence[int]],
                           sizes: Sequence[Sequence[int]]) -> list[bool]:
        """``batch_put_parts`` of values whose parts are given as addresses and sizes; every part
        must lie inside a registered buffer, or nothing is read and every put fails."""
        if not self._ready or not keys:
            return [False] * len(keys)
        if not self._rows_registered(len(keys), addresses, sizes):
            return [False] * len(keys)
        return self._put_results(self._store.batch_put_from_multi_buffers(list(keys), addresses, sizes))

    def batch_get_parts_at(self, keys: Sequence[str], addresses: Sequence[Sequence[int]],
                           sizes: Sequence[Sequence[int]]) -> list[int]:
        """``batch_get_parts`` into parts given as addresses and sizes; every part must lie inside
        a registered buffer, or nothing is written and every key is a miss."""
        if not self._ready or not keys:
            return [-1] * len(keys)
        if not self._rows_registered(len(keys), addresses, sizes):
            return [-1] * len(keys)
        return self._get_results(self._store.batch_get_into_multi_buffers(list(keys), addresses, sizes), sizes)

    def _rows_registered(self, n: int, addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> bool:
        """Whether ``n`` rows of part addresses and sizes all lie inside registered buffers (checked
        for the whole call at once: ~0.1 ms for 2560 parts against ~1 us a part one by one)."""
        import numpy as np

        try:
            at = np.asarray(addresses, dtype=np.int64)
            size = np.asarray(sizes, dtype=np.int64)
        except (ValueError, TypeError, OverflowError):
            at = size = None  # ragged rows or not integers
        if at is None or size is None or len(at) != n or at.ndim != 2 or at.shape != size.shape:
            self._warn_once("parts_at", -1)
            return False
        spans = self._merged_registrations()
        at, size = at.ravel(), size.ravel()
        if spans:
            starts = np.asarray([start for start, _ in spans], dtype=np.int64)
            ends = np.asarray([end for _, end in spans], dtype=np.int64)
            i = np.searchsorted(starts, at, side="right") - 1  # the span starting at or before each part
            inside = bool(np.all((i >= 0) & (size >= 0) & (at + size <= ends[np.maximum(i, 0)])))
        else:
            inside = at.size == 0
        if not inside:
            self._warn_once("parts_at", -1)
            return False
        return True

    def _merged_registrations(self) -> list[tuple[int, int]]:
        """The registered buffers as disjoint (start, end) spans: nested or overlapping ones merged,
        merely adjacent ones kept apart (a part spanning two registrations is not inside one)."""
        with self._lock:
            regs = list(self._registered)
        merged: list[tuple[int, int]] = []
        for start, length in regs:  # sorted by start
            end = start + length
            if merged and start < merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged

    def _get_results(self, codes: Sequence[int], sizes: Sequence[Sequence[int]]) -> list[int]:
        out: list[int] = []
        for code, size in zip(codes, sizes, strict=True):
            if code < 0:
                if code != OBJECT_NOT_FOUND:
                    self._warn_once("get", code)
                out.append(-1)
            elif int(code) != sum(size):
                out.append(-1)  # a value of another size: never partial KV
            else:
                out.append(int(code))
        return out

    def _part_addresses(
        self, parts: Sequence[Sequence[memoryview]]
    ) -> tuple[list[list[int]], list[list[int]]] | tuple[None, None]:
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        for bufs in parts:
            row_p, row_s = [], []
            for buf in bufs:
                view = _byte_view(buf)
                address = buffer_address(view)
                if not self._is_registered(address, len(view)):
                    return None, None
                row_p.append(address)
                row_s.append(len(view))
            ptrs.append(row_p)
            sizes.append(row_s)
        return ptrs, sizes

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not self._ready:
            return [None] * len(keys)
        return [self._store.get(k) or None for k in keys]

    def batch_remove(self, keys: Sequence[str]) -> None:
        if self._ready and keys:
            self._store.batch_remove(list(keys))

    def register_buffer(self, buffer: memoryview) -> None:
        view = memoryview(buffer).cast("B")
        address, size = buffer_address(view), len(view)
        if not self._ready:
            return
        rc = self._store.register_buffer(address, size)
        if rc != 0:
            raise BackendError(self.name, "register_buffer", rc)
        with self._lock:
            bisect.insort(self._registered, (address, size))

    def unregister_buffer(self, buffer: memoryview) -> None:
        view = memoryview(buffer).cast("B")
        address = buffer_address(view)
        with self._lock:
            entry = next((r for r in self._registered if r[0] == address), None)
            if entry is None or not self._ready:
                return
            self._registered.remove(entry)
        self._store.unregister_buffer(address)

    def close(self, timeout_s: float = 5.0) -> None:
        """Unmount and disconnect. With the master gone Mooncake retries the unmount for a long
        time: give up after ``timeout_s`` (the process is shutting down anyway)."""
        if not self._ready:
            return
        self._ready = False

        def _close() -> None:
            try:
                self._store.close()
            except Exception:  # noqa: BLE001
                logger.debug("mooncake close failed", exc_info=True)

        thread = threading.Thread(target=_close, name="mooncake-close", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("mooncake close did not finish within %.0fs (master unreachable?); going on", timeout_s)
