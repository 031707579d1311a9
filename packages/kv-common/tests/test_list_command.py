"""``python -m kv_common list``: each name, its package, and who owns it in vLLM's registry."""

from __future__ import annotations

import importlib

from kv_common import __main__ as cli
from kv_common import registry, vllm_compat
from kv_common.registry import ConnectorSpec

MOONCAKE = ConnectorSpec(
    "KvMooncakeConnectorV1", "kv_mooncake.connector", "KvMooncakeConnectorV1",
    package="kv-mooncake", package_version="0.1.0", shared_names=("MooncakeConnectorV1",),
)
ASCEND = ("vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_connector", "MooncakeConnector")


class FakeConnectorFactory:
    _registry: dict = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")

        def loader():
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader


def _setup(monkeypatch, plugins_raise: Exception | None = None):
    monkeypatch.setattr(FakeConnectorFactory, "_registry", {})
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.setattr(registry, "_warned", set())
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(cli, "discover_connectors", lambda: [MOONCAKE])
    monkeypatch.setattr(registry.importlib_metadata, "entry_points", lambda group: [])

    def load_general_plugins():  # vllm-ascend's plugin ran first, then ours
        FakeConnectorFactory.register_connector("MooncakeConnectorV1", *ASCEND)
        registry.register_with_vllm([MOONCAKE])
        if plugins_raise is not None:
            raise plugins_raise

    monkeypatch.setattr(vllm_compat, "connector_factory", lambda: FakeConnectorFactory)
    monkeypatch.setattr(vllm_compat, "load_general_plugins", load_general_plugins)
    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: "0.32.0")


def test_list_shows_owner_of_each_name(monkeypatch, capsys):
    _setup(monkeypatch)
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert lines["KvMooncakeConnectorV1"].rstrip().endswith("ours")
    assert "kv-mooncake 0.1.0" in lines["KvMooncakeConnectorV1"]
    assert "(shared)" in lines["MooncakeConnectorV1"]
    assert f"vllm-ascend ({ASCEND[0]}.{ASCEND[1]})" in lines["MooncakeConnectorV1"]
    assert "vLLM 0.32.0" in out


def test_list_exits_non_zero_when_a_plugin_would_stop_vllm(monkeypatch, capsys):
    _setup(monkeypatch, plugins_raise=ValueError("Connector 'X' is already registered."))
    assert cli.main(["list"]) == 1
    captured = capsys.readouterr()
    assert "would not start" in captured.err and "already registered" in captured.err
    assert "KvMooncakeConnectorV1" in captured.out


def test_list_without_vllm(monkeypatch, capsys):
    _setup(monkeypatch)

    def no_vllm():
        raise vllm_compat.VllmNotInstalledError("no vllm")

    monkeypatch.setattr(vllm_compat, "connector_factory", no_vllm)
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "vLLM not installed" in out and "would be ours (free)" in out
    assert cli.main(["list", "--no-vllm"]) == 0
    assert "--no-vllm" in capsys.readouterr().out
