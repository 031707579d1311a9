"""``kv_connector_extra_config`` of AscendStoreConnector.

```json
{"backend": "embedded",                       // "embedded" | "mooncake" | a kv_store.backends entry point
 "embedded": {"capacity_bytes": 1073741824,   // in-process LRU (per process)
              "spill_dir": null,              // shared directory; default <tmp>/kv-store-<uid>
              "write_through": true, "spill_capacity_bytes": null},
 "mooncake": {"config_path": null,            // or MOONCAKE_CONFIG_PATH: Mooncake's own JSON
              "master_server_address": "127.0.0.1:50051", "metadata_server": "P2PHANDSHAKE",
              "protocol": "tcp", "device_name": "",
              "local_hostname": null,         // null: this machine's address as vLLM finds it
              "global_segment_size": "512mb", "local_buffer_size": "128mb",
              "mount_segment": true,          // false: a pure client (a standalone mooncake_client
                                              // holds the pool, which then outlives instances)
              "setup_retries": 3, "setup_timeout_s": 60},
 "lookup_mode": "sync", "lookup_timeout_s": 1.0, "load_mode": "sync", "checksum": true,
 "load_failure_policy": "recompute"}
```
Inline ``mooncake`` keys win over the JSON file's.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from kv_common import vllm_compat
from kv_common.config import ConfigKeyError, ConnectorConfig, parse_extra_config
from kv_common.idle_step import DEFAULT_IDLE_STEP_WAIT_MS, check_idle_step_wait_ms

# --- the generic keys of every store-backed connector (kv-ucm's UCMConfig subclasses this) ---
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
    # A vLLM step that schedules no token while saves or async loads are in flight (vLLM keeps
    # stepping for them) waits up to this long for one to end instead of spinning
    # (kv_common.idle_step); 0: no wait. A request arriving meanwhile starts up to this much later.
    idle_step_wait_ms: float = DEFAULT_IDLE_STEP_WAIT_MS

    def check(self) -> None:
        if self.load_mode == "layerwise":
            raise ConfigKeyError("load_mode", LAYERWISE_REMOVED)
        try:
            check_idle_step_wait_ms(self.idle_step_wait_ms)
        except ValueError as exc:
            raise ConfigKeyError("idle_step_wait_ms", str(exc)) from None


# --- AscendStoreConnector's own keys: which backend, and its options ---


class EmbeddedOptions(ConnectorConfig, frozen=True):  # frozen like its base (said for mypy)
    capacity_bytes: int = 1 << 30
    spill_dir: str | None = None
    write_through: bool = True
    spill_capacity_bytes: int | None = None


class MooncakeOptions(ConnectorConfig, frozen=True):
    config_path: str | None = None
    master_server_address: str | None = None
    metadata_server: str | None = None
    protocol: str | None = None
    local_hostname: str | None = None
    device_name: str | None = None
    global_segment_size: int | str | None = None
    local_buffer_size: int | str | None = None
    # False: this instance mounts no memory into the pool (global_segment_size 0 whatever Mooncake's
    # JSON says). With instances mounting none, a standalone mooncake_client holds every value, so
    # the pool outlives instance restarts; the master places values at random over all mounted
    # segments, so an instance mounting even a little takes about its share of values with it.
    mount_segment: bool = True
    setup_retries: int | None = 3
    setup_timeout_s: float = 60.0


BACKEND_GROUP = "kv_store.backends"
BUILTIN_BACKENDS = ("embedded", "mooncake")

# vllm-ascend's AscendStoreConnector keys that do nothing here, and why (README: "vllm-ascend keys").
_NO_EFFECT = {
    "use_layerwise": "there is no layer-wise load mode (a stored value holds every layer of its block); "
                     "\"load_async\": true loads without holding up the forward",
    "lookup_rpc_port": "it names vllm-ascend's scheduler-to-worker lookup IPC socket; here lookups "
                       "run in the scheduler process against the backend (nothing listens)",
    "mooncake_rpc_port": "vllm-ascend's older name of lookup_rpc_port; here lookups run in the "
                         "scheduler process against the backend (nothing listens)",
    "prefill_pp_size": "store keys name the TP/PCP/DCP rank only; pipeline-parallel layer "
                       "partitions are not mapped",
    "prefill_pp_layer_partition": "store keys name the TP/PCP/DCP rank only; pipeline-parallel "
                                  "layer partitions are not mapped",
    "register_buffer": "staging buffers are always registered with the backend",
    "discard_partial_chunks": "only whole blocks are stored",
    "h2d_stagger_us": "an Ascend host-to-device copy setting",
    "layerwise_prefetch_layers": "a memcache layerwise setting",
    "layerwise_max_transfer_blocks": "a memcache layerwise setting",
    "layerwise_max_transfer_bytes": "a memcache layerwise setting",
    "layerwise_num_shared_buffers": "a memcache layerwise setting",
    "layerwise_independent_layers": "a memcache layerwise setting",
}


def installed_backends() -> list[str]:
    """Backend names ``backend`` may take: the ``kv_store.backends`` entry points (+ built-ins)."""
    from importlib import metadata as importlib_metadata

    names = {ep.name for ep in importlib_metadata.entry_points(group=BACKEND_GROUP)}
    return sorted(names | set(BUILTIN_BACKENDS))


class StoreConfig(StoreConnectorConfig, frozen=True):
    backend: str = "embedded"
    embedded: EmbeddedOptions = EmbeddedOptions()
    mooncake: MooncakeOptions = MooncakeOptions()
    # vllm-ascend's keys, honoured: load_async -> load_mode "async", consumer_is_to_put -> save,
    # consumer_is_to_load -> load (a contradicting explicit value is refused).
    load_async: bool | None = None
    consumer_is_to_put: bool | None = None
    consumer_is_to_load: bool | None = None
    # vllm-ascend's keys accepted without effect (see _NO_EFFECT).
    use_layerwise: bool | None = None
    lookup_rpc_port: int | str | None = None
    mooncake_rpc_port: int | str | None = None
    prefill_pp_size: int | None = None
    prefill_pp_layer_partition: str | None = None
    register_buffer: bool | None = None
    discard_partial_chunks: bool | None = None
    h2d_stagger_us: int | None = None
    layerwise_prefetch_layers: int | None = None
    layerwise_max_transfer_blocks: int | None = None
    layerwise_max_transfer_bytes: int | None = None
    layerwise_num_shared_buffers: int | None = None
    layerwise_independent_layers: list[int] | str | None = None

    no_effect_keys: ClassVar[dict[str, str]] = _NO_EFFECT

    def preflight(self, kv_transfer_config: Mapping[str, Any]) -> Any:
        return _preflight(self)

    def check(self) -> None:
        installed = installed_backends()
        if ":" not in self.backend and self.backend not in installed:  # "pkg.mod:factory" is loaded as named
            hint = (" (vllm-ascend's memcache and yuanrong backends need Ascend NPUs; use 'mooncake' for "
                    "a Mooncake Store pool or 'embedded' for one machine)"
                    if self.backend in ("memcache", "yuanrong") else "")
            raise ConfigKeyError(
                "backend", f"{self.backend!r} is not installed here; installed backends: {', '.join(installed)}{hint}"
            )
        # vllm-ascend's spellings of our keys: mapped after checking they do not contradict.
        super().check()  # load_mode "layerwise" is refused
        if self.consumer_is_to_put is not None and self.save is not None and self.consumer_is_to_put != self.save:
            raise ConfigKeyError("consumer_is_to_put", f"{self.consumer_is_to_put} contradicts save {self.save}")
        if self.consumer_is_to_load is not None and self.load is not None and self.consumer_is_to_load != self.load:
            raise ConfigKeyError("consumer_is_to_load", f"{self.consumer_is_to_load} contradicts load {self.load}")
        segment = self.mooncake.global_segment_size
        if not self.mooncake.mount_segment and segment is not None and _size_or_none(segment) != 0:
            raise ConfigKeyError(
                "mooncake.mount_segment",
                f"false contradicts mooncake.global_segment_size {segment!r} (a pure client mounts nothing; "
                "drop global_segment_size or set it to 0)",
            )
        if self.load_async is False and self.load_mode == "async":
            raise ConfigKeyError("load_async", "false contradicts load_mode 'async'")
        if self.load_async:
            self.set_in_check("load_mode", "async")
        if self.consumer_is_to_put:  # false keeps the role's default (vllm-ascend's default is false)
            self.set_in_check("save", True)
        if self.consumer_is_to_load is not None:
            self.set_in_check("load", self.consumer_is_to_load)


def _preflight(config: StoreConfig) -> Any:
    from importlib import metadata as importlib_metadata

    from kv_common.doctor import Preflight

    plan = Preflight(mooncake_build="backend 'mooncake'" if config.backend == "mooncake" else "")
    if config.backend == "embedded":
        plan.writable_dirs.append((config.embedded.spill_dir or default_spill_dir(), "embedded backend spill_dir"))
    elif config.backend == "mooncake":
        plan.modules.append(("mooncake.store", "MooncakeDistributedStore", "backend 'mooncake'"))
        try:
            options = resolve_mooncake(config.mooncake)
        except (ValueError, OSError) as exc:
            plan.problems.append(str(exc))
        else:
            local = str(options["local_hostname"])
            local = local.partition(":")[0] if local.count(":") == 1 else local  # Mooncake takes HOST:PORT too
            plan.advertise.append((local, "Mooncake Store client (its TransferEngine listens on every interface)",
                                   "mooncake.local_hostname"))
            host, _, port = str(options["master_server_address"]).rpartition(":")
            if port.isdigit():
                plan.connect.append((host.strip("[]"), int(port), "Mooncake master"))
            else:
                plan.problems.append(f"mooncake backend: master_server_address {options['master_server_address']!r} "
                                     "is not HOST:PORT")
            if not config.mooncake.mount_segment:
                plan.notes.append("mooncake.mount_segment false: this instance mounts no memory; saves succeed only "
                                  "while a standalone mooncake_client holds the pool (not checked)")
    for ep in importlib_metadata.entry_points(group=BACKEND_GROUP):
        if ep.name == config.backend and ep.name not in BUILTIN_BACKENDS:
            module, _, attribute = ep.value.partition(":")
            plan.modules.append((module, attribute.split(".")[0], f"backend {ep.name!r} ({ep.value})"))
    if ":" in config.backend:  # a factory named directly ("pkg.module:factory")
        module, _, attribute = config.backend.partition(":")
        plan.modules.append((module, attribute.split(".")[0], f"backend {config.backend!r}"))
    for key in ("lookup_rpc_port", "mooncake_rpc_port"):
        if getattr(config, key) is not None:
            plan.notes.append(f"{key} is not checked: nothing listens on it here")
    return plan


def parse_config(extra: Mapping[str, Any] | None, connector: str = "AscendStoreConnector") -> StoreConfig:
    """The connector's start-up parse (StoreConnectorBase parses ``StoreConfig`` the same way);
    also ``python -m kv_common doctor``'s. No vLLM needed."""
    return parse_extra_config(connector, StoreConfig, extra)


