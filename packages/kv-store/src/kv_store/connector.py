"""AscendStoreConnector: the KV pool connector (prefix reuse through a store backend).

Everything generic lives in ``kv_common.store_connector``; this class only says which config it
reads and how to build its backend (``backend`` key -> ``kv_store.backends`` entry point).
"""

from __future__ import annotations

from typing import Any

from kv_common.backend import Backend
from kv_common.logging_utils import get_logger

from kv_store.backends import make_backend
from kv_store.config import StoreConfig
from kv_store.connector_base import StoreConnectorBase

logger = get_logger(__name__)


class AscendStoreConnector(StoreConnectorBase):
    connector_name = "AscendStoreConnector"
    config_type = StoreConfig

    def make_backend(self, config: Any, role: Any) -> Backend:
        return make_backend(config, role)


_deprecation_logged = False


class MooncakeConnectorStoreV1(AscendStoreConnector):
    """Legacy vllm-ascend name; same behaviour."""

    connector_name = "MooncakeConnectorStoreV1"

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        global _deprecation_logged
        if not _deprecation_logged:
            _deprecation_logged = True
            logger.warning(
                "kv_connector 'MooncakeConnectorStoreV1' is deprecated: use 'AscendStoreConnector' "
                "(same config keys)."
            )
        super().__init__(vllm_config, role, kv_cache_config)


class KvAscendStoreConnector(AscendStoreConnector):
    """This connector under our own name, which no other package registers (vllm-ascend registers
    ``AscendStoreConnector`` for its own class). A registered name is always its class's ``__name__``:
    vLLM's MultiConnector looks a child's class up in the registry by that name."""
