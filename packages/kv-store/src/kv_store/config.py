"""``kv_connector_extra_config`` of AscendStoreConnector.

```json
{"backend": "embedded",                       // "embedded" | "mooncake" | a kv_store.backends entry point
 "embedded": {"capacity_bytes": 1073741824,   // in-process LRU (per process)
              "spill_dir": null,              // shared directory; default <tmp>/kv-store-<uid>
              "write_through": true, "spill_capacity_bytes": null},
 "mooncake": {"config_path": null,            // or MOONCAKE_CONFIG_PATH: Mooncake's own JSON
              "master_server_address": "127.0.0.1:50051", "metadata_server": "P2PHANDSHAKE",
              "protocol": "tcp", "local_hostname": "127.0.0.1", "device_name": "",
              "global_segment_size": "512mb", "local_buffer_size": "128mb",
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
from typing import Any

from kv_common.config import ConnectorConfig
from kv_common.store_connector.config import StoreConnectorConfig


class EmbeddedOptions(ConnectorConfig):
    capacity_bytes: int = 1 << 30
    spill_dir: str | None = None
    write_through: bool = True
    spill_capacity_bytes: int | None = None


class MooncakeOptions(ConnectorConfig):
    config_path: str | None = None
    master_server_address: str | None = None
    metadata_server: str | None = None
    protocol: str | None = None
    local_hostname: str | None = None
    device_name: str | None = None
    global_segment_size: int | str | None = None
    local_buffer_size: int | str | None = None
    setup_retries: int | None = 3
    setup_timeout_s: float = 60.0


class StoreConfig(StoreConnectorConfig):
    backend: str = "embedded"
    embedded: EmbeddedOptions = EmbeddedOptions()
    mooncake: MooncakeOptions = MooncakeOptions()


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


_DEFAULTS: dict[str, Any] = {
    "metadata_server": "P2PHANDSHAKE",
    "protocol": "tcp",
    "local_hostname": "127.0.0.1",
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
    if not merged.get("master_server_address"):
        raise ValueError(
            "mooncake backend: no master address (set mooncake.master_server_address, "
            "MOONCAKE_CONFIG_PATH or MOONCAKE_MASTER)"
        )
    merged["global_segment_size"] = parse_size(merged["global_segment_size"])
    merged["local_buffer_size"] = parse_size(merged["local_buffer_size"])
    return merged
