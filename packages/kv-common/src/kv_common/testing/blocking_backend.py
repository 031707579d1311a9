"""``FileGatedBlockingBackend``: the embedded store, made to hang from another process.

For end-to-end tests of "a slow or hung backend never stalls the engine": a real
``EmbeddedBackend`` (no hardware is faked) whose calls of one kind hang while a gate file exists in
its spill directory (``HOLD-exists``, ``HOLD-put``, ``HOLD-get``), so a test can freeze the store
path of an engine running in a child process. A hung call waits at most ``MAX_HOLD_S``.

Use it as AscendStoreConnector's backend::

    {"backend": "kv_common.testing.blocking_backend:make",
     "embedded": {"spill_dir": "/tmp/x", "write_through": true}}
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kv_common.embedded_backend import EmbeddedBackend

MAX_HOLD_S = 600.0
_POLL_S = 0.02


def gate_path(spill_dir: str | os.PathLike[str], op: str) -> Path:
    return Path(spill_dir) / f"HOLD-{op}"


class FileGatedBlockingBackend(EmbeddedBackend):
    name = "embedded-gated"

    def _gate(self, op: str) -> None:
        if self.spill_dir is None:
            return
        gate = gate_path(self.spill_dir, op)
        deadline = time.monotonic() + MAX_HOLD_S
        while gate.exists() and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._gate("exists")
        return super().batch_exists(keys)

    def batch_put(self, keys: Sequence[str], values: Sequence[memoryview | bytes]) -> list[bool]:
        self._gate("put")
        return super().batch_put(keys, values)

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        self._gate("get")
        return super().batch_get_into(keys, buffers)


def make(config: Any, role: Any = None) -> FileGatedBlockingBackend:
    """A ``kv_store.backends``-style factory: reads the ``embedded`` options of the store config."""
    opts = config.embedded
    if not opts.spill_dir:
        raise ValueError("FileGatedBlockingBackend needs embedded.spill_dir (the gate files live there)")
    return FileGatedBlockingBackend(
        capacity_bytes=opts.capacity_bytes, spill_dir=opts.spill_dir, write_through=True,
        spill_capacity_bytes=opts.spill_capacity_bytes,
    )
