"""UCM is kv-store's ``ucm`` backend: an entry point of the ``kv_store.backends`` group."""

from __future__ import annotations

import pytest
from kv_common.config import ConfigKeyError
from kv_store.backends import available_backends, resolve_factory
from kv_store.config import StoreConfig
from kv_ucm.backend_factory import make_ucm_backend


def test_ucm_is_a_kv_store_backend_entry_point():
    assert available_backends()["ucm"] == "kv_ucm.backend_factory:make_ucm_backend"
    assert resolve_factory("ucm") is make_ucm_backend


def test_the_pool_connector_naming_ucm_is_told_to_use_ucm_connector():
    with pytest.raises(ConfigKeyError, match="UCMConnector"):
        make_ucm_backend(StoreConfig(backend="ucm"), None)
