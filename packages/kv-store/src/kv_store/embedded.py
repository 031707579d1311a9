"""kv_common's ``EmbeddedBackend`` with the store core's zero-copy "parts" protocol.

A value is handed over as a list of buffers (one KV slice per layer, then the trailer):

- put: one ``b"".join`` of the parts, which is the copy the embedded store makes anyway (it keeps
  its own bytes), so the connector adds no gather copy;
- get: the stored bytes (no copy when in memory) are scattered straight into the KV slices, instead
  of a copy into staging followed by a scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_common.backend import scatter_into_parts
from kv_common.embedded_backend import EmbeddedBackend


class EmbeddedStoreBackend(EmbeddedBackend):
    # Its parts calls copy memory as the base class's calls do: bounded the same way (the claim
    # is not inherited on its own, see ``Backend``).
    call_bound_s = EmbeddedBackend.call_bound_s

    def batch_put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        if len(keys) != len(parts):
            raise ValueError(f"{len(keys)} keys but {len(parts)} values")
        return self.batch_put(keys, [b"".join(p) for p in parts])

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[int]:
        if len(keys) != len(parts):
            raise ValueError(f"{len(keys)} keys but {len(parts)} buffers")
        return [scatter_into_parts(value, bufs) for value, bufs in zip(self.batch_get(keys), parts, strict=True)]
