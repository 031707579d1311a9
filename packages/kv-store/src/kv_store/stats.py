"""Store connector statistics: hits, misses, bytes, put/get latency.

Built on ``kv_common.stats.TransferStatsBase`` (counters, failures) with separate put and get
latency samples, so a log line shows both directions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kv_common.stats import (
    MAX_DURATION_SAMPLES,
    PromCounter,
    PromHistogram,
    TransferStatsBase,
    _percentile,
    counter,
    failures_total,
)
from kv_common.stats import build_prom_metrics as _build_prom_metrics


class StoreStats(TransferStatsBase):
    def reset(self) -> None:
        super().reset()
        self.put_durations_s: list[float] = []
        self.get_durations_s: list[float] = []

    def record_put(self, nbytes: int, seconds: float) -> None:
        self.record_transfer(nbytes, seconds)
        self.incr("put_bytes", int(nbytes))
        with self._lock:
            if len(self.put_durations_s) < MAX_DURATION_SAMPLES:
                self.put_durations_s.append(float(seconds))

    def record_get(self, nbytes: int, seconds: float) -> None:
        self.record_transfer(nbytes, seconds)
        self.incr("get_bytes", int(nbytes))
        with self._lock:
            if len(self.get_durations_s) < MAX_DURATION_SAMPLES:
                self.get_durations_s.append(float(seconds))

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        with self._lock:
            data["put_durations_s"] = list(self.put_durations_s)
            data["get_durations_s"] = list(self.get_durations_s)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> StoreStats:
        stats = super().from_dict(data)
        assert isinstance(stats, StoreStats)
        data = data or {}
        stats.put_durations_s = [float(d) for d in data.get("put_durations_s", ())][:MAX_DURATION_SAMPLES]
        stats.get_durations_s = [float(d) for d in data.get("get_durations_s", ())][:MAX_DURATION_SAMPLES]
        return stats

    def aggregate(self, other: TransferStatsBase) -> StoreStats:
        super().aggregate(other)
        if isinstance(other, StoreStats):
            with self._lock:
                for mine, theirs in ((self.put_durations_s, other.put_durations_s),
                                     (self.get_durations_s, other.get_durations_s)):
                    mine.extend(theirs[: max(0, MAX_DURATION_SAMPLES - len(mine))])
        return self

    def reduce(self) -> dict[str, int | float]:
        out = super().reduce()
        with self._lock:
            for name, values in (("put", sorted(self.put_durations_s)), ("get", sorted(self.get_durations_s))):
                out[f"{name}_p50_ms"] = round(_percentile(values, 50) * 1e3, 3)
                out[f"{name}_p99_ms"] = round(_percentile(values, 99) * 1e3, 3)
        return out


_lock = threading.Lock()
_vllm_class: type | None = None
StoreConnectorStats: Any  # bound by vllm_stats_class(); module __getattr__ until then


def vllm_stats_class() -> Any:
    """The ``KVConnectorStats`` subclass (created lazily: needs vLLM)."""
    global _vllm_class, StoreConnectorStats
    with _lock:
        if _vllm_class is None:
            from kv_common.stats import make_vllm_stats_class

            _vllm_class = make_vllm_stats_class("StoreConnectorStats", StoreStats, module=__name__)
            StoreConnectorStats = _vllm_class  # pickle finds it by this module-level name
        return _vllm_class


def __getattr__(name: str) -> Any:
    if name == "StoreConnectorStats":
        return vllm_stats_class()
    raise AttributeError(name)


_LATENCY_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
# metric suffix -> documentation; each reads the counter of that name in the stats dict
_PROM_COUNTERS = {
    "lookup_hits": "Store lookups that found blocks beyond the local prefix cache.",
    "lookup_misses": "Store lookups that found nothing to load.",
    "lookup_hit_tokens": "Tokens the store lookups offered to load.",
    "lookup_timeouts": "Store lookups that did not answer in time (counted as misses).",
    "lookup_breaker_opened": "Times the lookup circuit breaker opened (lookups timed out in a row).",
    "lookup_breaker_skips": "Lookups answered as misses without asking the backend (breaker open).",
    "load_timeouts": "Store loads that missed load_timeout_s (their blocks were recomputed).",
    "loads_skipped_backend_stalled": "Store loads failed at once while a late load still ran.",
    "save_timeouts": "Store saves given up after save_timeout_s (their blocks released).",
    "blocks_loaded": "KV blocks loaded from the store and verified.",
    "blocks_load_failed": "KV blocks that failed to load (missing or corrupt) and were recomputed.",
    "blocks_saved": "KV blocks saved to the store.",
    "blocks_save_failed": "KV blocks the store refused or failed to save.",
    "get_bytes": "Bytes loaded from the store.",
    "put_bytes": "Bytes saved to the store.",
}


def _durations(op: str) -> Callable[[Mapping[str, Any]], Iterable[float]]:
    """Reads ``StoreStats``' put or get latency samples from a stats dict."""
    return lambda data: data.get(f"{op}_durations_s") or ()


def build_prom_metrics(
    connector_name: str, vllm_config: Any, metric_types: dict, labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> Any:
    """``KVConnectorBase_V1.build_prom_metrics`` for the store connectors.

    Needed beyond the metrics themselves: vLLM's MultiConnector asserts that every child whose
    stats it observes registered Prometheus metrics, so a store connector beside one that has them
    (MooncakeConnectorV1) would otherwise crash the engine's stats logging on its first stats.
    """
    prefix = "vllm:" + "".join(c if c.isalnum() else "_" for c in connector_name.lower())
    counters = [PromCounter(f"{prefix}_{key}", doc, counter(key)) for key, doc in _PROM_COUNTERS.items()]
    counters.append(PromCounter(f"{prefix}_failures", "Store failures of any kind.", failures_total))
    histograms = [
        PromHistogram(f"{prefix}_{op}_seconds", f"Store {op} latency (seconds).", _LATENCY_BUCKETS, _durations(op))
        for op in ("put", "get")
    ]
    return _build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                               counters=counters, histograms=histograms)
