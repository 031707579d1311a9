"""The store path's measurement: a ``StoreWorker`` over real CPU KV tensors against the raw backend.

:func:`measure_put_get` saves and loads the same block values through the connector's worker
(``submit_saves`` + ``wait_for_request_saves``, ``load_sync``) and through the backend's own calls
(:class:`RawSide`, or another module's native API in its place; :class:`LayoutSide`, the backend's
parts calls on the paged KV layout), alternating per repetition, and returns median GB/s. The KV
layout (:data:`LAYERS` x :data:`KV_HEADS` x :data:`HEAD_SIZE`, fp32), the backends
(:func:`open_backend`), the allocator setting (:func:`keep_freed_memory`) and the targets
(:func:`ratio_claim`) are shared by ``store/put_get``, ``store/integrity_put_get`` and
``store/ucm_put_get``.
"""

from __future__ import annotations

import os
import time
from unittest import mock

from kv_store.testing import MooncakeMaster

from benchmarks._lib.checksums import one_core_ceilings
from benchmarks._lib.report import Claim, against_target, median

LAYERS, KV_HEADS, HEAD_SIZE = 4, 4, 64  # fp32: 8 KiB per token over all layers
TOKEN_BYTES = LAYERS * KV_HEADS * 2 * HEAD_SIZE * 4


