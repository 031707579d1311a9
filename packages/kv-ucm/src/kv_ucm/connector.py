"""UCMConnector: vLLM V1 KV offload and prefix reuse through UCM (Unified Cache Management).

Everything vLLM-facing (prefix lookup after the local prefix-cache hit, loads before the forward,
sync or layer-wise, saves after it in the background, load errors -> recompute, stats) is the
generic store connector of ``kv_common.store_connector``; this class says which config it reads
and builds a ``UcmBackend`` over the UCM store that config names::

    kv_transfer_config = {"kv_connector": "UCMConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {"UCM_CONFIG_FILE": "ucm.yaml"}}

On a CPU host the store that moves data is UCM's ``Posix`` pipeline (local disk or NFS).
"""

from __future__ import annotations

import os
from typing import Any

from kv_common.backend import Backend
from kv_common.logging_utils import get_logger
from kv_common.store_connector.connector import StoreConnectorBase

from kv_ucm.config import UCMConfig, UCMConfigError, UcmStoreSpec, resolve_store_spec
from kv_ucm.ucm_backend import UcmBackend
from kv_ucm.ucm_store import check_ucm_installation

logger = get_logger(__name__)


def expected_value_size(kv_cache_config: Any) -> int | None:
    """Bytes of one stored value (all layers of a block + the codec trailer), from vLLM's
    ``KVCacheConfig``; None when it cannot tell. The worker learns the real size from the KV
    tensors; this estimate lets the scheduler's lookup-only store publish the same UCM block size
    (UCM's Posix garbage collector requires it when enabled)."""
    from kv_common.store_connector import codec

    try:
        total = 0
        for group in kv_cache_config.kv_cache_groups:
            total += len(group.layer_names) * int(group.kv_cache_spec.page_size_bytes)
    except Exception:  # noqa: BLE001 - other vLLM versions / partial configs in unit tests
        return None
    return total + codec.TRAILER_SIZE if total > 0 else None


def check_storage_backends(spec: UcmStoreSpec) -> None:
    """UCM's Posix store needs its directories to exist (it reports a bare "-50002, 2" otherwise).
    They are not created here: an NFS mount point that is missing must not become a local dir."""
    cfg = spec.connector_config
    if "Posix" not in str(cfg.get("store_pipeline", "")).split("|"):
        return
    raw = cfg.get("storage_backends") or []
    dirs = [p for p in str(raw).split(":") if p] if isinstance(raw, (str, os.PathLike)) else [str(p) for p in raw]
    missing = [d for d in dirs if not os.path.isdir(d)]
    if missing:
        raise UCMConfigError(
            f"UCMConnector: storage_backends directory {', '.join(missing)} does not exist ({spec.source}); "
            "create it (or mount the NFS share) before starting vLLM"
        )


def _is_scheduler(role: Any) -> bool:
    return getattr(role, "name", str(role)).upper().endswith("SCHEDULER")


class UCMConnector(StoreConnectorBase):
    connector_name = "UCMConnector"
    config_type = UCMConfig

    def make_backend(self, config: UCMConfig, role: Any) -> Backend:  # type: ignore[override]  # its own config type
        check_ucm_installation()
        spec = resolve_store_spec(config)
        check_storage_backends(spec)
        hint = expected_value_size(getattr(self, "_kv_cache_config", None))
        self._value_size_hint = hint
        logger.info(
            "UCMConnector: UCM store %s from %s (pipeline %s, backends %s)",
            spec.connector_name, spec.source, spec.connector_config.get("store_pipeline"),
            spec.connector_config.get("storage_backends"),
        )
        if _is_scheduler(role):
            # Lookups only (UCM's device_id=-1 store); opened now so a bad config fails at start-up.
            return UcmBackend(spec.as_entry(), value_size=hint, lookup_only=True)
        # Worker: opened in register_kv_caches, once the KV layout gives the value size.
        return UcmBackend(spec.as_entry(), disk_capacity_bytes=config.disk_capacity_bytes)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        assert self._worker is not None
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
