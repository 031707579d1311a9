"""Prometheus metrics of the proxy (own registry: two proxies in one process do not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ProxyMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kv_proxy_requests", "Client requests by endpoint and final HTTP status",
                                ["endpoint", "status"], registry=r)
        self.leg_failures = Counter("kv_proxy_leg_failures", "Failed legs (connect, 5xx, timeout, ...)",
                                    ["role", "instance", "kind"], registry=r)
        self.retries = Counter("kv_proxy_retries", "Legs retried on another instance", ["role"], registry=r)
        self.fallbacks = Counter("kv_proxy_decode_only_fallbacks",
                                 "Requests sent to a decode without a prefill (--fallback decode-only)",
                                 registry=r)
        self.disconnects = Counter("kv_proxy_client_disconnects", "Clients gone before their answer ended",
                                   registry=r)
        self.releases = Counter("kv_proxy_prefill_releases",
                                "FreeNow sent to a prefill whose blocks no decode will pull", ["result"],
                                registry=r)
        self.instance_changes = Counter("kv_proxy_instance_changes",
                                        "Instances that joined or left the pool at run time",
                                        ["role", "change"], registry=r)
        self.requests_by_path = Counter("kv_proxy_requests_by_path",
                                        "Client requests by how they were served: disaggregated (prefill "
                                        "then decode), decode_only_short (below --decode-only-below), "
                                        "decode_only_cached (a decode held most of it), decode_only_fallback "
                                        "(no prefill could serve)", ["path"], registry=r)
        self.kv_event_messages = Counter("kv_proxy_kv_event_messages",
                                         "KV event messages from an instance: ok, gap (index cleared), bad",
                                         ["instance", "outcome"], registry=r)
        self.prefix_index_blocks = Gauge("kv_proxy_prefix_index_blocks",
                                         "Blocks the proxy knows an instance holds (from its KV events)",
                                         ["instance"], registry=r)
        self.prefix_routed = Counter("kv_proxy_prefix_routed",
                                     "Prefill legs by whether the chosen instance held a prefix of the prompt "
                                     "(hit) or not (miss; token-id prompts with --kv-events only)",
                                     ["outcome"], registry=r)
        self.healthy = Gauge("kv_proxy_instance_healthy", "1 when the instance is in rotation",
                             ["role", "instance"], registry=r)
        self.outstanding = Gauge("kv_proxy_outstanding_tokens", "Estimated tokens in flight",
                                 ["role", "instance"], registry=r)
        self.prefill_seconds = Histogram("kv_proxy_prefill_seconds", "Prefill leg duration",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfb_seconds = Histogram("kv_proxy_time_to_first_byte_seconds",
                                      "Client request to the decode's first byte (TTFT for streams)",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("kv_proxy_request_seconds", "Whole client requests",
                                         buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
