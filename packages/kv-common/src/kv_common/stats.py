"""Transfer statistics: a plain accumulator every connector shares, and its vLLM adapter.

The accumulator knows nothing of vLLM, so it is testable alone. vLLM moves connector stats from the
workers to the logger as ``KVConnectorStats`` objects whose ``data`` is a plain dict (pickled or
msgpack'd across processes); ``make_vllm_stats_class`` wraps the accumulator's dict in one, and
``build_prom_metrics`` turns the same dicts into Prometheus counters and histograms.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

MAX_DURATION_SAMPLES = 4096  # per reporting interval: enough for p99, bounded memory


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (q in [0, 100])."""
    if not sorted_values:
        return 0.0
    rank = max(1, -(-len(sorted_values) * q // 100))  # ceil without floats creeping in
    return sorted_values[int(min(rank, len(sorted_values))) - 1]


def _gb_per_s(num_bytes: int, seconds: float) -> float:
    return float(f"{num_bytes / seconds / 1e9:.4g}") if seconds > 0 else 0.0  # 4 significant digits


class TransferStatsBase:
    """Bytes, transfer count, latencies and failure counts for one reporting interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # transfers complete on background threads
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.num_bytes = 0
            self.num_transfers = 0
            self.total_seconds = 0.0
            self.durations_s: list[float] = []
            self.failures: dict[str, int] = {}
            self.counters: dict[str, int] = {}
            # Where a transfer's time goes: phase -> [transfers timed, seconds summed] (record_phases).
            self.phases: dict[str, list[float]] = {}

    def record_transfer(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.num_bytes += int(nbytes)
            self.num_transfers += 1
            self.total_seconds += float(seconds)
            if len(self.durations_s) < MAX_DURATION_SAMPLES:
                self.durations_s.append(float(seconds))

    def record_failure(self, kind: str) -> None:
        with self._lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def record_phases(self, seconds: Mapping[str, float]) -> None:
        """One transfer's time split into named phases (e.g. plan, read, confirm): the log shows each
        phase's mean, so a slow transfer says which part of it was slow."""
        with self._lock:
            for name, s in seconds.items():
                entry = self.phases.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += max(0.0, float(s))

    def is_empty(self) -> bool:
        return self.num_transfers == 0 and not self.failures and not any(self.counters.values())

    def to_dict(self) -> dict[str, Any]:
        """Plain builtins only: this crosses process boundaries inside vLLM."""
        with self._lock:
            return {
                "bytes": self.num_bytes,
                "transfers": self.num_transfers,
                "seconds": self.total_seconds,
                "durations_s": list(self.durations_s),
                "failures": dict(self.failures),
                "counters": dict(self.counters),
                "phases": {name: list(entry) for name, entry in self.phases.items()},
            }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> TransferStatsBase:
        stats = cls()
        data = data or {}
        stats.num_bytes = int(data.get("bytes", 0))
        stats.num_transfers = int(data.get("transfers", 0))
        stats.total_seconds = float(data.get("seconds", 0.0))
        stats.durations_s = [float(d) for d in data.get("durations_s", ())][:MAX_DURATION_SAMPLES]
        stats.failures = {str(k): int(v) for k, v in dict(data.get("failures", {})).items()}
        stats.counters = {str(k): int(v) for k, v in dict(data.get("counters", {})).items()}
        stats.phases = {str(k): [int(n), float(s)] for k, (n, s) in dict(data.get("phases", {})).items()}
        return stats

    def aggregate(self, other: TransferStatsBase) -> TransferStatsBase:
        """Add ``other`` into this one (e.g. another worker's interval); returns self."""
        snapshot = other.to_dict()
        with self._lock:
            self.num_bytes += snapshot["bytes"]
            self.num_transfers += snapshot["transfers"]
            self.total_seconds += snapshot["seconds"]
            room = MAX_DURATION_SAMPLES - len(self.durations_s)
            self.durations_s.extend(snapshot["durations_s"][: max(0, room)])
            for name, n in snapshot["failures"].items():
                self.failures[name] = self.failures.get(name, 0) + n
            for name, n in snapshot["counters"].items():
                self.counters[name] = self.counters.get(name, 0) + n
            for name, (n, s) in snapshot["phases"].items():
                entry = self.phases.setdefault(name, [0, 0.0])
                entry[0] += n
                entry[1] += s
        return self

    def reduce(self) -> dict[str, int | float]:
        """One line of numbers for the log: totals, throughput, latency percentiles, counters."""
        with self._lock:
            durations = sorted(self.durations_s)
            out: dict[str, int | float] = {
                "num_transfers": self.num_transfers,
                "bytes": self.num_bytes,
                # Summed over transfers: concurrent transfers make this per-transfer, not link, speed.
                "throughput_gb_s": _gb_per_s(self.num_bytes, self.total_seconds),
                "p50_latency_ms": round(_percentile(durations, 50) * 1e3, 3),
                "p99_latency_ms": round(_percentile(durations, 99) * 1e3, 3),
                "num_failures": sum(self.failures.values()),
            }
            out.update({f"failures_{kind}": n for kind, n in sorted(self.failures.items())})
            out.update(sorted(self.counters.items()))
            out.update({f"{name}_mean_ms": round(s / n * 1e3, 3) for name, (n, s) in sorted(self.phases.items()) if n})
        return out

    def phase_means_s(self) -> dict[str, float]:
        """Mean seconds per timed transfer of each phase (``record_phases``)."""
        with self._lock:
            return {name: s / n for name, (n, s) in self.phases.items() if n}


def make_vllm_stats_class(
    name: str,
    accumulator_cls: type[TransferStatsBase] = TransferStatsBase,
    module: str | None = None,
) -> Any:
    """A ``KVConnectorStats`` subclass whose ``data`` is ``accumulator_cls().to_dict()``.

    Bind it at module level under the same name (``MyStats = make_vllm_stats_class("MyStats")``)
    so pickle finds it in the other process. The connector returns ``MyStats.from_accumulator(acc)``
    from ``get_kv_connector_stats()`` and ``MyStats.build(data)`` from ``build_kv_connector_stats``.
    """
    from kv_common.vllm_compat import metrics_module

    base = metrics_module().KVConnectorStats

    def _acc(self: Any) -> TransferStatsBase:
        return accumulator_cls.from_dict(self.data)

    def reset(self: Any) -> None:
        self.data = accumulator_cls().to_dict()

    def aggregate(self: Any, other: Any) -> Any:
        if other is None or other.is_empty():
            return self
        self.data = _acc(self).aggregate(accumulator_cls.from_dict(other.data)).to_dict()
        return self

    def reduce(self: Any) -> dict[str, int | float]:
        return _acc(self).reduce()

    def is_empty(self: Any) -> bool:
        return _acc(self).is_empty()

    def from_accumulator(cls: type, accumulator: TransferStatsBase) -> Any:
        return cls(data=accumulator.to_dict())

    def build(cls: type, data: dict[str, Any] | None = None) -> Any:
        return cls(data=accumulator_cls().to_dict() if data is None else dict(data))

    if module is None:
        module = sys._getframe(1).f_globals.get("__name__", __name__)  # the caller binds it there
    return type(
        name,
        (base,),
        {
            "__module__": module,
            "__qualname__": name,
            "accumulator": _acc,
            "reset": reset,
            "aggregate": aggregate,
            "reduce": reduce,
            "is_empty": is_empty,
            "from_accumulator": classmethod(from_accumulator),
            "build": classmethod(build),
        },
    )


class PromCounter(NamedTuple):
    """A Prometheus counter fed from each stats dict ``data``: incremented by ``read(data)``."""

    name: str  # the full metric name, e.g. "vllm:mooncake_pulls" (prometheus_client adds _total)
    documentation: str
    read: Callable[[Mapping[str, Any]], float]


class PromHistogram(NamedTuple):
    """A Prometheus histogram observing every value of ``read(data)`` (e.g. a transfer's seconds)."""

    name: str
    documentation: str
    buckets: Sequence[float]
    read: Callable[[Mapping[str, Any]], Iterable[float]]


def counter(name: str) -> Callable[[Mapping[str, Any]], float]:
    """Reads ``TransferStatsBase.incr``'s counter ``name`` from a stats dict."""
    return lambda data: (data.get("counters") or {}).get(name, 0)


def failures_total(data: Mapping[str, Any]) -> float:
    """Every ``record_failure`` of a stats dict, of any kind."""
    return sum((data.get("failures") or {}).values())


def build_prom_metrics(
    vllm_config: Any, metric_types: Mapping[Any, Any], labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]], *,
    counters: Sequence[PromCounter], histograms: Sequence[PromHistogram] = (),
) -> Any:
    """A ``KVConnectorPromMetrics`` (what ``KVConnectorBase_V1.build_prom_metrics`` returns) that
    feeds ``counters`` and ``histograms`` from the ``KVConnectorStats`` data vLLM logs. The metric
    classes come from ``metric_types`` (vLLM's, bound to its registry), one child per engine."""
    from prometheus_client import Counter, Histogram

    from kv_common.vllm_compat import metrics_module

    base: Any = metrics_module().KVConnectorPromMetrics

    def per_engine(metric: Any) -> dict[int, Any]:  # as vllm.v1.metrics.utils.create_metric_per_engine
        return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

    class ConnectorPromMetrics(base):
        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            counter_cls, histogram_cls = metric_types[Counter], metric_types[Histogram]
            self.counters = [
                (c, per_engine(counter_cls(name=c.name, documentation=c.documentation, labelnames=labelnames)))
                for c in counters
            ]
            self.histograms = [
                (h, per_engine(histogram_cls(name=h.name, documentation=h.documentation, buckets=list(h.buckets),
                                             labelnames=labelnames)))
                for h in histograms
            ]

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            data = transfer_stats_data or {}
            for c, metric in self.counters:
                value = c.read(data)
                if value:
                    metric[engine_idx].inc(value)
            for h, metric in self.histograms:
                for value in h.read(data) or ():
                    metric[engine_idx].observe(value)

    return ConnectorPromMetrics()
