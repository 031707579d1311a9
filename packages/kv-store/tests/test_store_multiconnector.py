"""Under vLLM's MultiConnector: the load-failure policy lands on the config the scheduler reads,
and the store connectors register Prometheus metrics (MultiConnector's observer asserts it)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm")

from kv_store.failure_policy import apply_recompute_policy, enclosing_transfer_configs  # noqa: E402
from vllm.config.kv_transfer import KVTransferConfig  # noqa: E402


@dataclass
class FakeVllmConfig:  # the one field of VllmConfig the walk reads
    kv_transfer_config: KVTransferConfig


def _multi(*children: str, policy: str = "fail") -> FakeVllmConfig:
    return FakeVllmConfig(KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy=policy,
        kv_connector_extra_config={"connectors": [{"kv_connector": c, "kv_role": "kv_both"} for c in children]},
    ))


def _child_like_multiconnector(outer: FakeVllmConfig, index: int, build):
    """What vLLM 0.32's ``MultiConnector._get_connector_classes_and_configs`` + ``__init__`` do:
    a shallow copy of the VllmConfig with a fresh KVTransferConfig, then the child's constructor."""
    vllm_config = outer  # the local name MultiConnector.__init__ holds the outer config under
    ktc = vllm_config.kv_transfer_config.kv_connector_extra_config["connectors"][index]
    temp_config = copy.copy(vllm_config)
    temp_config.kv_transfer_config = KVTransferConfig(**ktc, engine_id=vllm_config.kv_transfer_config.engine_id)
    return build(temp_config)


def test_policy_reaches_the_outer_config_the_scheduler_reads():
    outer = _multi("MooncakeConnectorV1", "AscendStoreConnector")
    changed = _child_like_multiconnector(
        outer, 1, lambda cfg: apply_recompute_policy(cfg.kv_transfer_config, "AscendStoreConnector"))
    assert outer.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert outer.kv_transfer_config in changed


def test_our_own_name_and_a_subclass_name_match():
    outer = _multi("MooncakeConnectorV1", "kv_store.AscendStoreConnector")
    _child_like_multiconnector(outer, 1, lambda cfg: apply_recompute_policy(cfg.kv_transfer_config, "AscendStoreConnector"))
    assert outer.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_a_wrapper_that_does_not_list_us_is_left_alone():
    outer = _multi("MooncakeConnectorV1", "NixlConnector")
    own = KVTransferConfig(kv_connector="AscendStoreConnector", kv_role="kv_both")
    found = _child_like_multiconnector(outer, 1, lambda cfg: enclosing_transfer_configs(own, "AscendStoreConnector"))
    assert found == []
    assert outer.kv_transfer_config.kv_load_failure_policy == "fail"


def test_alone_only_our_own_config_changes():
    own = KVTransferConfig(kv_connector="AscendStoreConnector", kv_role="kv_both")
    assert apply_recompute_policy(own, "AscendStoreConnector") == [own]
    assert own.kv_load_failure_policy == "recompute"
    assert apply_recompute_policy(own, "AscendStoreConnector") == []  # already set: nothing to log


def test_store_connector_registers_prometheus_metrics():
    """vLLM's MultiKVConnectorPromMetrics.observe asserts that every child whose stats arrive has
    prom metrics: without them the engine's stats logging crashed on the store's first stats."""
    from kv_store.stats import StoreStats, build_prom_metrics
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()

    def bound(cls):
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *a, **kw):
                super().__init__(*a, registry=registry, **kw)
        return Bound

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    prom = build_prom_metrics("AscendStoreConnector", FakeVllmConfig(KVTransferConfig()), types,
                              ["model_name", "engine"], {0: ["m", "0"]})
    stats = StoreStats()
    stats.incr("blocks_loaded", 3)
    stats.incr("lookup_hits", 1)
    stats.record_failure("corrupt")
    stats.record_get(4096, 0.002)
    prom.observe(stats.to_dict(), 0)
    value = registry.get_sample_value
    assert value("vllm:ascendstoreconnector_blocks_loaded_total", {"model_name": "m", "engine": "0"}) == 3
    assert value("vllm:ascendstoreconnector_failures_total", {"model_name": "m", "engine": "0"}) == 1
    assert value("vllm:ascendstoreconnector_get_seconds_count", {"model_name": "m", "engine": "0"}) == 1