def default_spill_dir() -> str:
    """One directory per user on this machine: every instance of it shares blocks through it."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"kv-store-{uid}")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str) -> int:
    """``"64mb"``, ``"1GiB"``, ``"512"`` or an int -> bytes (Mooncake's own config accepts these)."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"not a size: {value!r}")
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


def _size_or_none(value: int | str) -> int | None:
    try:
        return parse_size(value)
    except ValueError:
        return None


_DEFAULTS: dict[str, Any] = {
    "metadata_server": "P2PHANDSHAKE",
    "protocol": "tcp",
    "device_name": "",
    "global_segment_size": 512 << 20,
    "local_buffer_size": 128 << 20,
}


def resolve_mooncake(options: MooncakeOptions, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Defaults < Mooncake JSON (config_path or MOONCAKE_CONFIG_PATH) < inline keys."""
    env = os.environ if environ is None else environ
    merged: dict[str, Any] = dict(_DEFAULTS)
    path = options.config_path or env.get("MOONCAKE_CONFIG_PATH")
    if path:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for key in ("master_server_address", "metadata_server", "protocol", "local_hostname",
                    "device_name", "global_segment_size", "local_buffer_size"):
            if data.get(key) is not None:
                merged[key] = data[key]
    elif env.get("MOONCAKE_MASTER"):
        merged["master_server_address"] = env["MOONCAKE_MASTER"]
    for key in ("master_server_address", "metadata_server", "protocol", "local_hostname", "device_name",
                "global_segment_size", "local_buffer_size"):
        value = getattr(options, key)
        if value is not None:
            merged[key] = value
    if not merged.get("local_hostname"):
        # What this client tells the master and the other clients: 127.0.0.1 reaches no other machine.
        merged["local_hostname"] = vllm_compat.host_ip()
    if not merged.get("master_server_address"):
        raise ValueError(
            "mooncake backend: no master address (set mooncake.master_server_address, "
            "MOONCAKE_CONFIG_PATH or MOONCAKE_MASTER)"
        )
    merged["global_segment_size"] = parse_size(merged["global_segment_size"]) if options.mount_segment else 0
    merged["local_buffer_size"] = parse_size(merged["local_buffer_size"])
    return merged
