"""vLLM-facing stats classes (import vLLM: only the connector module imports this)."""

from __future__ import annotations

from typing import Any

from kv_common.stats import PromCounter, PromHistogram, counter, failures_total, make_vllm_stats_class
from kv_common.stats import build_prom_metrics as _build_prom_metrics

MooncakeConnectorStats = make_vllm_stats_class("MooncakeConnectorStats")

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
_COUNTERS = [
    PromCounter("vllm:mooncake_pulled_bytes", "Bytes pulled from prefill instances.", lambda d: d.get("bytes", 0)),
    PromCounter("vllm:mooncake_pulls", "Successful KV pulls (one per request and decode rank).",
                lambda d: d.get("transfers", 0)),
    PromCounter("vllm:mooncake_pull_failures",
                "Failed or timed-out KV pulls (their blocks were reported as load errors).", failures_total),
    PromCounter("vllm:mooncake_expired_holds", "Prefill holds freed on expiry (no decode pulled in time).",
                counter("expired_holds")),
    PromCounter("vllm:mooncake_rejected_reads",
                "Pull requests refused because they named blocks not held for that request.",
                counter("rejected_reads")),
    PromCounter("vllm:mooncake_prompt_mismatches",
                "Decode requests whose kv_transfer_params were made for another prompt "
                "(nothing pulled, computed locally).", counter("prompt_mismatches")),
    PromCounter("vllm:mooncake_transfer_retries",
                "TransferEngine reads attempted again after a failed or stalled attempt.",
                counter("transfer_retries")),
]
_PULL_SECONDS = PromHistogram("vllm:mooncake_pull_seconds", "KV pull latency (seconds).", _LATENCY_BUCKETS,
                              lambda d: d.get("durations_s") or ())


def build_prom_metrics(vllm_config: Any, metric_types: dict, labelnames: list[str],
                       per_engine_labelvalues: dict[int, list[object]]) -> Any:
    """``KVConnectorBase_V1.build_prom_metrics``: counters and a pull-latency histogram, fed from the
    same ``KVConnectorStats`` data vLLM logs."""
    return _build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                               counters=_COUNTERS, histograms=[_PULL_SECONDS])
