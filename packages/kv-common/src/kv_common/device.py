"""The one place that talks to a device runtime: ``cpu``, ``cuda`` or Ascend ``npu``.

torch and torch_npu are imported inside the functions, so importing this module costs nothing and
works without torch; only the code paths that need a device pay for it.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from typing import Any, Literal

DeviceType = Literal["cpu", "cuda", "npu"]
DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "npu")


class DeviceUnavailableError(RuntimeError):
    pass


def _torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        raise DeviceUnavailableError(f"torch is required for device operations: {exc}") from exc


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")  # registers torch.npu as a side effect
    except Exception:  # noqa: BLE001 - ImportError, or a CANN runtime that fails to load
        return False
    npu = getattr(_torch(), "npu", None)
    return bool(npu is not None and npu.is_available())


def _device_module(kind: str) -> Any:
    """``torch.cuda`` / ``torch.npu``; a clear error when that runtime is absent."""
    if kind == "npu":
        try:
            importlib.import_module("torch_npu")
        except Exception as exc:  # noqa: BLE001
            raise DeviceUnavailableError(
                f"device 'npu' needs torch_npu and the CANN runtime, which cannot be loaded: {exc}"
            ) from exc
    if kind not in ("cuda", "npu"):
        raise ValueError(f"unknown device type {kind!r} (expected one of {DEVICE_TYPES})")
    module = getattr(_torch(), kind, None)
    if module is None:
        raise DeviceUnavailableError(f"torch has no {kind} support in this build")
    return module


def is_available(kind: str) -> bool:
    if kind == "cpu":
        return True
    if kind == "npu":
        return _npu_available()
    if kind == "cuda":
        try:
            return bool(_torch().cuda.is_available())
        except DeviceUnavailableError:
            return False
    raise ValueError(f"unknown device type {kind!r} (expected one of {DEVICE_TYPES})")


def device_type(override: str | None = None) -> str:
    """The accelerator this process runs on: ``npu`` over ``cuda`` over ``cpu``, unless overridden."""
    if override is not None:
        kind = override.split(":", 1)[0]
        if kind not in DEVICE_TYPES:
            raise ValueError(f"unknown device type {override!r} (expected one of {DEVICE_TYPES})")
        if not is_available(kind):
            raise DeviceUnavailableError(f"device type {kind!r} was requested but is not available")
        return kind
    for kind in ("npu", "cuda"):
        if is_available(kind):
            return kind
    return "cpu"


def _kind_of(device: Any) -> str:
    """Device type of a ``torch.device``, a tensor, or a string such as 'cuda:1'."""
    device = getattr(device, "device", device)  # a tensor
    return getattr(device, "type", None) or str(device).split(":", 1)[0]


def synchronize(device: Any = None) -> None:
    """Wait for all queued work on ``device`` (a no-op on CPU, whose ops are synchronous)."""
    kind = _kind_of(device) if device is not None else device_type()
    if kind == "cpu":
        return
    module = _device_module(kind)
    if device is None:
        module.synchronize()
    else:
        module.synchronize(getattr(device, "device", device))  # a tensor's device, or the device itself


def current_stream(device: Any = None) -> Any | None:
    """The device's current stream, or None on CPU (no streams there)."""
    kind = _kind_of(device) if device is not None else device_type()
    if kind == "cpu":
        return None
    return _device_module(kind).current_stream()


def new_stream(device: Any = None) -> Any | None:
    """A fresh stream for overlapping copies with compute, or None on CPU."""
    kind = _kind_of(device) if device is not None else device_type()
    if kind == "cpu":
        return None
    return _device_module(kind).Stream()


@contextlib.contextmanager
def stream(s: Any | None) -> Iterator[None]:
    """Run the body on stream ``s``; with None (CPU) just run it."""
    if s is None:
        yield
        return
    kind = _kind_of(s)
    with _device_module(kind).stream(s):
        yield


def data_ptr(tensor: Any) -> int:
    """Address of the tensor's first element (what transfer engines register and copy from)."""
    with host_access():
        return int(tensor.data_ptr())


def nbytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size())


# ---- host buffers and copies (the store data path) ------------------------------------------
# Every byte of a KV tensor that a backend sees goes through these functions: on CPU the KV cache
# is host memory and is exposed as a buffer directly (zero copy); on cuda / npu it is copied into
# a (pinned) host buffer by the device's copy engine, and the copy is waited for (an event) before
# the host buffer is read, reused or handed to a backend.

_access = threading.local()


@contextlib.contextmanager
def host_access() -> Iterator[None]:
    """Marks host-only access to a tensor's memory done here, in the shim (tests check that KV
    tensors are touched that way only: see ``host_access_allowed``)."""
    depth = getattr(_access, "depth", 0)
    _access.depth = depth + 1
    try:
        yield
    finally:
        _access.depth = depth


def host_access_allowed() -> bool:
    return getattr(_access, "depth", 0) > 0


def is_host(tensor: Any) -> bool:
    """True when ``tensor`` lives in host memory (its bytes can be handed to a backend as is)."""
    return _kind_of(tensor) == "cpu"


def host_bytes(tensor: Any) -> memoryview:
    """The bytes of a contiguous host tensor as a writable memoryview (no copy)."""
    if not is_host(tensor):
        raise ValueError(f"a {_kind_of(tensor)} tensor has no host bytes: copy it to a host buffer first")
    if not tensor.is_contiguous():
        raise ValueError("host_bytes needs a contiguous tensor")
    with host_access():
        return memoryview(tensor.detach().view(-1).view(_torch().uint8).numpy()).cast("B")


def host_buffer(nbytes: int, device: Any = None) -> Any:
    """A uint8 host tensor for staging copies of ``device`` tensors: pinned (page-locked, so the
    copy engine moves it asynchronously) when ``device`` is an accelerator, plain on CPU."""
    torch = _torch()
    kind = _kind_of(device) if device is not None else "cpu"
    return torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=kind != "cpu")


def record_event(device: Any) -> Any | None:
    """An event recorded on ``device``'s current stream (None on CPU, whose copies are synchronous).
    Wait for it with ``wait_event`` before reading what the work up to now wrote."""
    kind = _kind_of(device)
    if kind == "cpu":
        return None
    module = _device_module(kind)
    event = module.Event()
    event.record(module.current_stream())
    return event


def wait_event(event: Any | None) -> None:
    if event is not None:
        event.synchronize()


def gather_rows(dst: Any, src: Any, index: list[int]) -> Any | None:
    """``dst[j] = src[index[j]]`` for a host ``dst`` and ``src`` on any device, with the device's
    copy engine; returns the event to wait for before ``dst`` is read."""
    torch = _torch()
    idx = torch.tensor(index, dtype=torch.long, device=src.device)
    dst.copy_(src.index_select(0, idx), non_blocking=True)
    return record_event(src.device)


def scatter_rows(dst: Any, index: list[int], src: Any) -> Any | None:
    """``dst[index[j]] = src[j]`` for ``dst`` on any device and a host ``src``; returns the event to
    wait for before ``src`` is reused."""
    torch = _torch()
    idx = torch.tensor(index, dtype=torch.long, device=dst.device)
    dst.index_copy_(0, idx, src.to(dst.device, non_blocking=True))
    return record_event(dst.device)
