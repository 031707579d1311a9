"""kv_common's ``EmbeddedBackend`` with the store core's zero-copy "parts" protocol.

A value is handed over as a list of buffers (one KV slice per layer, then the trailer):

- put: one ``b"".join`` of the parts, which is the copy the embedded store makes anyway (it keeps
  its own bytes), so the connector adds no gather copy;
- put, owned: ``batch_put_owned`` keeps values the caller built for it (the saver joins a block's
  slices into a new value and seals it while it is in cache) without copying them again;
- get: the stored bytes (no copy when in memory) are scattered straight into the KV slices, instead
  of a copy into staging followed by a scatter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kv_common.backend import BackendCapabilities, scatter_into_parts
from kv_common.embedded_backend import EmbeddedBackend


class EmbeddedStoreBackend(EmbeddedBackend):
    # Its parts calls copy memory as the base class's calls do: bounded the same way (the claim
    # is not inherited on its own, see ``Backend``).
    call_bound_s = EmbeddedBackend.call_bound_s
    capabilities = BackendCapabilities(zero_copy_parts=True, owned_puts=True)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "batch_put" in cls.__dict__ and "batch_put_owned" not in cls.__dict__:
            cls.capabilities = replace(cls.capabilities, owned_puts=False)  # puts go through the override

    def batch_put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        if len(keys) != len(parts):
            raise ValueError(f"{len(keys)} keys but {len(parts)} values")
        return self.batch_put(keys, [b"".join(p) for p in parts])

    def batch_put_owned(self, keys: Sequence[str], values: Sequence[bytearray]) -> list[bool]:
        """``batch_put`` of values the caller built for the store and never touches again: kept as
        they are, without the copy ``batch_put`` makes. Not inherited by a subclass that overrides
        ``batch_put`` (a test double that blocks puts): it would bypass the override."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        with self._lock:
            return [self._put(key, value, owned=True) for key, value in zip(keys, values, strict=True)]

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[int]:
        if len(keys) != len(parts):
            raise ValueError(f"{len(keys)} keys but {len(parts)} buffers")
        return [scatter_into_parts(value, bufs) for value, bufs in zip(self.batch_get(keys), parts, strict=True)]
