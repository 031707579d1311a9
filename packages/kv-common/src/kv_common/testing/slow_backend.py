"""``FixedLatencyBackend``: the embedded store with a fixed added latency per ``get``.

For tests and benchmarks of "a load does not block the forward" (issue 15 §2): a real
``EmbeddedBackend`` (nothing faked) whose every ``batch_get_into`` first sleeps
``KV_TEST_GET_LATENCY_S`` seconds (read from the environment of the process that builds the
backend, so an engine child takes it from ``EngineProcess(env=...)``). Lookups and puts are not
slowed.

Use it as AscendStoreConnector's backend::

    {"backend": "kv_common.testing.slow_backend:make",
     "embedded": {"spill_dir": "/tmp/x", "write_through": true}}
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from kv_common.embedded_backend import EmbeddedBackend

LATENCY_ENV = "KV_TEST_GET_LATENCY_S"


class FixedLatencyBackend(EmbeddedBackend):
    name = "embedded-slow-get"

    def __init__(self, *args: Any, get_latency_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.get_latency_s = get_latency_s

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        if self.get_latency_s > 0:
            time.sleep(self.get_latency_s)
        return super().batch_get_into(keys, buffers)


def make(config: Any, role: Any = None) -> FixedLatencyBackend:
    """A ``kv_store.backends``-style factory: reads the ``embedded`` options of the store config."""
    opts = config.embedded
    return FixedLatencyBackend(
        capacity_bytes=opts.capacity_bytes, spill_dir=opts.spill_dir, write_through=opts.write_through,
        spill_capacity_bytes=opts.spill_capacity_bytes, get_latency_s=float(os.environ.get(LATENCY_ENV, "0")),
    )
