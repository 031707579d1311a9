"""Entry points: import-light (vLLM loads this in every process)."""

from kv_common.registry import ConnectorSpec, register_with_vllm

SPECS = (
    ConnectorSpec("AscendStoreConnector", "kv_store.connector", "AscendStoreConnector"),
    # Legacy name kept for vllm-ascend users; the class logs a deprecation warning.
    ConnectorSpec("MooncakeConnectorStoreV1", "kv_store.connector", "MooncakeConnectorStoreV1"),
)


def register() -> None:
    register_with_vllm(SPECS)
