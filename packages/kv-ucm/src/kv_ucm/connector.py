"""UCMConnector: vLLM V1 KV offload and prefix reuse through UCM (Unified Cache Management).

Everything vLLM-facing (prefix lookup after the local prefix-cache hit, loads before the forward,
sync or layer-wise, saves after it in the background, load errors -> recompute, stats) is the
generic store connector of kv-store (``kv_store.connector_base``); this class says which config it reads
and builds a ``UcmBackend`` over the UCM store that config names (kv-store's ``ucm`` backend)::

    kv_transfer_config = {"kv_connector": "UCMConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {"UCM_CONFIG_FILE": "ucm.yaml"}}

On a CPU host the store that moves data is UCM's ``Posix`` pipeline (local disk or NFS).
"""

from __future__ import annotations

from typing import Any

from kv_common.backend import Backend
from kv_common.kv_cache_groups import UnsupportedKVGroup
from kv_common.logging_utils import get_logger
from kv_store.connector_base import StoreConnectorBase
from kv_store.group_worker import GroupedStoreWorker

from kv_ucm.backend_factory import make_ucm_backend
from kv_ucm.config import UCMConfig
from kv_ucm.ucm_backend import UcmBackend

logger = get_logger(__name__)


def expected_value_size(kv_cache_config: Any) -> int | None:
    """Bytes of one stored value (all layers of a block of one KV-cache group + the codec trailer),
    from vLLM's ``KVCacheConfig``; None when it cannot tell, or when groups differ. The worker learns the real size from the KV
    tensors; this estimate lets the scheduler's lookup-only store publish the same UCM block size
    (UCM's Posix garbage collector requires it when enabled)."""
    from kv_store import codec

    try:
        sizes = {len(group.layer_names) * int(group.kv_cache_spec.page_size_bytes)
                 for group in kv_cache_config.kv_cache_groups}
    except Exception:  # noqa: BLE001 - other vLLM versions / partial configs in unit tests
        return None
    if len(sizes) != 1 or min(sizes) <= 0:
        return None
    return min(sizes) + codec.TRAILER_SIZE


class UCMConnector(StoreConnectorBase):
    connector_name = "UCMConnector"
    config_type = UCMConfig

    def make_backend(self, config: UCMConfig, role: Any) -> Backend:  # type: ignore[override]  # its own config type
        # The factory behind kv-store's "ucm" backend entry point, called directly: this connector
        # always means UCM (and carries the value-size hint the factory needs).
        hint = expected_value_size(getattr(self, "_kv_cache_config", None))
        self._value_size_hint = hint
        return make_ucm_backend(config, role, value_size_hint=hint)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        assert self._worker is not None
        if isinstance(self._worker, GroupedStoreWorker):
            sizes = {g: w.value_size for g, w in self._worker.workers.items()}
            if len(set(sizes.values())) > 1:
                # one UCM store, one block size: every group's values must have it
                raise UnsupportedKVGroup(
                    f"UCMConnector: the KV-cache groups' values differ in size ({sizes}, bytes by group): "
                    "a UCM store holds blocks of one size")
        size = self._worker.value_size
        hint = getattr(self, "_value_size_hint", None)
        if hint is not None and hint != size:
            logger.warning(
                "UCMConnector: KV value size %d differs from the %d expected from the KV-cache config "
                "(matters only with UCM's posix_gc_enable)", size, hint,
            )
        backend = self.backend
        if isinstance(backend, UcmBackend):
            backend.open(size)


class KvUCMConnector(UCMConnector):
    """This connector under our own name, which no other package registers (vllm-ascend and UCM use
    ``UCMConnector``). A registered name is always its class's ``__name__``: vLLM's MultiConnector
    looks a child's class up in the registry by that name."""
