"""Entry points: import-light (vLLM loads this in every process)."""

from kv_common.registry import ConnectorSpec, register_with_vllm

SPECS = (
    # Our own name always selects this connector; vllm-ascend's name is ours only while free.
    # Each name is the name of its class in the module (vLLM's MultiConnector needs that).
    ConnectorSpec(
        "KvMooncakeConnectorV1",
        "kv_mooncake.connector",
        "KvMooncakeConnectorV1",
        shared_names=("MooncakeConnectorV1",),
        config_parser="kv_mooncake.config:parse_config",
    ),
)


def register() -> None:
    register_with_vllm(SPECS)
