"""Entry points: import-light (vLLM loads this in every process)."""

from kv_common.registry import ConnectorSpec, register_with_vllm

SPECS = (ConnectorSpec("MooncakeConnectorV1", "kv_mooncake.connector", "MooncakeConnectorV1"),)


def register() -> None:
    register_with_vllm(SPECS)
