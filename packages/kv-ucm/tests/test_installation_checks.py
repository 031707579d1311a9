"""check_ucm_installation against simulated environments (importlib.metadata monkeypatched)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import PurePosixPath

import pytest
from kv_ucm import ucm_store
from kv_ucm.ucm_store import UcmInstallationError, check_ucm_installation


class FakeDist:
    def __init__(self, name, top_level=None, files=(), record=None):
        self.metadata = {"Name": name}
        self._top = top_level
        self._record = record
        self.files = [PurePosixPath(f) for f in files]

    def read_text(self, filename):
        return {"top_level.txt": self._top, "RECORD": self._record}.get(filename)


BACKEND = FakeDist("uc-manager-cuda-cu130", files=["ucm/__init__.py", "ucm/store/factory_v1.py"])
SELECTOR = FakeDist("uc-manager", top_level="")
UNRELATED = [FakeDist("numpy", top_level="numpy"), FakeDist("torch", files=["torch/__init__.py"])]


@pytest.fixture
def env(monkeypatch):
    """Install a fake distribution list and a fake 'is ucm importable' answer."""

    def set_env(dists, ucm_importable=True):
        monkeypatch.setattr(importlib.metadata, "distributions", lambda: iter(list(dists)))
        real_find_spec = importlib.util.find_spec

        def find_spec(name, *args, **kwargs):
            if name == "ucm":
                return object() if ucm_importable else None
            return real_find_spec(name, *args, **kwargs)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    return set_env


def test_one_backend_is_fine(env):
    env([SELECTOR, BACKEND, *UNRELATED])
    check_ucm_installation()


def test_backend_name_spelling_is_normalised(env):
    env([FakeDist("UC_Manager_Cuda_CU130", files=["ucm/__init__.py"])])
    check_ucm_installation()


def test_missing_ucm(env):
    env([SELECTOR, *UNRELATED], ucm_importable=False)
    with pytest.raises(UcmInstallationError, match="not installed") as info:
        check_ucm_installation()
    assert "uc-manager[cu130]" in str(info.value)


def test_missing_ucm_is_an_import_error(env):
    env(UNRELATED, ucm_importable=False)
    with pytest.raises(ImportError):
        check_ucm_installation()


def test_two_backends(env):
    env([BACKEND, FakeDist("uc-manager-cuda-cu129", files=["ucm/__init__.py"]), *UNRELATED])
    with pytest.raises(UcmInstallationError, match="several UCM backend") as info:
        check_ucm_installation()
    assert "uc-manager-cuda-cu129" in str(info.value)
    assert "uc-manager-cuda-cu130" in str(info.value)


def test_cuda_and_cann_backends(env):
    env([BACKEND, FakeDist("uc-manager-cann910-a2", files=["ucm/__init__.py"])])
    with pytest.raises(UcmInstallationError, match="several"):
        check_ucm_installation()


def test_ucm_sdk_shadows(env):
    env([FakeDist("ucm-sdk", top_level="ucm"), *UNRELATED])
    with pytest.raises(UcmInstallationError, match="ucm-sdk"):
        check_ucm_installation()


def test_ucm_sdk_next_to_a_backend(env):
    env([BACKEND, FakeDist("ucm_sdk", files=["ucm/__init__.py"])])
    with pytest.raises(UcmInstallationError, match="shadows"):
        check_ucm_installation()


def test_other_distribution_providing_ucm(env):
    env([BACKEND, FakeDist("some-other-thing", top_level="ucm\nother")])
    with pytest.raises(UcmInstallationError, match="some-other-thing"):
        check_ucm_installation()


def test_a_ucm_package_listed_in_record_is_found_from_its_text(env):
    # The RECORD's text is read, not its parsed file list (thousands of paths for torch or vLLM:
    # ~1 s on every store open). A quoted path (CSV) counts too.
    for record in ('ucm/__init__.py,sha256=abc,10\nother/x.py,,\n', '"ucm/a,b.py",sha256=abc,10\n'):
        env([BACKEND, FakeDist("wheel-with-ucm", record=record)])
        with pytest.raises(UcmInstallationError, match="wheel-with-ucm"):
            check_ucm_installation()


def test_a_record_without_ucm_is_not_read_as_providing_it(env):
    env([BACKEND, FakeDist("ucmx", record="ucmx/__init__.py,,\nucm.txt,,\ndocs/ucm/a,,\n")])
    check_ucm_installation()


def test_unpackaged_source_checkout_is_accepted(env):
    # UCM's own CI runs from a source tree on sys.path: no distribution, but importable
    env(UNRELATED, ucm_importable=True)
    check_ucm_installation()


def test_broken_metadata_is_tolerated(env):
    class Broken(FakeDist):
        def read_text(self, filename):
            raise OSError("unreadable")

        @property
        def files(self):
            raise OSError("unreadable")

        @files.setter
        def files(self, value):
            pass

    env([BACKEND, Broken("weird")])
    check_ucm_installation()


def test_from_config_runs_the_check(env):
    env([FakeDist("ucm-sdk", top_level="ucm")])
    with pytest.raises(UcmInstallationError):
        ucm_store.UcmStore.from_config({"store_pipeline": "Posix", "storage_backends": "/tmp"})


def test_module_imports_without_ucm():
    # the adapter must not import ucm at module import time
    import subprocess
    import sys

    # (UCM's wheel installs a .pth hook that imports a bit of 'ucm' at every interpreter start,
    # so compare the 'ucm' modules loaded before and after importing the adapter)
    code = (
        "import sys\n"
        "before = {m for m in sys.modules if m.split('.')[0] == 'ucm'}\n"
        "import kv_ucm.ucm_store, kv_ucm.block_ids\n"
        "after = {m for m in sys.modules if m.split('.')[0] == 'ucm'}\n"
        "assert after == before, sorted(after - before)\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _env():
    import os

    import kv_common
    import kv_ucm

    paths = [os.path.dirname(os.path.dirname(m.__file__)) for m in (kv_ucm, kv_common)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*paths, env.get("PYTHONPATH")) if p)
    return env


# -- config parsing (no UCM needed) -------------------------------------------------------------


def test_load_ucm_yaml(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "ucm.yaml"
    path.write_text(
        """
