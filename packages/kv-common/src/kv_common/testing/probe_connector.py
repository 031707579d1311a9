"""A KV connector that moves no KV and records every hook call.

Each process appends JSON lines to ``<trace_dir>/probe-<role>-<pid>.jsonl`` (``trace_dir`` comes
from ``kv_connector_extra_config``, or the ``KV_PROBE_TRACE_DIR`` environment variable). Records:
``{"t", "seq", "pid", "role", "method", ...details}``. Read them with
:func:`kv_common.testing.probe.read_probe_trace`.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from typing import Any

from kv_common.vllm_compat import base_module

_base = base_module()
KVConnectorBase_V1 = _base.KVConnectorBase_V1
KVConnectorMetadata = _base.KVConnectorMetadata
KVConnectorRole = _base.KVConnectorRole


class ProbeConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc,valid-type]  # vLLM's, at run time
    """Trivial per-step metadata: which step of the scheduler built it and how many requests it saw."""

    def __init__(self, step: int, num_scheduled_reqs: int) -> None:
        self.step = step
        self.num_scheduled_reqs = num_scheduled_reqs


def _request_id(request: Any) -> str | None:
    rid = getattr(request, "request_id", None)
    return None if rid is None else str(rid)


class KVCommonProbeConnector(KVConnectorBase_V1):  # type: ignore[misc,valid-type]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {})
        trace_dir = extra.get("trace_dir") or os.environ.get("KV_PROBE_TRACE_DIR")
        self._role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._fh = None
        self._step = 0
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            path = os.path.join(trace_dir, f"probe-{self._role_name}-{os.getpid()}.jsonl")
            self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in shutdown()
        self._record("__init__", kv_role=str(getattr(self._kv_transfer_config, "kv_role", "")))

    # ------------------------------------------------------------------ tracing
    def _record(self, method: str, **details: Any) -> None:
        if self._fh is None:
            return
        rec = {
            "t": time.time(),
            "seq": next(self._seq),
            "pid": os.getpid(),
            "role": self._role_name,
            "method": method,
            "thread": threading.current_thread().name,
        }
        rec.update(details)
        line = json.dumps(rec, default=repr)
        with self._lock:
            if self._fh is not None:
                self._fh.write(line + "\n")
                self._fh.flush()

    def leak_report(self) -> dict[str, int]:
        return {}

    # ------------------------------------------------------------------ worker side (abstract)
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._record("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._record("wait_for_layer_load", layer=layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._record("save_kv_layer", layer=layer_name, shape=list(getattr(kv_layer, "shape", ())))

    def wait_for_save(self) -> None:
        self._record("wait_for_save")

    # ------------------------------------------------------------------ scheduler side (abstract)
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._record(
            "get_num_new_matched_tokens",
            request_id=_request_id(request),
            num_computed_tokens=int(num_computed_tokens),
            num_prompt_tokens=getattr(request, "num_prompt_tokens", None),
            kv_transfer_params=getattr(request, "kv_transfer_params", None),
        )
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._record(
            "update_state_after_alloc",
            request_id=_request_id(request),
            num_external_tokens=int(num_external_tokens),
        )

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self._step += 1
        n = len(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
        self._record("build_connector_meta", step=self._step, num_scheduled_reqs=n)
        return ProbeConnectorMetadata(self._step, n)

    # ------------------------------------------------------------------ optional hooks, traced
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._record(
            "register_kv_caches", layers={k: list(getattr(v, "shape", ())) for k, v in kv_caches.items()}
        )

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._record("bind_connector_metadata", step=getattr(connector_metadata, "step", None))
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._record("clear_connector_metadata")
        super().clear_connector_metadata()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if finished_req_ids:
            self._record("get_finished", finished_req_ids=sorted(finished_req_ids))
        return None, None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = _request_id(request)
        self._record("request_finished", request_id=rid, num_blocks=len(block_ids or ()))
        # Echo something back so tests can see RequestOutput.kv_transfer_params flow.
        return False, {"probe": True, "request_id": rid, "pid": os.getpid()}

    def on_new_request(self, request: Any) -> None:
        self._record("on_new_request", request_id=_request_id(request))

    def shutdown(self) -> None:
        self._record("shutdown")
        with self._lock:
            fh, self._fh = self._fh, None
        if fh is not None:
            fh.close()
