"""vLLM-facing stats class (imports vLLM: only the connector module imports this)."""

from kv_common.stats import make_vllm_stats_class

MooncakeConnectorStats = make_vllm_stats_class("MooncakeConnectorStats")
