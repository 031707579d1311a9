"""UCM as a backend of kv-store's store connector core: the ``ucm`` entry point of the
``kv_store.backends`` group (``kv_store.backends.resolve_factory("ucm")``).

The factory reads UCM's own settings (``UCM_CONFIG_FILE`` or the inline ``ucm_connectors``), which
only ``UCMConfig`` carries: select it with ``"kv_connector": "UCMConnector"``.
"""

from __future__ import annotations

import os
from typing import Any

from kv_common.backend import Backend
from kv_common.config import ConfigKeyError
from kv_common.logging_utils import get_logger

from kv_ucm.config import UCMConfig, UCMConfigError, UcmStoreSpec, resolve_store_spec
from kv_ucm.installation import check_ucm_installation
from kv_ucm.ucm_backend import UcmBackend

logger = get_logger(__name__)


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


def make_ucm_backend(config: Any, role: Any = None, value_size_hint: int | None = None) -> Backend:
    """A ``UcmBackend`` over the UCM store ``config`` names. The scheduler's is lookup-only and
    opened now (a bad config fails at start-up); the worker's is opened by the connector once the
    KV layout gives the value size."""
    if not isinstance(config, UCMConfig):
        raise ConfigKeyError(
            "backend", "'ucm' needs UCM's settings (UCM_CONFIG_FILE or ucm_connectors): use "
            '"kv_connector": "UCMConnector" (or KvUCMConnector) with them'
        )
    check_ucm_installation()
    spec = resolve_store_spec(config)
    check_storage_backends(spec)
    logger.info(
        "UCMConnector: UCM store %s from %s (pipeline %s, backends %s)",
        spec.connector_name, spec.source, spec.connector_config.get("store_pipeline"),
        spec.connector_config.get("storage_backends"),
    )
    if _is_scheduler(role):
        return UcmBackend(spec.as_entry(), value_size=value_size_hint, lookup_only=True)
    return UcmBackend(spec.as_entry(), disk_capacity_bytes=config.disk_capacity_bytes)
