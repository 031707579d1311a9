"""kv-ucm: KV offload and reuse for vLLM through UCM (Unified Cache Management)."""

__version__ = "0.1.0"
