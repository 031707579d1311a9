"""Entry points: import-light (vLLM loads this in every process)."""

from kv_common.registry import ConnectorSpec, register_with_vllm

SPECS = (
    # Our own name always selects this connector; vllm-ascend's names are ours only while free.
    # Each name is the name of its class in the module (vLLM's MultiConnector needs that);
    # MooncakeConnectorStoreV1 is the legacy name (that class logs a deprecation warning).
    ConnectorSpec(
        "KvAscendStoreConnector",
        "kv_store.connector",
        "KvAscendStoreConnector",
        shared_names=("AscendStoreConnector", "MooncakeConnectorStoreV1"),
        config_parser="kv_store.config:parse_config",
    ),
)


def register() -> None:
    register_with_vllm(SPECS)
