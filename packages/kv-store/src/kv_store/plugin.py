"""Entry points: import-light (vLLM loads this in every process)."""

from kv_common.registry import ConnectorSpec, register_with_vllm

SPECS = (
    # Our own names always select these connectors; vllm-ascend's names are ours only while free.
    ConnectorSpec(
        "kv_store.AscendStoreConnector",
        "kv_store.connector",
        "AscendStoreConnector",
        shared_names=("AscendStoreConnector",),
        config_parser="kv_store.config:parse_config",
    ),
    # Legacy name kept for vllm-ascend users; the class logs a deprecation warning.
    ConnectorSpec(
        "kv_store.MooncakeConnectorStoreV1",
        "kv_store.connector",
        "MooncakeConnectorStoreV1",
        shared_names=("MooncakeConnectorStoreV1",),
        config_parser="kv_store.config:parse_config",
    ),
)


def register() -> None:
    register_with_vllm(SPECS)
