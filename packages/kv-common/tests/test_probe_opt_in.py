"""The probe connector is test code: vLLM knows it only when KV_COMMON_ENABLE_PROBE=1."""

from __future__ import annotations

import pytest
from kv_common import registry, vllm_compat
from kv_common.testing import probe


class FakeConnectorFactory:
    _registry: dict = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")
        cls._registry[name] = lambda: (module_path, class_name)


@pytest.fixture
def fake_factory(monkeypatch):
    monkeypatch.setattr(FakeConnectorFactory, "_registry", {})
    monkeypatch.setattr(vllm_compat, "connector_factory", lambda: FakeConnectorFactory)
    monkeypatch.setattr(registry, "_registered", {})
    return FakeConnectorFactory


@pytest.mark.parametrize("value", [None, "", "0", "false"])
def test_probe_not_registered_by_default(fake_factory, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(probe.PROBE_ENV, raising=False)
    else:
        monkeypatch.setenv(probe.PROBE_ENV, value)
    probe.register()  # the vllm.general_plugins entry point
    assert probe.PROBE_NAME not in fake_factory._registry


@pytest.mark.parametrize("value", ["1", "true"])
def test_probe_registered_when_asked(fake_factory, monkeypatch, value):
    monkeypatch.setenv(probe.PROBE_ENV, value)
    probe.register()
    assert probe.PROBE_NAME in fake_factory._registry


def test_uses_probe_finds_it_in_multiconnector():
    assert probe.uses_probe(probe.probe_config("/tmp/x"))
    multi = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "KvAscendStoreConnector"}, probe.probe_config("/tmp/x")]}}
    assert probe.uses_probe(multi)
    assert not probe.uses_probe({"kv_connector": "KvAscendStoreConnector"})
    assert not probe.uses_probe(None)


def test_engine_process_enables_probe_only_for_probe_configs(tmp_path, monkeypatch):
    pytest.importorskip("psutil")
    from kv_common.testing.engine import EngineProcess

    monkeypatch.delenv(probe.PROBE_ENV, raising=False)
    on = EngineProcess(tmp_path, kv_transfer_config=probe.probe_config(tmp_path / "t"))
    off = EngineProcess(tmp_path, kv_transfer_config={"kv_connector": "KvAscendStoreConnector"})
    assert on.env.get(probe.PROBE_ENV) == "1"
    assert probe.PROBE_ENV not in off.env
