"""vLLM-facing stats classes (import vLLM: only the connector module imports this)."""

from __future__ import annotations

from typing import Any

from kv_common.stats import make_vllm_stats_class

MooncakeConnectorStats = make_vllm_stats_class("MooncakeConnectorStats")

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
_COUNTERS = {  # metric suffix -> (documentation, how to read it from the stats dict)
    "pulled_bytes": ("Bytes pulled from prefill instances.", lambda d: d.get("bytes", 0)),
    "pulls": ("Successful KV pulls (one per request and decode rank).", lambda d: d.get("transfers", 0)),
    "pull_failures": ("Failed or timed-out KV pulls (their blocks were reported as load errors).",
                      lambda d: sum((d.get("failures") or {}).values())),
    "expired_holds": ("Prefill holds freed on expiry (no decode pulled in time).",
                      lambda d: (d.get("counters") or {}).get("expired_holds", 0)),
    "rejected_reads": ("Pull requests refused because they named blocks not held for that request.",
                       lambda d: (d.get("counters") or {}).get("rejected_reads", 0)),
    "prompt_mismatches": ("Decode requests whose kv_transfer_params were made for another prompt "
                          "(nothing pulled, computed locally).",
                          lambda d: (d.get("counters") or {}).get("prompt_mismatches", 0)),
    "transfer_retries": ("TransferEngine reads attempted again after a failed or stalled attempt.",
                         lambda d: (d.get("counters") or {}).get("transfer_retries", 0)),
}


def build_prom_metrics(vllm_config: Any, metric_types: dict, labelnames: list[str],
                       per_engine_labelvalues: dict[int, list[object]]) -> Any:
    """``KVConnectorBase_V1.build_prom_metrics``: counters and a pull-latency histogram, fed from the
    same ``KVConnectorStats`` data vLLM logs."""
    from prometheus_client import Counter, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.v1.metrics.utils import create_metric_per_engine

    class MooncakePromMetrics(KVConnectorPromMetrics):
        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            counter_cls, histogram_cls = metric_types[Counter], metric_types[Histogram]
            self.counters = {
                key: create_metric_per_engine(
                    counter_cls(name=f"vllm:mooncake_{key}", documentation=doc, labelnames=labelnames),
                    per_engine_labelvalues,
                )
                for key, (doc, _) in _COUNTERS.items()
            }
            self.latency = create_metric_per_engine(
                histogram_cls(name="vllm:mooncake_pull_seconds", documentation="KV pull latency (seconds).",
                              buckets=_LATENCY_BUCKETS, labelnames=labelnames),
                per_engine_labelvalues,
            )

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            data = transfer_stats_data or {}
            for key, (_, read) in _COUNTERS.items():
                value = read(data)
                if value:
                    self.counters[key][engine_idx].inc(value)
            for seconds in data.get("durations_s") or ():
                self.latency[engine_idx].observe(seconds)

    return MooncakePromMetrics()
