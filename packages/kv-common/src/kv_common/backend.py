"""The block-storage interface every store-backed connector speaks.

Keys are strings built by the connector (hash chain + model + layout + rank). Values are whole KV
blocks as contiguous bytes. A backend never raises for an ordinary miss: per-key results say what
happened, so a connector can turn a miss after a positive lookup into a load error, not a crash.
Errors that mean "the backend is unusable" raise ``BackendError`` with the operation and code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


def scatter_into_parts(value: bytes | bytearray | memoryview | None, parts: Sequence[memoryview]) -> int:
    """Copy one whole value into its parts (the store core's zero-copy layout: one buffer per block
    slice). Returns the bytes copied, or -1 when the value is missing or not the parts' total size."""
    total = sum(len(b) for b in parts)
    if value is None or len(value) != total:
        return -1
    src, offset = memoryview(value), 0
    for buf in parts:
        buf[:] = src[offset : offset + len(buf)]
        offset += len(buf)
    return total


class BackendError(RuntimeError):
    def __init__(self, backend: str, operation: str, code: int | None = None, detail: str = ""):
        self.backend, self.operation, self.code = backend, operation, code
        text = f"{backend}: {operation} failed"
        if code is not None:
            text += f" (code {code})"
        if detail:
            text += f": {detail}"
        super().__init__(text)


class Backend(ABC):
    """Batch exists / put / get of whole blocks; optional buffer registration for zero copy."""

    name: str = "backend"

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is a complete value stored?"""

    @abstractmethod
    def batch_put(self, keys: Sequence[str], values: Sequence[memoryview | bytes]) -> list[bool]:
        """Store each value under its key. A key that already exists keeps its value (and counts as ok)."""

    @abstractmethod
    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        """Copy each value into its writable buffer. Per key: bytes written, or -1 when missing,
        truncated, corrupt or of a different size than the buffer."""

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values as bytes (None when missing). Backends with a faster path override this."""
        raise NotImplementedError(f"{self.name} supports only batch_get_into")

    def batch_remove(self, keys: Sequence[str]) -> None:  # noqa: B027 - optional
        """Drop keys when present (eviction policy of the backend otherwise)."""

    def register_buffer(self, buffer: memoryview) -> None:  # noqa: B027 - optional
        """Announce a long-lived buffer that later puts and gets use (zero copy where supported)."""

    def unregister_buffer(self, buffer: memoryview) -> None:  # noqa: B027 - optional
        pass

    def close(self) -> None:  # noqa: B027 - optional
        pass

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
