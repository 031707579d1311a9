"""Entry points: import-light (vLLM loads this in every process)."""

from kv_common.registry import ConnectorSpec, register_with_vllm

SPECS = (
    # Our own name always selects this connector; "UCMConnector" (vllm-ascend's and UCM's own class
    # name) is ours only while free. Each name is the name of its class in the module (vLLM's
    # MultiConnector needs that).
    ConnectorSpec(
        "KvUCMConnector", "kv_ucm.connector", "KvUCMConnector", shared_names=("UCMConnector",),
        config_parser="kv_ucm.config:parse_config",
    ),
)


def register() -> None:
    register_with_vllm(SPECS)
