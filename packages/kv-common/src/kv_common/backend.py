"""The block-storage interface every store-backed connector speaks.

Keys are strings built by the connector (hash chain + model + layout + rank). Values are whole KV
blocks as contiguous bytes. A backend never raises for an ordinary miss: per-key results say what
happened, so a connector can turn a miss after a positive lookup into a load error, not a crash.
Errors that mean "the backend is unusable" raise ``BackendError`` with the operation and code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields


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


# vLLM's KV-event medium values (vllm.distributed.kv_events.MEDIUM_*), without importing vLLM here.
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"


class BackendError(RuntimeError):
    def __init__(self, backend: str, operation: str, code: int | None = None, detail: str = ""):
        self.backend, self.operation, self.code = backend, operation, code
        text = f"{backend}: {operation} failed"
        if code is not None:
            text += f" (code {code})"
        if detail:
            text += f": {detail}"
        super().__init__(text)


@dataclass(frozen=True)
class BackendCapabilities:
    """Optional calls a backend offers beyond batch exists / put / get. A caller reads them here and
    never probes for methods; each one promises the calls ``CAPABILITY_CALLS`` names for it."""

    # A value given as its parts (one buffer per KV slice, then the trailer) and moved without a
    # gather or scatter copy: ``batch_put_parts`` / ``batch_get_parts``.
    zero_copy_parts: bool = False
    # The same parts as rows of addresses and sizes inside registered buffers, which the caller
    # computes for a whole call at once: ``batch_put_parts_at`` / ``batch_get_parts_at``.
    parts_at_address: bool = False
    # Values handed over for good, kept without the copy ``batch_put`` makes: ``batch_put_owned``.
    owned_puts: bool = False

    def calls(self) -> tuple[str, ...]:
        """The calls the declared capabilities promise."""
        return tuple(call for f in fields(self) if getattr(self, f.name) for call in CAPABILITY_CALLS[f.name])


CAPABILITY_CALLS: dict[str, tuple[str, ...]] = {
    "zero_copy_parts": ("batch_put_parts", "batch_get_parts"),
    "parts_at_address": ("batch_put_parts_at", "batch_get_parts_at"),
    "owned_puts": ("batch_put_owned",),
}


def calls_lacking(backend: Backend | type[Backend]) -> list[str]:
    """Calls that the declared capabilities of ``backend`` (a class or an instance) promise but that
    it leaves to ``Backend``'s defaults, which raise."""
    cls = backend if isinstance(backend, type) else type(backend)
    return [call for call in backend.capabilities.calls() if getattr(cls, call) is getattr(Backend, call)]


# Bytes a memory-speed backend moves per call when a copy and a check share the values: the check
# reads what the copy just brought into cache (measured ~1.3x faster than copy all, then hash all).
CACHE_PASS_BYTES = 4 << 20


