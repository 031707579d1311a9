"""kv-store: KV-cache pool connector for vLLM (prefix reuse through pluggable backends)."""

__version__ = "0.1.0"
