from __future__ import annotations

import pickle
import threading

import pytest
from kv_common.stats import (
    MAX_DURATION_SAMPLES,
    PromCounter,
    PromHistogram,
    TransferStatsBase,
    build_prom_metrics,
    counter,
    failures_total,
    make_vllm_stats_class,
)


def test_accumulates_and_reduces():
    s = TransferStatsBase()
    assert s.is_empty()
    for ms in range(1, 101):  # 1..100 ms, 1 MB each
        s.record_transfer(1_000_000, ms / 1000)
    s.record_failure("timeout")
    s.record_failure("timeout")
    s.record_failure("remote_closed")
    s.incr("lookups", 5)
    s.incr("lookups")
    assert not s.is_empty()
    r = s.reduce()
    assert r["num_transfers"] == 100
    assert r["bytes"] == 100_000_000
    total_s = sum(range(1, 101)) / 1000
    assert r["throughput_gb_s"] == pytest.approx(0.1 / total_s, rel=1e-2)
    assert r["p50_latency_ms"] == pytest.approx(50.0)
    assert r["p99_latency_ms"] == pytest.approx(99.0)
    assert r["num_failures"] == 3
    assert r["failures_timeout"] == 2 and r["failures_remote_closed"] == 1
    assert r["lookups"] == 6


def test_empty_reduce_has_zeros():
    r = TransferStatsBase().reduce()
    assert r["throughput_gb_s"] == 0.0 and r["p99_latency_ms"] == 0.0 and r["num_transfers"] == 0


def test_dict_round_trip_and_aggregate():
    a, b = TransferStatsBase(), TransferStatsBase()
    a.record_transfer(10, 0.5)
    a.record_failure("x")
    b.record_transfer(30, 1.5)
    b.incr("hits", 2)
    a.aggregate(TransferStatsBase.from_dict(b.to_dict()))
    d = a.to_dict()
    assert d["bytes"] == 40 and d["transfers"] == 2 and d["seconds"] == pytest.approx(2.0)
    assert d["durations_s"] == [0.5, 1.5]
    assert d["failures"] == {"x": 1} and d["counters"] == {"hits": 2}
    assert TransferStatsBase.from_dict(d).to_dict() == d
    assert TransferStatsBase.from_dict(None).is_empty()
    a.reset()
    assert a.is_empty() and a.to_dict()["durations_s"] == []


def test_duration_samples_are_capped_but_totals_are_not():
    s = TransferStatsBase()
    for _ in range(MAX_DURATION_SAMPLES + 10):
        s.record_transfer(1, 0.001)
    assert len(s.durations_s) == MAX_DURATION_SAMPLES
    assert s.num_transfers == MAX_DURATION_SAMPLES + 10
    s.aggregate(s.from_dict(s.to_dict()))
    assert len(s.durations_s) == MAX_DURATION_SAMPLES


def test_thread_safe_recording():
    s = TransferStatsBase()

    def work() -> None:
        for _ in range(1000):
            s.record_transfer(2, 0.0)
            s.incr("n")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.num_transfers == 4000 and s.num_bytes == 8000 and s.counters["n"] == 4000


class CountingStats(TransferStatsBase):
    """Connectors subclass the accumulator; the vLLM class must use the subclass."""


def test_vllm_stats_class_follows_the_kvconnectorstats_contract():
    metrics = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
    stats_cls = make_vllm_stats_class("ProbeStats", CountingStats)
    globals()["ProbeStats"] = stats_cls  # bound at module level, as connectors do, for pickle
    assert issubclass(stats_cls, metrics.KVConnectorStats)
    assert stats_cls.__module__ == __name__

    empty = stats_cls()
    assert empty.is_empty()
    acc = CountingStats()
    acc.record_transfer(1000, 0.001)
    acc.record_failure("timeout")
    worker0 = stats_cls.from_accumulator(acc)
    worker1 = stats_cls.build(worker0.to_dict())  # what build_kv_connector_stats(data) does
    assert not worker0.is_empty()
    merged = worker0.aggregate(worker1)
    assert merged.reduce()["num_transfers"] == 2
    assert merged.reduce()["failures_timeout"] == 2
    assert merged.aggregate(empty) is merged

    # Crosses process boundaries: pickle (vLLM's fallback) and plain data both work.
    clone = pickle.loads(pickle.dumps(merged))
    assert type(clone) is stats_cls and clone.data == merged.data
    assert stats_cls.build(None).is_empty()

    merged.reset()
    assert merged.is_empty()


def test_vllm_logging_path_uses_reduce():
    pytest.importorskip("vllm")
    stats_cls = make_vllm_stats_class("LogStats")
    acc = TransferStatsBase()
    acc.record_transfer(2_000_000_000, 1.0)
    stats = stats_cls.from_accumulator(acc)
    # vLLM's KVConnectorLogging.log joins reduce() into "k=v, ..." after checking is_empty().
    assert not stats.is_empty()
    line = ", ".join(f"{k}={v}" for k, v in stats.reduce().items())
    assert "throughput_gb_s=2.0" in line


def test_prom_metrics_are_fed_from_the_stats_dict_per_engine():
    pytest.importorskip("vllm")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()

    def bind(cls):  # register into a private registry, like vLLM's own metric wrappers
        return lambda *a, **kw: cls(*a, registry=registry, **kw)

    prom = build_prom_metrics(
        type("VllmConfig", (), {"kv_transfer_config": None})(),
        {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)},
        ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]},
        counters=[PromCounter("vllm:probe_retries", "Retries.", counter("retries")),
                  PromCounter("vllm:probe_failures", "Failures.", failures_total)],
        histograms=[PromHistogram("vllm:probe_seconds", "Latency.", [0.1, 1.0], lambda d: d.get("durations_s") or ())],
    )
    acc = TransferStatsBase()
    acc.incr("retries", 2)
    acc.record_failure("timeout")
    acc.record_failure("corrupt")
    acc.record_transfer(10, 0.05)
    prom.observe(acc.to_dict(), 1)
    prom.observe({}, 0)  # an empty dict increments nothing
    one, zero = {"model_name": "m", "engine": "1"}, {"model_name": "m", "engine": "0"}
    value = registry.get_sample_value
    assert value("vllm:probe_retries_total", one) == 2
    assert value("vllm:probe_failures_total", one) == 2
    assert value("vllm:probe_seconds_bucket", {**one, "le": "0.1"}) == 1
    assert value("vllm:probe_retries_total", zero) == 0
    assert value("vllm:probe_seconds_count", zero) == 0


def test_phases_reduce_to_means_and_survive_the_round_trip():
    a, b = TransferStatsBase(), TransferStatsBase()
    a.record_phases({"plan": 0.001, "read": 0.010})
    a.record_phases({"plan": 0.003, "read": 0.020, "confirm": 0.0005})
    b.record_phases({"read": 0.030, "confirm": -1.0})  # a clock step never makes a phase negative
    a.aggregate(TransferStatsBase.from_dict(b.to_dict()))
    r = a.reduce()
    assert r["plan_mean_ms"] == pytest.approx(2.0)
    assert r["read_mean_ms"] == pytest.approx(20.0)
    assert r["confirm_mean_ms"] == pytest.approx(0.25)
    assert a.phase_means_s() == pytest.approx({"plan": 0.002, "read": 0.020, "confirm": 0.00025})
    d = a.to_dict()
    assert TransferStatsBase.from_dict(d).to_dict() == d
    a.reset()
    assert a.phase_means_s() == {} and "read_mean_ms" not in a.reduce()
