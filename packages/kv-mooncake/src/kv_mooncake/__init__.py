"""kv-mooncake: P2P disaggregated prefill for vLLM over the Mooncake TransferEngine."""

__version__ = "0.1.0"
