from __future__ import annotations

import importlib
import sys

import pytest
from kv_common import registry, vllm_compat
from kv_common.registry import ConnectorRegistryError, ConnectorSpec, discover_connectors, register_with_vllm


class FakeDist:
    def __init__(self, name: str, version: str):
        self.metadata = {"Name": name}
        self.version = version


class FakeEntryPoint:
    def __init__(self, name: str, target, dist: FakeDist | None = None, value: str = "pkg.mod:SPECS"):
        self.name, self.value, self.dist, self._target = name, value, dist, target

    def load(self):
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


def use_entry_points(monkeypatch, eps: list[FakeEntryPoint]) -> None:
    def entry_points(group: str):
        assert group == registry.ENTRY_POINT_GROUP
        return eps

    monkeypatch.setattr(registry.importlib_metadata, "entry_points", entry_points)


class FakeConnectorFactory:
    """Same contract as vLLM's KVConnectorFactory: lazy loaders; a duplicate name raises."""

    _registry: dict = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")

        def loader():
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader


@pytest.fixture
def fake_factory(monkeypatch):
    monkeypatch.setattr(FakeConnectorFactory, "_registry", {})
    monkeypatch.setattr(vllm_compat, "connector_factory", lambda: FakeConnectorFactory)
    monkeypatch.setattr(registry, "_registered", {})
    return FakeConnectorFactory


def test_discover_sorted_with_package_info(monkeypatch):
    use_entry_points(
        monkeypatch,
        [
            FakeEntryPoint(
                "b", [ConnectorSpec("ZetaConnector", "kv_zeta.c", "Z")], FakeDist("kv-zeta", "0.1.2")
            ),
            FakeEntryPoint(
                "a", ConnectorSpec("AlphaConnector", "kv_alpha.c", "A"), FakeDist("kv-alpha", "0.3.0")
            ),
        ],
    )
    specs = discover_connectors()
    assert [s.name for s in specs] == ["AlphaConnector", "ZetaConnector"]
    assert (specs[0].package, specs[0].package_version) == ("kv-alpha", "0.3.0")
    assert (specs[1].module, specs[1].class_name) == ("kv_zeta.c", "Z")


def test_discover_nothing(monkeypatch):
    use_entry_points(monkeypatch, [])
    assert discover_connectors() == []


def test_same_name_from_two_packages_is_an_error(monkeypatch):
    use_entry_points(
        monkeypatch,
        [
            FakeEntryPoint("x", ConnectorSpec("Dup", "one.mod", "C"), FakeDist("one", "1")),
            FakeEntryPoint("y", ConnectorSpec("Dup", "two.mod", "C"), FakeDist("two", "1")),
        ],
    )
    with pytest.raises(ConnectorRegistryError, match="declared twice"):
        discover_connectors()


def test_broken_entry_point_named(monkeypatch):
    use_entry_points(monkeypatch, [FakeEntryPoint("broken", ImportError("no module kv_x"))])
    with pytest.raises(ConnectorRegistryError, match="'broken'.*failed to load"):
        discover_connectors()
    use_entry_points(monkeypatch, [FakeEntryPoint("wrong", "not a spec")])
    with pytest.raises(ConnectorRegistryError, match="must give a ConnectorSpec"):
        discover_connectors()


def test_register_is_idempotent(fake_factory, monkeypatch):
    use_entry_points(monkeypatch, [FakeEntryPoint("a", ConnectorSpec("KvAlpha", "kv_alpha.c", "A"))])
    assert register_with_vllm() == ["KvAlpha"]
    assert register_with_vllm() == []  # vLLM loads plugins again: no error, nothing new
    assert list(fake_factory._registry) == ["KvAlpha"]


def test_register_recognises_its_own_earlier_registration(fake_factory):
    # Registered by an earlier import of this module in the same process (our memo lost).
    fake_factory.register_connector("KvAlpha", "kv_alpha.c", "A")
    assert register_with_vllm([ConnectorSpec("KvAlpha", "kv_alpha.c", "A")]) == []


def test_register_name_owned_by_someone_else(fake_factory):
    fake_factory.register_connector("Taken", "other.pkg", "OtherConnector")
    with pytest.raises(ConnectorRegistryError, match=r"'Taken'.*other\.pkg\.OtherConnector"):
        register_with_vllm([ConnectorSpec("Taken", "kv_mine.c", "Mine")])


def test_register_same_name_twice_with_different_targets(fake_factory):
    register_with_vllm([ConnectorSpec("KvBeta", "kv_beta.c", "B")])
    with pytest.raises(ConnectorRegistryError, match="KvBeta"):
        register_with_vllm([ConnectorSpec("KvBeta", "kv_beta.c", "OtherB")])


def test_registry_module_is_import_light():
    import subprocess

    code = (
        "import sys, kv_common.registry; "
        "bad = [m for m in ('torch', 'vllm', 'zmq') if m in sys.modules]; sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_real_vllm_factory_refuses_example_connector(monkeypatch):
    factory_module = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")
    monkeypatch.setattr(registry, "_registered", {})
    with pytest.raises(ConnectorRegistryError, match="ExampleConnector.*example_connector"):
        register_with_vllm([ConnectorSpec("ExampleConnector", "kv_mine.c", "Mine")])
    # vLLM's own mapping is untouched.
    assert "ExampleConnector" in factory_module.KVConnectorFactory._registry


def test_real_vllm_factory_register_then_idempotent(monkeypatch):
    factory_module = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")
    factory = factory_module.KVConnectorFactory
    monkeypatch.setattr(registry, "_registered", {})
    name = "KvCommonTestOnlyConnector"
    monkeypatch.delitem(factory._registry, name, raising=False)
    spec = ConnectorSpec(name, "kv_common.testing.probe_connector", "ProbeConnector")
    assert register_with_vllm([spec]) == [name]
    monkeypatch.setattr(registry, "_registered", {})  # as if another copy of the plugin loaded
    assert register_with_vllm([spec]) == []
    factory._registry.pop(name, None)
