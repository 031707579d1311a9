"""Benchmark engine child: ``kv_common.testing.engine_child`` plus timing instruments.

Same JSON-lines protocol as the harness child (it reuses its ``_build_llm`` / ``_generate``), with
extra ops the benchmarks need and the harness does not (yet) offer:

* ``{"op": "timings"}``: per-``LLMEngine.step()`` wall times and per-request scheduler lookup times
  (``connector.get_num_new_matched_tokens``) collected since the last call, then cleared. Only
  meaningful in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the step runs the scheduler
  and the model in this process.
* ``{"op": "reset_prefix_cache"}``: drop the engine's local prefix cache (connector data stays), so
  a repeated prompt must come from the connector (OffloadingConnector's CPU tier).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from kv_common.testing.engine_child import _build_llm, _generate, _send, _shutdown

_STEPS: list[float] = []
_LOOKUPS: list[float] = []


def _instrument(llm: Any) -> dict[str, bool]:
    engine = llm.llm_engine
    orig_step = engine.step

    def timed_step(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig_step(*a, **kw)
        finally:
            _STEPS.append(time.perf_counter() - t0)

    engine.step = timed_step
    found = {"step": True, "lookup": False}
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient -> EngineCore
    connector = getattr(getattr(core, "scheduler", None), "connector", None)
    if connector is not None:
        orig_lookup = connector.get_num_new_matched_tokens

        def timed_lookup(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig_lookup(*a, **kw)
            finally:
                _LOOKUPS.append(time.perf_counter() - t0)

        connector.get_num_new_matched_tokens = timed_lookup
        found["lookup"] = True
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chan = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with open(argv[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    t0 = time.perf_counter()
    try:
        import vllm  # noqa: F401

        t_import = time.perf_counter() - t0
        llm = _build_llm(spec)
        found = _instrument(llm)
    except BaseException:  # noqa: BLE001 - every start failure goes to the parent
        _send(chan, {"event": "error", "error": traceback.format_exc()})
        return 1
    _send(
        chan,
        {
            "event": "ready",
            "pid": os.getpid(),
            "import_s": t_import,
            "start_s": time.perf_counter() - t0,
            "instrumented": found,
        },
    )
    default_max_tokens = int(spec.get("max_tokens", 16))
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "close":
                break
            if op == "generate":
                _send(chan, {"ok": True, "result": _generate(llm, req, default_max_tokens)})
            elif op == "timings":
                res = {"step_s": list(_STEPS), "lookup_s": list(_LOOKUPS)}
                _STEPS.clear()
                _LOOKUPS.clear()
                _send(chan, {"ok": True, "result": res})
            elif op == "reset_prefix_cache":
                _send(chan, {"ok": True, "result": {"reset": bool(llm.reset_prefix_cache())}})
            elif op == "ping":
                _send(chan, {"ok": True, "result": {"pid": os.getpid()}})
            else:
                _send(chan, {"ok": False, "error": f"unknown op {op!r}"})
        except Exception:  # noqa: BLE001
            _send(chan, {"ok": False, "error": traceback.format_exc()})
    _shutdown(llm)
    del llm
    _send(chan, {"event": "closed"})
    chan.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