def keep_freed_memory() -> str:
    """Tell glibc's malloc to keep freed memory instead of returning it to the OS (as a long-running
    store process settles into). Otherwise whichever side allocates its values on the main thread
    (the raw side) page-faults on every repetition while the worker's save thread reuses its own
    arena: on this VM that made raw puts 1.5 GB/s against 14 with the same code."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 32 << 20)
    except (OSError, AttributeError):
        ok = 0
    return (
        "glibc malloc: trim threshold 1 GiB, mmap threshold 32 MiB (freed values stay mapped between repetitions)"
        if ok
        else "glibc mallopt not available: raw puts may include page faults"
    )


# `mooncake`: kv-store's defaults, which set Mooncake's timeouts so its calls end within the default
# 10 s load_timeout_s (3 s + 5 s, ``call_timeouts_within``): loads zero-copy. MOONCAKE_OWN: Mooncake's
# own 30 s + 30 s (an operator's setting, or kv-mooncake's progress timeout set first in the process):
# its calls may outlast the deadline, so loads go through staging and a second copy.
MOONCAKE_OWN = "mooncake, its own 30+30 s timeouts"
OWN_TIMEOUTS = {"MC_RPC_TIMEOUT_MS": "30000", "MC_TCP_PROGRESS_TIMEOUT_SEC": "30"}


def open_backend(name: str, master: MooncakeMaster | None, total_bytes: int):
    if name == "embedded":
        from kv_store.embedded import EmbeddedStoreBackend

        return EmbeddedStoreBackend(capacity_bytes=8 * total_bytes)
    from kv_store.config import StoreConnectorConfig
    from kv_store.mooncake_backend import MooncakeBackend, call_timeouts_within

    assert master is not None
    timeouts = OWN_TIMEOUTS if name == MOONCAKE_OWN else call_timeouts_within(StoreConnectorConfig().load_timeout_s)
    with mock.patch.dict(os.environ, timeouts):  # read by the client as it is set up
        return MooncakeBackend({
            "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "device_name": "",
            "master_server_address": master.address, "global_segment_size": 8 * total_bytes,
            "local_buffer_size": 64 << 20,
        }, setup_retries=1, setup_timeout_s=30)


def remove_values(backend, keys: list[str]) -> None:
    if backend.name == "mooncake":
        backend._store.batch_remove(keys, True)  # force: a read leases the object for a while
    else:
        backend.batch_remove(keys)


class RawSide:
    """The raw side of a measurement: the backend's own ``batch_put`` / ``batch_get_into`` of the
    same values (another module passes e.g. UCM's native API instead)."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def put(self, keys: list[str], views: list[memoryview]) -> None:
        ok = self.backend.batch_put(keys, views)
        assert all(ok), ok

    def get(self, keys: list[str], views: list[memoryview]) -> None:
        got = self.backend.batch_get_into(keys, views)
        assert all(g == v.nbytes for g, v in zip(got, views, strict=True)), got

    def remove(self, keys: list[str]) -> None:
        remove_values(self.backend, keys)


class LayoutSide:
    """The backend's own parts calls (``batch_put_parts`` / ``batch_get_parts``) on the blocks in
    the paged KV layout: each value one slice per layer plus a trailer, no check, no connector.
    What any connector pays for reading the KV cache where vLLM keeps it, against the raw side's
    one contiguous buffer; the connector's own cost is what it adds beyond this."""

    def __init__(self, backend, view, n: int) -> None:
        from kv_store.codec import TRAILER_SIZE
        from kv_store.metadata import BlockTransfer
        from kv_store.staging import TrailerArea

        self.backend = backend
        # the worker's own trailer slots, registered: Mooncake reads parts in place
        self.trailers = TrailerArea(memoryview(bytearray(TRAILER_SIZE * 2 * n)))
        backend.register_buffer(self.trailers.view)
        # the blocks the connector saves (0..n) and those it loads into (n..2n), each with its own trailer
        def blocks(first: int) -> list[list[memoryview]]:
            transfer = BlockTransfer(request_id="layout", block_hashes=[b""] * n,
                                     block_ids=[list(range(first, first + n))])
            return [view.block_parts(transfer, i, self.trailers[first + i]) for i in range(n)]

        self.src, self.dst = blocks(0), blocks(n)

    def put(self, keys: list[str], parts: list[list[memoryview]]) -> None:
        ok = self.backend.batch_put_parts(keys, parts)
        assert all(ok), ok

    def get(self, keys: list[str], parts: list[list[memoryview]]) -> None:
        got = self.backend.batch_get_parts(keys, parts)
        assert all(g == sum(p.nbytes for p in ps) for g, ps in zip(got, parts, strict=True)), got

    def close(self) -> None:
        self.backend.unregister_buffer(self.trailers.view)


def measure_put_get(
    backend,
    value_bytes: int,
    total_bytes: int,
    reps: int,
    staging: bool,
    checksum: bool = True,
    raw_side: RawSide | None = None,
    load_timeout_s: float | None = None,
) -> dict:
    """Medians of put / get GB/s through the worker and the raw side. ``load_timeout_s`` None: the
    connector's default (a load deadline, which may route loads through staging); 0: no deadline, so
    zero-copy loads go straight into the KV cache."""
    import torch
    from kv_store.config import StoreConnectorConfig
    from kv_store.metadata import BlockTransfer, StorePlan
    from kv_store.worker import StoreWorker

    block_size = value_bytes // TOKEN_BYTES
    n = max(4, total_bytes // value_bytes)
    torch.manual_seed(0)
    caches = {f"layer{i}": torch.randn(2 * n, KV_HEADS, block_size, 2 * HEAD_SIZE) for i in range(LAYERS)}
    deadline = {} if load_timeout_s is None else {"load_timeout_s": load_timeout_s}
    worker = StoreWorker(backend=backend, namespace="bench", rank_tag="r0",
                         config=StoreConnectorConfig(staging_bytes=max(64 << 20, 2 * n * value_bytes),
                                                     checksum=checksum, **deadline),
                         zero_copy=not staging)  # staging: the path of backends without the parts protocol
    worker.register_kv_caches(caches)
    vsize = worker.value_size
    raw = torch.empty(n * vsize, dtype=torch.uint8)
    raw_view = memoryview(raw.numpy()).cast("B")
    backend.register_buffer(raw_view)
    # the raw side moves the very bytes the connector stores: one value per block, trailer included
    for i in range(n):
        off = 0
        for layer in caches.values():
            chunk = layer[i].view(torch.uint8).reshape(-1)
            raw[i * vsize + off : i * vsize + off + chunk.numel()] = chunk
            off += chunk.numel()
    views = [raw_view[i * vsize : (i + 1) * vsize] for i in range(n)]
    layout = LayoutSide(backend, worker.view, n) if hasattr(backend, "batch_put_parts") and raw_side is None else None
    raw_side = raw_side or RawSide(backend)
    sides = ("raw", "conn") + (("layout",) if layout is not None else ())
    out = {f"{d}_{side}": [] for side in sides for d in ("put", "get")}
    nbytes = n * vsize
    try:
        for rep in range(reps + 1):  # rep 0 warms up (page faults, first registration)
            hashes = [f"{value_bytes}-{rep}-{i}".encode().ljust(32, b"\0") for i in range(n)]
            raw_keys = [f"raw/{value_bytes}/{rep}/{i}" for i in range(n)]
            conn_keys = worker.keys(hashes)
            order = sides[rep % len(sides):] + sides[:rep % len(sides)]  # each side first in turn
            for side in order:
                if side == "layout":
                    assert layout is not None
                    keys = [f"layout/{value_bytes}/{rep}/{i}" for i in range(n)]
                    t0 = time.perf_counter()
                    layout.put(keys, layout.src)
                    t1 = time.perf_counter()
                    layout.get(keys, layout.dst)
                    t2 = time.perf_counter()
                    remove_values(backend, keys)
                elif side == "raw":
                    t0 = time.perf_counter()
                    raw_side.put(raw_keys, views)
                    t1 = time.perf_counter()
                    raw_side.get(raw_keys, views)
                    t2 = time.perf_counter()
                    raw_side.remove(raw_keys)
                else:
                    save = BlockTransfer(request_id=f"s{rep}", block_hashes=hashes, block_ids=[list(range(n))])
                    load = BlockTransfer(request_id=f"l{rep}", block_hashes=hashes, block_ids=[list(range(n, 2 * n))])
                    t0 = time.perf_counter()
                    worker.submit_saves(StorePlan(saves=[save]))
                    worker.wait_for_request_saves([save.request_id])
                    t1 = time.perf_counter()
                    worker.load_sync(StorePlan(loads=[load]))
                    t2 = time.perf_counter()
                    assert not worker.ledger.take_block_ids_with_load_errors()
                    assert worker.get_finished({save.request_id}) == {save.request_id}
                    remove_values(backend, conn_keys)
                if rep:
                    out[f"put_{side}"].append(nbytes / (t1 - t0) / 1e9)
                    out[f"get_{side}"].append(nbytes / (t2 - t1) / 1e9)
        first = next(iter(caches.values()))
        assert torch.equal(first[n:], first[:n]), "loaded KV differs from saved KV"
    finally:
        worker.close(10)
        backend.unregister_buffer(raw_view)
        if layout is not None:
            layout.close()
    return {k: median(v) for k, v in out.items()} | {"blocks": n}


def copy_check_ceilings() -> dict[str, float] | None:
    """The one-core ceilings of a copy plus the xxh3 check, measured now
    (:func:`benchmarks._lib.checksums.one_core_ceilings`); None without xxhash."""
    try:
        return one_core_ceilings(memoryview(os.urandom(32 << 20)))
    except ImportError:
        return None


def ratio_claim(what: str, backend: str, worst: float, ceilings: dict[str, float] | None) -> Claim:
    """``worst`` (connector / raw, check on) against its issue-25 target: the embedded store, whose
    raw side is a memory copy and whose loads are zero-copy (a copy plus a check either way), its
    one-core ceiling measured in this run; every other backend 0.9."""
    if backend == "embedded" and ceilings is not None:
        return against_target(f"{what} against its one-core ceiling (copy + xxh3 check on one core, this run)",
                              worst, ceilings["put"], fmt=".2f")
    return against_target(what, worst, 0.9, fmt=".2f")
