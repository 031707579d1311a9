"""Worker side: whole KV blocks between the paged cache and the store.

- Values: one per block, all layers concatenated in registration order, then a checksum trailer
  (``codec``, sealed by ``seal``). ``register_kv_caches`` learns the layout (``kv_view``) and
  registers the host buffers with the backend once (``staging``: staging rows, or the KV tensors
  themselves for the zero-copy parts path).
- ``StoreWorker`` composes one role per object: the block view, the ``StoreSaver`` (background
  saves, their deadline and the pending frees) and the ``StoreLoader`` (sync and async loads,
  their deadline, the late-fetch guard); both report stored and missing blocks through one
  ``BlockReport``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from kv_common.backend import Backend
from kv_common.failure_ledger import FailureLedger
from kv_common.idle_step import IdleStepWait
from kv_common.logging_utils import get_logger

from kv_store import codec
from kv_store import keys as keys_mod
from kv_store.config import StoreConnectorConfig
from kv_store.kv_view import CacheBuffers, KVBlockView, KVHeads
from kv_store.loader import StoreLoader
from kv_store.metadata import StorePlan, StoreReport
from kv_store.report import BlockReport
from kv_store.saver import StoreSaver
from kv_store.seal import ValueSeal
from kv_store.staging import Staging, ZeroCopyParts
from kv_store.stats import StoreStats
from kv_store.store_access import StoreAccess

logger = get_logger(__name__)


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
        kv_heads: int | None = None,
        head_size: int | None = None,
        use_mla: bool = False,
        zero_copy: bool = True,
        idle_wait: IdleStepWait | None = None,
    ) -> None:
        """``host_kv``: whether the KV caches are host memory (None: decided from their device).
        False forces the device copy path (tests prove it on CPU with guard tensors).
        ``kv_heads`` (on this rank) and ``head_size``: to find the block dimension of the KV
        tensors (``kv_view``); None: by their strides. ``zero_copy``: False keeps a parts backend
        on the staging path. ``idle_wait``: shared by the workers of one connector (one per
        KV-cache group), so news of any of them ends an idle step's wait."""
        self.backend = backend
        self.namespace = namespace
        self.rank_tag = rank_tag
        self.config = config
        self.layer_groups = dict(layer_groups or {})
        self.stats = stats if stats is not None else StoreStats()
        self.ledger = ledger if ledger is not None else FailureLedger()
        self._host_kv = host_kv
        self._heads = KVHeads(kv_heads, head_size, use_mla) if kv_heads and head_size else None
        self._zero_copy = zero_copy and backend.capabilities.zero_copy_parts
        self.view: KVBlockView | None = None
        self._save_staging: Staging | None = None
        self._load_staging: Staging | None = None
        self._parts: ZeroCopyParts | None = None
        # fails at start-up when the key is missing
        self.seal = ValueSeal(config.checksum, codec.mac_key_from_env(config.mac_key_env))
        self._report = BlockReport()
        store = StoreAccess(backend, self.keys, self.seal, self.stats, self._report)
        # Its saves and loads end an idle step's wait early (kv_common.idle_step): the connector's
        # wait, shared by every group's worker, or one of its own.
        self.idle_wait = idle_wait if idle_wait is not None else IdleStepWait(config.idle_step_wait_ms)
        self.saver = StoreSaver(store, config, writes_blocks=writes_blocks, on_done=self.idle_wait.notify)
        self.loader = StoreLoader(store, config, ledger=self.ledger, on_done=self.idle_wait.notify)
        self._closed = False

    # ---- layout ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        view = KVBlockView.of(kv_caches, layer_groups=self.layer_groups, host_kv=self._host_kv, heads=self._heads)
        save, load = (Staging(view.value_size, self.config.staging_bytes, self.backend, view.kv_device)
                      for _ in range(2))
        self.view, self._save_staging, self._load_staging = view, save, load
        # backends register host memory: device KV always goes through staging
        if self._zero_copy and view.host_kv:
            self._parts = ZeroCopyParts.register(self.backend, view.host_buffers(), save.slots)
        parts = self._parts
        self.saver.attach(CacheBuffers(view, save, parts.save_trailers if parts is not None else None))
        self.loader.attach(CacheBuffers(view, load, parts.load_trailers if parts is not None else None))
        logger.info(
            "store worker: %d layers, %d bytes per block value, %d staging slots, %s path",
            len(view.layers), view.value_size, save.slots, "zero-copy parts" if parts is not None else "staging",
        )

    @property
    def value_size(self) -> int:
        """Bytes of one stored value (0 until ``register_kv_caches``)."""
        return self.view.value_size if self.view is not None else 0

    @property
    def zero_copy(self) -> bool:
        """Whether values move straight between the KV cache and the backend (parts path)."""
        return self._parts is not None

    @property
    def layout_tag(self) -> int:
        return self.seal.layout_tag

    @layout_tag.setter
    def layout_tag(self, tag: int) -> None:
        self.seal.layout_tag = tag  # before any value is sealed or checked

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        """The store keys of ``hashes`` under this worker's namespace and rank tag."""
        return keys_mod.block_keys(self.namespace, self.rank_tag, hashes)

    # ---- per step -------------------------------------------------------------------------
    def submit_saves(self, plan: StorePlan) -> None:
        self.saver.submit(plan)

    def wait_for_request_saves(self, request_ids: Sequence[str]) -> None:
        self.saver.wait_for(request_ids)

    def in_flight(self) -> bool:
        """Whether vLLM keeps stepping for this worker: async loads not reported, or requests whose
        blocks wait for their saves."""
        return self.loader.pending > 0 or self.saver.holds_requests()

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        self.ledger.forget_requests(finished_req_ids)  # their failed blocks went out when they failed
        return self.saver.finished(finished_req_ids)

    def load_sync(self, plan: StorePlan) -> None:
        self.loader.load_sync(plan)

    def start_async(self, plan: StorePlan) -> None:
        self.loader.start_async(plan)

    def take_finished_loads(self, finished_req_ids: set[str]) -> set[str]:
        return self.loader.take_finished(finished_req_ids)

    def take_report(self) -> StoreReport | None:
        return self._report.take(self.rank_tag)

    def leak_report(self) -> dict[str, int]:
        saves = self.saver.leak_report()
        return {"pending_saves": saves["pending_saves"], "pending_loads": self.loader.pending,
                "held_requests": saves["held_requests"]}

    def close(self, timeout_s: float) -> None:
        if self._closed:
            return
        self._closed = True
        self.saver.close(time.monotonic() + timeout_s)
        self.loader.close()
        for staging in (self._save_staging, self._load_staging):
            if staging is not None:
                staging.close()
        if self._parts is not None:
            self._parts.close()
