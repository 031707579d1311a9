from __future__ import annotations

import subprocess
import sys

import pytest
from kv_common import device


def test_module_import_does_not_load_torch():
    code = "import sys, kv_common.device; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_cpu_always_available():
    assert device.is_available("cpu")


def test_unknown_kind_rejected():
    with pytest.raises(ValueError):
        device.is_available("tpu")
    with pytest.raises(ValueError):
        device.device_type("tpu")


def test_override_cpu():
    assert device.device_type("cpu") == "cpu"


def test_npu_absent_gives_clear_error():
    pytest.importorskip("torch")
    if device.is_available("npu"):
        pytest.skip("an NPU is present")
    with pytest.raises(device.DeviceUnavailableError, match="torch_npu"):
        device.synchronize("npu")
    with pytest.raises(device.DeviceUnavailableError, match="not available"):
        device.device_type("npu")


def test_cpu_paths_with_torch():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() or device.is_available("npu"):
        pytest.skip("accelerator present: this test covers the CPU fallbacks")
    assert device.device_type() == "cpu"
    assert device.is_available("cuda") is False
    t = torch.arange(16, dtype=torch.float32)
    device.synchronize(t)  # no-op on CPU, must not raise
    device.synchronize("cpu")
    device.synchronize()
    assert device.current_stream(t) is None
    assert device.new_stream("cpu") is None
    with device.stream(None):
        t.add_(1)
    assert device.data_ptr(t) == t.data_ptr()
    assert device.data_ptr(t[4:]) == t.data_ptr() + 4 * 4
    assert device.nbytes(t) == 64


def test_without_torch_cpu_still_works(monkeypatch):
    # Simulate a machine with no torch: cpu is still the answer, device ops on CPU need nothing.
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch.") or name == "torch_npu":
            raise ImportError("no torch here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    monkeypatch.setattr(device.importlib, "import_module", lambda name: no_torch(name))
    assert device.is_available("cuda") is False
    assert device.is_available("npu") is False
    assert device.device_type() == "cpu"
    device.synchronize("cpu")
    with pytest.raises(device.DeviceUnavailableError, match="torch"):
        device.synchronize("cuda")
