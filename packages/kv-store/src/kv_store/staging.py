"""Host memory the worker registers with the backend once, at ``register_kv_caches``.

- Staging: value-sized rows that blocks are gathered into before a put and fetched into before
  their scatter (pinned host memory when the KV cache is on a device).
- Zero-copy "parts" path: a backend that declares ``capabilities.zero_copy_parts``
  (``batch_put_parts(keys, parts)`` and ``batch_get_parts(keys, parts)``, each value given as a
  list of buffers: one block slice per layer, then its 16-byte trailer) moves values straight
  between the paged KV cache and the store: no staging copy, the checksum computed and verified
  over the KV slices in place. The worker registers every layer's KV tensor with such a backend
  (``register_buffer``), and two trailer areas (saves, loads). A backend that also declares
  ``capabilities.parts_at_address`` (``batch_put_parts_at`` / ``batch_get_parts_at(keys,
  addresses, sizes)``, each row a value's parts inside the registered buffers) is given them
  computed for a whole pass at once (``KVBlockView.part_rows``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from kv_common import device
from kv_common.backend import Backend
from kv_common.logging_utils import get_logger

from kv_store import codec

logger = get_logger(__name__)


def _unregister(backend: Backend, view: memoryview) -> None:
    try:
        backend.unregister_buffer(view)
    except Exception:  # noqa: BLE001 - best effort at shutdown
        pass


class Staging:
    """``slots`` contiguous value-sized buffers, registered with the backend once."""

    def __init__(self, value_size: int, total_bytes: int, backend: Backend, kv_device: object = "cpu") -> None:
        self.value_size = value_size
        self.slots = max(1, total_bytes // value_size)
        self.tensor = device.host_buffer(self.slots * value_size, kv_device)  # pinned for a device
        self.view = device.host_bytes(self.tensor)
        self.rows = self.tensor.view(self.slots, value_size)
        self._backend = backend
        backend.register_buffer(self.view)

    def values(self, n: int, start: int = 0) -> list[memoryview]:
        """Rows ``start .. start+n-1`` as value-sized views."""
        vs = self.value_size
        return [self.view[i * vs : (i + 1) * vs] for i in range(start, start + n)]

    def close(self) -> None:
        _unregister(self._backend, self.view)


class TrailerArea:
    """``slots`` trailers of parts values (a value's last part), registered with the backend."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.slots = len(view) // codec.TRAILER_SIZE
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(view)) if self.slots else 0

    def __getitem__(self, slot: int) -> memoryview:
        ts = codec.TRAILER_SIZE
        return self.view[slot * ts : (slot + 1) * ts]

    def addresses(self, first: int, n: int) -> list[int]:
        """Where trailers ``first .. first+n-1`` lie (``ValueError`` past the area)."""
        if first < 0 or first + n > self.slots:
            raise ValueError(f"trailers {first}:{first + n} outside the area's {self.slots}")
        ts = codec.TRAILER_SIZE
        return [self.address + slot * ts for slot in range(first, first + n)]


class ZeroCopyParts:
    """The KV tensors and two trailer areas, registered with a parts backend."""

    save_trailers: TrailerArea
    load_trailers: TrailerArea

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._registered: list[memoryview] = []
        self._tensors: list[torch.Tensor] = []  # keep the trailer areas' memory alive

    @classmethod
    def register(cls, backend: Backend, kv_buffers: Sequence[memoryview], slots: int) -> ZeroCopyParts | None:
        """``kv_buffers``: the host KV cache, each allocation once (``KVBlockView.host_buffers``);
        None (staging path) when a registration fails."""
        parts = cls(backend)
        try:
            for buffer in kv_buffers:
                parts._add(buffer)
            for _ in range(2):
                tensor = torch.zeros(slots * codec.TRAILER_SIZE, dtype=torch.uint8)
                parts._add(device.host_bytes(tensor))
                parts._tensors.append(tensor)
        except Exception as exc:  # noqa: BLE001 - e.g. overlapping registrations: use staging
            logger.warning("store worker: zero-copy path unavailable (%s); using staging buffers", exc)
            parts.close()
            return None
        parts.save_trailers = TrailerArea(parts._registered[-2])
        parts.load_trailers = TrailerArea(parts._registered[-1])
        return parts

    def _add(self, view: memoryview) -> None:
        self._backend.register_buffer(view)
        self._registered.append(view)

    def close(self) -> None:
        for view in self._registered:
            _unregister(self._backend, view)
        self._registered = []