class Backend(ABC):
    """Batch exists / put / get of whole blocks; optional buffer registration for zero copy.

    Two properties tell a caller how to drive it:

    - ``pass_bytes``: the most bytes one call should move. A memory backend copies at memory speed,
      so a cache-sized pass lets the caller's check read warm bytes; an RPC backend pays a round
      trip per call (Mooncake: 8 calls of 4 MiB cost 3x one call of 32 MiB), so it says None: the
      whole request in one call.
    - ``call_bound_s(nbytes)``: the longest one call moving ``nbytes`` can take because the backend
      itself ends it then (its own timeouts), or None when nothing bounds it. A caller with a
      deadline may hand such a backend its final buffers (the KV cache) and wait for the call,
      instead of abandoning a late call on a thread and copying through staging. This claim is
      never inherited: a subclass that overrides calls (e.g. one that can hang) says it again or
      is unbounded.

    ``capabilities`` declares the optional calls it offers (``BackendCapabilities``): a caller reads
    the declaration, and a class declaring a capability without defining its calls is a TypeError.
    """

    name: str = "backend"
    pass_bytes: int | None = CACHE_PASS_BYTES
    # Whether a call runs without the GIL (C++ transfers, file I/O): then a caller overlaps its
    # check of one pass with the call moving the next on a second thread. A call that copies
    # under the GIL runs on the caller's thread instead (measured: a thread only adds hand-offs).
    calls_release_gil: bool = True
    # Where the values live, in vLLM's KV-event medium values (vllm.distributed.kv_events: "GPU",
    # "CPU", "STORAGE"): a router reading the store's BlockStored / BlockRemoved tells the tiers apart.
    kv_event_medium: str = MEDIUM_CPU
    # The optional calls it offers (none by default); a declaration without its calls fails at once.
    capabilities: BackendCapabilities = BackendCapabilities()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "call_bound_s" not in cls.__dict__:
            cls.call_bound_s = Backend.call_bound_s  # type: ignore[method-assign]
        lacking = calls_lacking(cls)
        if lacking:
            raise TypeError(f"backend {cls.__qualname__} declares {cls.capabilities} but does not define "
                            f"{', '.join(lacking)}")

    def call_bound_s(self, nbytes: int) -> float | None:
        """Seconds within which the backend itself ends one call moving ``nbytes`` (None: unbounded)."""
        return None

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is a complete value stored?"""

    @abstractmethod
    def batch_put(self, keys: Sequence[str], values: Sequence[memoryview | bytes]) -> list[bool]:
        """Store each value under its key. A key that already exists keeps its value and counts as
        ok: callers put without asking ``batch_exists`` first."""

    @abstractmethod
    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        """Copy each value into its writable buffer. Per key: bytes written, or -1 when missing,
        truncated, corrupt or of a different size than the buffer."""

    def batch_get(self, keys: Sequence[str]) -> Sequence[bytes | memoryview | None]:
        """Values as bytes or read-only views (None when missing). Backends with a faster path
        override this."""
        raise NotImplementedError(f"{self.name} supports only batch_get_into")

    def batch_remove(self, keys: Sequence[str]) -> None:  # noqa: B027 - optional
        """Drop keys when present (eviction policy of the backend otherwise)."""

    # -- optional calls: offered only where ``capabilities`` declares them ------------------------

    def batch_put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """``zero_copy_parts``: store each value given as its parts, in order."""
        raise self._not_offered("batch_put_parts", "zero_copy_parts")

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[int]:
        """``zero_copy_parts``: copy each value into its parts. Per key: bytes written, or -1 when
        missing or not the parts' total size."""
        raise self._not_offered("batch_get_parts", "zero_copy_parts")

    def batch_put_parts_at(self, keys: Sequence[str], addresses: Sequence[Sequence[int]],
                           sizes: Sequence[Sequence[int]]) -> list[bool]:
        """``parts_at_address``: ``batch_put_parts`` with each value's parts as addresses and sizes
        inside registered buffers."""
        raise self._not_offered("batch_put_parts_at", "parts_at_address")

    def batch_get_parts_at(self, keys: Sequence[str], addresses: Sequence[Sequence[int]],
                           sizes: Sequence[Sequence[int]]) -> list[int]:
        """``parts_at_address``: ``batch_get_parts`` into parts given as addresses and sizes."""
        raise self._not_offered("batch_get_parts_at", "parts_at_address")

    def batch_put_owned(self, keys: Sequence[str], values: Sequence[bytearray]) -> list[bool]:
        """``owned_puts``: ``batch_put`` of values the caller never touches again, kept uncopied."""
        raise self._not_offered("batch_put_owned", "owned_puts")

    def _not_offered(self, call: str, capability: str) -> NotImplementedError:
        if getattr(self.capabilities, capability):
            return NotImplementedError(f"backend {self.name} declares capabilities.{capability} but does not "
                                       f"define {call}")
        return NotImplementedError(f"backend {self.name} does not offer {call} (capabilities.{capability} "
                                   "is not declared): read Backend.capabilities before calling it")

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
