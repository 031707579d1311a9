"""Registration and trace reading for the probe connector (import-light: no torch, no vLLM).

``PROBE_SPEC`` is published under the ``kv_common.connectors`` entry-point group and ``register``
under ``vllm.general_plugins``. The probe is test code: ``register`` makes it known to vLLM only when
``KV_COMMON_ENABLE_PROBE=1`` is set in the environment of the vLLM processes (``EngineProcess`` sets
it for configs that name the probe); then ``kv_connector="KVCommonProbeConnector"`` works by name.
The connector itself lives in :mod:`kv_common.testing.probe_connector`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from kv_common.registry import ConnectorSpec, register_with_vllm

PROBE_NAME = "KVCommonProbeConnector"
# Read when vLLM loads the general plugins (every vLLM process): "1" registers the probe.
PROBE_ENV = "KV_COMMON_ENABLE_PROBE"
PROBE_SPEC = ConnectorSpec(PROBE_NAME, "kv_common.testing.probe_connector", "KVCommonProbeConnector")

# Hooks that live on each side (used by tests and by ``summarize_trace``).
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
)
WORKER_HOOKS = (
    "register_kv_caches",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
)


def probe_enabled() -> bool:
    return os.environ.get(PROBE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """``vllm.general_plugins`` entry point: make the probe known to vLLM's factory, when asked."""
    if probe_enabled():
        register_with_vllm([PROBE_SPEC])


def uses_probe(kv_transfer_config: Mapping | None) -> bool:
    """Whether a ``kv_transfer_config`` dict selects the probe (directly or as a MultiConnector child)."""
    if not kv_transfer_config:
        return False
    if kv_transfer_config.get("kv_connector") == PROBE_NAME:
        return True
    extra = kv_transfer_config.get("kv_connector_extra_config") or {}
    children = (extra.get("connectors") or []) if isinstance(extra, Mapping) else []
    return any(isinstance(c, Mapping) and uses_probe(c) for c in children)


def probe_config(trace_dir: str | Path, *, kv_role: str = "kv_both", **extra: object) -> dict:
    """A ``kv_transfer_config`` dict that selects the probe by name and traces into ``trace_dir``."""
    return {
        "kv_connector": PROBE_NAME,
        "kv_role": kv_role,
        "kv_connector_extra_config": {"trace_dir": str(trace_dir), **extra},
    }


def read_probe_trace(trace_dir: str | Path) -> list[dict]:
    """Every record the probe wrote under ``trace_dir`` (all processes), ordered by time."""
    records: list[dict] = []
    for path in sorted(Path(trace_dir).glob("probe-*.jsonl")):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if line:
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:  # a process killed mid-write leaves a torn last line
                        continue
    records.sort(key=lambda r: (r.get("t", 0.0), r.get("seq", 0)))
    return records


def summarize_trace(records: list[dict]) -> dict[str, dict[str, set[int]]]:
    """role -> method -> set of pids that called it."""
    out: dict[str, dict[str, set[int]]] = {}
    for r in records:
        out.setdefault(r["role"], {}).setdefault(r["method"], set()).add(int(r["pid"]))
    return out
