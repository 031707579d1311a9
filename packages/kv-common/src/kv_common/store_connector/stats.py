"""Store connector statistics: hits, misses, bytes, put/get latency.

Built on ``kv_common.stats.TransferStatsBase`` (counters, failures) with separate put and get
latency samples, so a log line shows both directions.
"""

from __future__ import annotations

import threading
from typing import Any

from kv_common.stats import MAX_DURATION_SAMPLES, TransferStatsBase, _percentile


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