ucm_connectors:
  - ucm_connector_name: "UcmPipelineStore"
    ucm_connector_config:
      store_pipeline: "Posix"
      storage_backends: "/mnt/a:/mnt/b"
      io_direct: false
enable_event_sync: true
"""
    )
    doc = ucm_store.load_ucm_yaml(path)
    entry = doc["ucm_connectors"][0]
    assert entry["ucm_connector_name"] == "UcmPipelineStore"
    assert entry["ucm_connector_config"]["store_pipeline"] == "Posix"
    assert doc["enable_event_sync"] is True


@pytest.mark.parametrize(
    "text",
    [
        "- just a list\n",
        "other: 1\n",
        "ucm_connectors: []\n",
        "ucm_connectors:\n  - ucm_connector_config: {}\n",
        "ucm_connectors:\n  - ucm_connector_name: X\n    ucm_connector_config: [1]\n",
    ],
)
def test_load_ucm_yaml_rejects_bad_shapes(tmp_path, text):
    pytest.importorskip("yaml")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError):
        ucm_store.load_ucm_yaml(path)


def test_native_config_derivation():
    cfg = ucm_store._native_config({"store_pipeline": "Posix", "storage_backends": "/a:/b"}, 4096, 3)
    assert cfg["storage_backends"] == ["/a", "/b"]
    assert (cfg["tensor_size"], cfg["shard_size"], cfg["block_size"]) == (4096, 12288, 12288)
    assert cfg["device_id"] == 0
    no_sizes = ucm_store._native_config({"store_pipeline": "Posix", "storage_backends": ["/a"]}, None, 1)
    assert no_sizes["device_id"] == -1
    scheduler = ucm_store._native_config(
        {"store_pipeline": "Posix", "storage_backends": ["/a"]}, 4096, 2, lookup_only=True
    )
    assert scheduler["device_id"] == -1 and scheduler["block_size"] == 8192
    with pytest.raises(ValueError, match="store_pipeline"):
        ucm_store._native_config({"storage_backends": "/a"}, 4096, 1)
    with pytest.raises(ValueError, match="tensor_size"):
        ucm_store._native_config(
            {"store_pipeline": "Posix", "tensor_size": 100, "shard_size": 150, "block_size": 150},
            None,
            1,
        )


def test_exception_code_extraction():
    # the message formats UCM 0.8.1 raises with
    assert ucm_store._exception_code(RuntimeError("-50005")) == -50005
    assert ucm_store._exception_code(RuntimeError("-50000, invalid size(4096,3000,4096)")) == -50000
    assert ucm_store._exception_code(RuntimeError("-50002, 2")) == -50002
    assert ucm_store._exception_code(RuntimeError("-1, transfer is not enable")) == -1
    assert ucm_store._exception_code(RuntimeError(-50011, "unhealthy")) == -50011
    assert ucm_store._exception_code(RuntimeError("no code here")) == -1
    assert ucm_store._exception_code(RuntimeError("failed 12 times")) == -1
