"""``HostAccessGuardTensor``: a CPU tensor that behaves like accelerator memory for host access.

There is no GPU or NPU on the development machines, so the rule "every KV tensor access goes
through ``kv_common.device``" is proven on CPU: wrap the KV caches in this subclass and any
host-only access (``.numpy()``, ``.data_ptr()``, ``.untyped_storage()``, ``__array__``,
``tolist()``, buffer export) outside the device shim raises ``HostAccessError``, as the same code
would fail (or silently read device memory as host memory) on CUDA / NPU tensors.

``strict=True`` refuses host access even inside the shim: the KV tensor is then a stand-in for
device memory that only the copy engine (``device.gather_rows`` / ``scatter_rows``: torch ops) may
touch.
"""

from __future__ import annotations

from typing import Any

import torch

from kv_common import device

HOST_ONLY = {
    torch.Tensor.numpy,
    torch.Tensor.data_ptr,
    torch.Tensor.untyped_storage,
    torch.Tensor.__array__,
    torch.Tensor.tolist,
}
HOST_ONLY_NAMES = {f.__name__ for f in HOST_ONLY}


class HostAccessError(AssertionError):
    pass


class HostAccessGuardTensor(torch.Tensor):
    strict = False

    @staticmethod
    def wrap(tensor: torch.Tensor, strict: bool = False) -> HostAccessGuardTensor:
        cls = StrictHostAccessGuardTensor if strict else HostAccessGuardTensor
        return tensor.as_subclass(cls)  # type: ignore[return-value]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        host_only = func in HOST_ONLY or name in HOST_ONLY_NAMES
        if host_only and (cls.strict or not device.host_access_allowed()):
            where = "at all (device memory)" if cls.strict else "outside kv_common.device"
            raise HostAccessError(f"host-only access {name}() to a KV tensor {where}")
        return super().__torch_function__(func, types, args, kwargs or {})


class StrictHostAccessGuardTensor(HostAccessGuardTensor):
    strict = True
