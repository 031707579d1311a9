"""Entry points: import-light (vLLM loads this in every process)."""

from kv_common.registry import ConnectorSpec, register_with_vllm

SPECS = (ConnectorSpec("UCMConnector", "kv_ucm.connector", "UCMConnector"),)


def register() -> None:
    register_with_vllm(SPECS)
