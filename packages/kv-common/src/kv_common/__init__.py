"""kv-common: what every kv-* vLLM KV connector shares."""

__version__ = "0.1.0"
