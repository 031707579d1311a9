from __future__ import annotations

import importlib
import logging
import re
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


def use_entry_points(monkeypatch, eps: list[FakeEntryPoint], plugins: list[FakeEntryPoint] | None = None) -> None:
    """``eps``: our ``kv_common.connectors`` group; ``plugins``: the ``vllm.general_plugins`` group."""

    def entry_points(group: str):
        if group == registry.VLLM_PLUGIN_GROUP:
            return plugins or []
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
    monkeypatch.setattr(registry, "_warned", set())
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv(registry.SHARED_NAMES_ENV, raising=False)
    # Our loggers are under "vllm", which stops propagating once vLLM configured logging.
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    use_entry_points(monkeypatch, [])
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


def test_register_own_name_taken_logs_an_error_and_does_not_raise(fake_factory, caplog):
    # vLLM calls general plugins unguarded: a raise here would stop vLLM from starting.
    fake_factory.register_connector("KvMine", "other.pkg", "OtherConnector")
    with caplog.at_level(logging.WARNING, logger=registry.logger.name):
        assert register_with_vllm([ConnectorSpec("KvMine", "kv_mine.c", "KvMine")]) == []
        assert register_with_vllm([ConnectorSpec("KvMine", "kv_mine.c", "KvMine")]) == []
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and re.search(r"'KvMine'.*other\.pkg\.OtherConnector", errors[0].getMessage())
    assert registry._registered_target(fake_factory._registry["KvMine"]) == ("other.pkg", "OtherConnector")


def test_register_same_name_twice_with_different_targets(fake_factory, caplog):
    register_with_vllm([ConnectorSpec("KvBeta", "kv_beta.c", "KvBeta")])
    with caplog.at_level(logging.WARNING, logger=registry.logger.name):
        assert register_with_vllm([ConnectorSpec("KvBeta", "kv_beta.c", "KvBetaOther")]) == []
    assert "KvBeta" in caplog.text
    assert registry._registered_target(fake_factory._registry["KvBeta"]) == ("kv_beta.c", "KvBeta")


MOONCAKE = ConnectorSpec(
    "KvMooncakeConnectorV1", "kv_mooncake.connector", "KvMooncakeConnectorV1",
    shared_names=("MooncakeConnectorV1",),
)
ASCEND_P2P = ("vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_connector", "MooncakeConnector")


class FakeAscendPlugin(FakeEntryPoint):
    """vllm-ascend's general plugin: ``register_connector`` that raises on a name already taken."""

    def __init__(self, factory):
        def register_connector():
            factory.register_connector("MooncakeConnectorV1", *ASCEND_P2P)

        super().__init__("ascend_kv_connector", register_connector, value="vllm_ascend:register_connector")


def load_plugins_like_vllm(plugins: list[FakeEntryPoint]) -> None:
    """vllm.plugins.load_general_plugins: load every entry point, then call each, unguarded."""
    for func in [p.load() for p in plugins]:
        func()


@pytest.mark.parametrize("order", ["ours_first", "ascend_first"])
def test_shared_name_left_to_vllm_ascend_in_both_orders(fake_factory, monkeypatch, caplog, order):
    ours = FakeEntryPoint("kv_mooncake", lambda: register_with_vllm([MOONCAKE]), value="kv_mooncake.plugin:register")
    ascend = FakeAscendPlugin(fake_factory)
    plugins = [ours, ascend] if order == "ours_first" else [ascend, ours]
    use_entry_points(monkeypatch, [], plugins)
    with caplog.at_level(logging.WARNING, logger=registry.logger.name):
        load_plugins_like_vllm(plugins)  # nothing raises: vLLM starts
        register_with_vllm([MOONCAKE])  # plugins loaded again in the same process
    assert registry._registered_target(fake_factory._registry["MooncakeConnectorV1"]) == ASCEND_P2P
    assert registry._registered_target(fake_factory._registry["KvMooncakeConnectorV1"]) == MOONCAKE.target
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings  # one warning, naming the name that selects ours
    assert "'MooncakeConnectorV1'" in warnings[0] and "'KvMooncakeConnectorV1'" in warnings[0]
    assert "vllm-ascend" in warnings[0]


def test_shared_name_registered_when_free(fake_factory):
    assert register_with_vllm([MOONCAKE]) == ["KvMooncakeConnectorV1", "MooncakeConnectorV1"]
    assert register_with_vllm([MOONCAKE]) == []
    owners = {o.name: o.owner for o in registry.name_owners([MOONCAKE], fake_factory._registry)}
    assert owners == {"KvMooncakeConnectorV1": "ours", "MooncakeConnectorV1": "ours"}


def test_vllm_ascend_disabled_by_vllm_plugins(fake_factory, monkeypatch):
    use_entry_points(monkeypatch, [], [FakeAscendPlugin(fake_factory)])
    monkeypatch.setenv("VLLM_PLUGINS", "kv_mooncake")  # vLLM will not run vllm-ascend's plugin
    assert "MooncakeConnectorV1" in register_with_vllm([MOONCAKE])


def test_shared_names_off(fake_factory, monkeypatch):
    monkeypatch.setenv(registry.SHARED_NAMES_ENV, "0")
    assert register_with_vllm([MOONCAKE]) == ["KvMooncakeConnectorV1"]
    owners = {o.name: o.owner for o in registry.name_owners([MOONCAKE], fake_factory._registry)}
    assert owners["MooncakeConnectorV1"] == f"not registered: {registry.SHARED_NAMES_ENV}=0"


def test_name_owners_reports_each_owner(fake_factory, monkeypatch):
    fake_factory.register_connector("MooncakeConnectorV1", *ASCEND_P2P)
    fake_factory.register_connector("ExampleConnector", "vllm.distributed.x", "ExampleConnector")
    register_with_vllm([MOONCAKE])
    example = ConnectorSpec("KvExample", "kv_x.c", "KvExample", shared_names=("ExampleConnector",))
    owners = {o.name: o.owner for o in registry.name_owners([MOONCAKE, example], fake_factory._registry)}
    assert owners == {
        "KvMooncakeConnectorV1": "ours",
        "MooncakeConnectorV1": f"vllm-ascend ({ASCEND_P2P[0]}.{ASCEND_P2P[1]})",
        "KvExample": "not registered",
        "ExampleConnector": "vLLM built-in (vllm.distributed.x.ExampleConnector)",
    }
    # Without vLLM: what registering would do.
    use_entry_points(monkeypatch, [], [FakeAscendPlugin(fake_factory)])
    owners = {o.name: o.owner for o in registry.name_owners([MOONCAKE], None)}
    assert owners["KvMooncakeConnectorV1"] == "would be ours (free)"
    assert owners["MooncakeConnectorV1"].startswith("left to vllm-ascend")


def test_registry_module_is_import_light():
    import subprocess

    code = (
        "import sys, kv_common.registry; "
        "bad = [m for m in ('torch', 'vllm', 'zmq') if m in sys.modules]; sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_real_vllm_factory_leaves_example_connector(monkeypatch, caplog):
    factory_module = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.setattr(registry, "_warned", set())
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)  # as in fake_factory
    with caplog.at_level(logging.WARNING, logger=registry.logger.name):
        try:
            spec = ConnectorSpec("KvMine", "kv_mine.c", "KvMine", shared_names=("ExampleConnector",))
            assert register_with_vllm([spec]) == ["KvMine"]
        finally:
            factory_module.KVConnectorFactory._registry.pop("KvMine", None)
    assert re.search(r"'ExampleConnector'.*vLLM built-in.*example_connector.*'KvMine'", caplog.text)
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
