"""Generic ``kv_connector_extra_config`` keys of every store-backed connector.

A connector package subclasses ``StoreConnectorConfig`` to add its backend's keys.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kv_common.config import ConfigKeyError, ConnectorConfig

# Why load_mode "layerwise" is refused (and vllm-ascend's / UCM's use_layerwise has no effect).
LAYERWISE_REMOVED = (
    "'layerwise' was removed: a stored value holds every layer of its block, so the first layer waited "
    "for the whole get and nothing overlapped (measured: no faster than 'sync', BENCHMARKS.md 'Store "
    "loads and the forward'). Use load_mode 'async' (vllm-ascend: \"load_async\": true): the load runs "
    "outside the forward and other requests never wait for it"
)


class StoreConnectorConfig(ConnectorConfig, frozen=True):  # frozen like its base (said for mypy)
    # Pin the store namespace by name (letters, digits, "._-", at most 64), e.g. to share blocks
    # between instances serving one model from different paths. None: a digest of every setting
    # that changes a block's bytes. Either way the namespace manifest is checked at start-up: an
    # engine whose layout differs from the one stored refuses to start, naming each setting.
    namespace: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]{1,64}$")] | None = None
    # Deadline of that start-up check; a store that does not answer in time skips it (logged).
    manifest_timeout_s: float = 15.0
    # Lookup (scheduler side). "sync": answer within lookup_timeout_s (a late answer counts as a
    # miss). "async": answer "ask again later" while the lookup runs, so the scheduler never waits.
    lookup_mode: Literal["sync", "async"] = "sync"
    lookup_timeout_s: float = 1.0
    # Circuit breaker: after this many lookups in a row time out, stop asking the backend for
    # lookup_backoff_s (every lookup is then a miss at once), then try one again. 0: no breaker.
    lookup_breaker_threshold: int = 3
    lookup_backoff_s: float = 30.0
    # Load (worker side). "sync": all blocks are in place before the forward (a slow get delays
    # every request of that step). "async": the request waits outside the batch while a background
    # thread loads it (vLLM's WAITING_FOR_REMOTE_KVS); the forward never waits for a load, the hit
    # costs the request itself at least one extra engine step. vllm-ascend's ``load_async: true``.
    # "layerwise" is refused at start-up (LAYERWISE_REMOVED says why).
    load_mode: Literal["sync", "async", "layerwise"] = "sync"
    # A load not done within load_timeout_s becomes a load error (vLLM recomputes); while the late
    # fetch still runs, later loads fail at once. Loads then go through staging so that a late
    # write never lands in the KV cache. 0: no deadline (zero-copy loads straight into the cache).
    load_timeout_s: float = 10.0
    # A save not done within save_timeout_s is given up: its request's blocks are released (vLLM
    # frees them) and, while the backend stays stuck, new saves are skipped. 0: wait for ever.
    save_timeout_s: float = 30.0
    # Save computed blocks (None: when kv_role is kv_producer or kv_both).
    save: bool | None = None
    # Load from the store (None: when kv_role is kv_consumer or kv_both).
    load: bool | None = None
    # End-to-end xxh3-64 of every value (detects corrupt or foreign values in any backend).
    checksum: bool = True
    # Keyed MAC for a store shared between users: the name of an environment variable holding a
    # deployment secret (>= 16 bytes). Values are then sealed with BLAKE2b under that key and only
    # values with a valid tag are loaded (costs ~1 GB/s of hashing). None: no MAC.
    mac_key_env: str | None = None
    # Staging memory for gathers/scatters, per direction (registered with the backend).
    staging_bytes: int = 64 << 20
    # What a miss after a positive lookup does. "recompute": the connector sets vLLM's
    # kv_load_failure_policy to "recompute" in the scheduler (vLLM's own default, "fail", would fail
    # the request on an evicted block). "vllm": leave vLLM's kv_load_failure_policy as configured.
    load_failure_policy: Literal["recompute", "vllm"] = "recompute"
    # Seconds shutdown waits for in-flight saves.
    shutdown_timeout_s: float = 30.0

    def check(self) -> None:
        if self.load_mode == "layerwise":
            raise ConfigKeyError("load_mode", LAYERWISE_REMOVED)
