"""UCMConnector's own code (make_backend, start-up checks, value size); needs vLLM to import."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from types import SimpleNamespace

import pytest

os.environ.setdefault("UCM_LOG_PATH", tempfile.mkdtemp(prefix="ucm-log-"))

pytest.importorskip("vllm", reason="UCMConnector subclasses vLLM's KVConnectorBase_V1")

from kv_common.config import parse_extra_config  # noqa: E402
from kv_store import codec  # noqa: E402
from kv_ucm.config import UCMConfig  # noqa: E402
from kv_ucm.connector import UCMConnector, expected_value_size  # noqa: E402
from kv_ucm.ucm_backend import UcmBackend  # noqa: E402
from kv_ucm.ucm_store import UcmInstallationError  # noqa: E402

HAVE_UCM = importlib.util.find_spec("ucm") is not None
ROLE = SimpleNamespace(SCHEDULER=SimpleNamespace(name="SCHEDULER"), WORKER=SimpleNamespace(name="WORKER"))


def kv_cache_config(layers=2, page=4096):
    spec = SimpleNamespace(page_size_bytes=page)
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[f"l{i}" for i in range(layers)],
                                                            kv_cache_spec=spec)])


def test_expected_value_size():
    assert expected_value_size(kv_cache_config(3, 8192)) == 3 * 8192 + codec.TRAILER_SIZE
    assert expected_value_size(None) is None
    assert expected_value_size(SimpleNamespace(kv_cache_groups=[])) is None


def test_plugin_names_this_class():
    from kv_ucm.plugin import SPECS

    (spec,) = SPECS
    assert (spec.name, spec.module, spec.class_name) == ("KvUCMConnector", "kv_ucm.connector", "KvUCMConnector")
    assert spec.shared_names == ("UCMConnector",)  # vllm-ascend's (and UCM's) name: ours only while free
    assert UCMConnector.connector_name == "UCMConnector" and UCMConnector.config_type is UCMConfig


def _config(tmp_path):
    return parse_extra_config("UCMConnector", UCMConfig, {
        "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": str(tmp_path)}})


@pytest.mark.skipif(HAVE_UCM, reason="checks the error without UCM")
def test_missing_ucm_is_a_clear_start_up_error(tmp_path):
    stub = SimpleNamespace(_kv_cache_config=kv_cache_config())
    with pytest.raises(UcmInstallationError, match="UCM is not installed"):
        UCMConnector.make_backend(stub, _config(tmp_path), ROLE.SCHEDULER)


def test_ucm_sdk_shadowing_is_a_clear_start_up_error(tmp_path, monkeypatch):
    import importlib.metadata

    class Sdk:
        metadata = {"Name": "ucm-sdk"}
        files = []

        def read_text(self, name):
            return "ucm" if name == "top_level.txt" else None

    monkeypatch.setattr(importlib.metadata, "distributions", lambda: iter([Sdk()]))
    stub = SimpleNamespace(_kv_cache_config=None)
    with pytest.raises(UcmInstallationError, match="ucm-sdk"):
        UCMConnector.make_backend(stub, _config(tmp_path), ROLE.WORKER)


@pytest.mark.skipif(not HAVE_UCM, reason="needs UCM (Python 3.12)")
def test_make_backend_roles(tmp_path):
    stub = SimpleNamespace(_kv_cache_config=kv_cache_config(2, 4096))
    sched = UCMConnector.make_backend(stub, _config(tmp_path), ROLE.SCHEDULER)
    try:
        assert isinstance(sched, UcmBackend) and sched.lookup_only
        assert sched.value_size == 2 * 4096 + codec.TRAILER_SIZE and sched.store is not None  # opened at start-up
        assert sched.store.config["device_id"] == -1
    finally:
        sched.close()
    worker = UCMConnector.make_backend(stub, _config(tmp_path), ROLE.WORKER)
    try:
        assert not worker.lookup_only and worker.store is None  # opened in register_kv_caches
    finally:
        worker.close()


def test_missing_store_directory_fails_at_start_up(tmp_path, monkeypatch):
    from kv_ucm import backend_factory
    from kv_ucm.config import UCMConfigError

    monkeypatch.setattr(backend_factory, "check_ucm_installation", lambda: None)
    stub = SimpleNamespace(_kv_cache_config=None)
    with pytest.raises(UCMConfigError, match="missing.*does not exist"):
        UCMConnector.make_backend(stub, _config(tmp_path / "missing"), ROLE.SCHEDULER)
    cfg = parse_extra_config("UCMConnector", UCMConfig, {
        "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": [str(tmp_path), str(tmp_path / "b")]}})
    with pytest.raises(UCMConfigError, match="/b does not exist"):
        UCMConnector.make_backend(stub, cfg, ROLE.WORKER)
