"""Connector stats reach Prometheus through ``build_prom_metrics`` (vLLM's KVConnectorProm path)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
prometheus_client = pytest.importorskip("prometheus_client")


def test_stats_dict_becomes_prometheus_samples():
    from kv_mooncake.connector import MooncakeConnectorV1
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()

    def bind(cls):  # register into a private registry, like vLLM's own metric wrappers
        return lambda *a, **kw: cls(*a, registry=registry, **kw)

    metrics = MooncakeConnectorV1.build_prom_metrics(
        type("VllmConfig", (), {"kv_transfer_config": None})(),
        {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)},
        ["model_name", "engine"], {0: ["m", "0"]},
    )
    data = {"bytes": 4096, "transfers": 2, "seconds": 0.3, "durations_s": [0.1, 0.2],
            "failures": {"timeout": 1, "pull": 2}, "counters": {"expired_holds": 1, "rejected_reads": 4, "transfer_retries": 2}}
    metrics.observe(data, 0)
    metrics.observe({"bytes": 4, "transfers": 1, "durations_s": [0.05]}, 0)
    text = generate_latest(registry).decode()
    label = '{engine="0",model_name="m"}'
    for line in (f"vllm:mooncake_pulled_bytes_total{label} 4100.0", f"vllm:mooncake_pulls_total{label} 3.0",
                 f"vllm:mooncake_pull_failures_total{label} 3.0", f"vllm:mooncake_expired_holds_total{label} 1.0", f"vllm:mooncake_transfer_retries_total{label} 2.0",
                 f"vllm:mooncake_rejected_reads_total{label} 4.0", f"vllm:mooncake_pull_seconds_count{label} 3.0"):
        assert line in text, (line, text)
