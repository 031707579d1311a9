"""AscendStoreConnector's embedded backend with no options: the default directory is private."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest
from kv_store.backends import make_embedded_backend
from kv_store.config import StoreConfig, default_spill_dir


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_default_spill_dir_is_created_private_and_capped(private_tmp):
    backend = make_embedded_backend(StoreConfig())
    assert backend.spill_dir is not None and str(backend.spill_dir) == default_spill_dir()
    assert stat.S_IMODE(os.stat(default_spill_dir()).st_mode) == 0o700
    assert backend.spill_capacity_bytes is not None


def test_default_spill_dir_created_by_someone_else_is_refused(private_tmp):
    path = default_spill_dir()
    os.mkdir(path)
    os.chmod(path, 0o777)  # e.g. planted by another user of a shared /tmp
    with pytest.raises(PermissionError, match="spill_dir"):
        make_embedded_backend(StoreConfig())
