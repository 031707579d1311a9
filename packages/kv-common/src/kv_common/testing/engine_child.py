"""Child-process side of :mod:`kv_common.testing.engine`: hosts exactly one vLLM ``LLM``.

Run as ``python -m kv_common.testing.engine_child SPEC.json``. Protocol: JSON lines. The child's
original stdout is the reply channel; fd 1 is pointed at stderr before vLLM is imported so that
log lines (ours, vLLM's and the engine subprocesses') never mix with replies. Requests come as
JSON lines on stdin:

* ``{"op": "generate", "prompts": [[ids]], "extra_args": [dict|None] | null, "max_tokens": int | [int]}``
* ``{"op": "reset_prefix_cache"}``: drop the engine's local prefix cache (a connector's data stays),
  so a repeated prompt must come from the connector
* ``{"op": "timings"}``: only with ``"instrument": true`` in the spec (``EngineProcess(instrument=True)``):
  per-``LLMEngine.step()`` wall times and per-request scheduler lookup times
  (``connector.get_num_new_matched_tokens``) collected since the last call, then cleared. Only
  meaningful in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the step runs the scheduler and
  the model in this process; with EngineCore in another process only the step times are collected
* ``{"op": "leak_report"}``: with ``instrument``: each in-process connector side's ``leak_report()``
* ``{"op": "metrics", "prefix": "vllm:"}``: the engine's Prometheus metrics whose name starts with
  ``prefix`` (``LLM.get_metrics()``; connectors' own ones included), cumulative since start
* ``{"op": "ping"}``
* ``{"op": "close"}`` (or EOF on stdin)

Replies: first ``{"event": "ready", ...}`` (or ``{"event": "error", ...}``), then one
``{"ok": true, "result": {...}}`` / ``{"ok": false, "error": "..."}`` per request.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, TextIO


def _send(chan: TextIO, msg: dict[str, Any]) -> None:
    chan.write(json.dumps(msg, default=repr) + "\n")
    chan.flush()


def _jsonable(obj: Any) -> Any:
    try:
        return json.loads(json.dumps(obj, default=repr))
    except (TypeError, ValueError):
        return repr(obj)


def _build_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": spec["model_dir"],
        "dtype": "float32",
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "max_model_len": int(spec["max_model_len"]),
        "seed": int(spec.get("seed", 0)),
        "disable_log_stats": not spec.get("collect_metrics", True),
    }
    if spec.get("kv_cache_bytes"):
        kwargs["kv_cache_memory_bytes"] = int(spec["kv_cache_bytes"])
    if spec.get("block_size"):
        kwargs["block_size"] = int(spec["block_size"])
    if spec.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    kwargs.update(spec.get("extra_llm_kwargs") or {})
    return LLM(**kwargs)


def _generate(llm: Any, req: dict[str, Any], default_max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = req["prompts"]
    n = len(prompts)
    extra = req.get("extra_args") or [None] * n
    max_tokens = req.get("max_tokens") or default_max_tokens
    max_tokens_list = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
    if len(extra) != n or len(max_tokens_list) != n:
        raise ValueError("extra_args / max_tokens lists must have one entry per prompt")
    params = [
        SamplingParams(temperature=0.0, max_tokens=int(mt), ignore_eos=True, extra_args=ea or None)
        for ea, mt in zip(extra, max_tokens_list, strict=False)
    ]
    inputs = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
    t0 = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    res: dict[str, Any] = {
        "token_ids": [],
        "num_cached_tokens": [],
        "kv_transfer_params": [],
        "ttft_s": [],
        "e2e_s": [],
        "wall_s": wall,
    }
    for out in outputs:
        res["token_ids"].append([int(t) for t in out.outputs[0].token_ids])
        res["num_cached_tokens"].append(int(out.num_cached_tokens or 0))
        res["kv_transfer_params"].append(_jsonable(out.kv_transfer_params))
        m = getattr(out, "metrics", None)
        ttft = getattr(m, "first_token_latency", None) if m is not None else None
        ttft = float(ttft) if ttft else None
        e2e = None
        last, first = getattr(m, "last_token_ts", None), getattr(m, "first_token_ts", None)
        if ttft is not None and last and first:
            e2e = ttft + float(last - first)
        res["ttft_s"].append(ttft)
        res["e2e_s"].append(e2e)
    return res


def _metrics(llm: Any, prefix: str) -> list[dict[str, Any]]:
    """Counters and gauges as ``value``, histograms as ``sum`` and ``count``, with their labels."""
    out = []
    for m in llm.get_metrics():
        if not m.name.startswith(prefix):
            continue
        row: dict[str, Any] = {"name": m.name, "labels": dict(m.labels)}
        if hasattr(m, "count"):  # a histogram
            row.update(sum=float(m.sum), count=int(m.count))
        elif hasattr(m, "value"):
            row["value"] = float(m.value)
        else:
            continue  # vectors (spec decode): not needed here
        out.append(row)
    return out


# Connector hooks timed besides the lookup (benchmarks split scheduler-side from worker-side cost).
_SCHEDULER_HOOKS = ("update_state_after_alloc", "build_connector_meta", "request_finished", "update_connector_output")
_WORKER_LOAD_HOOKS = ("start_load_kv", "wait_for_layer_load", "get_finished")
_WORKER_SAVE_HOOKS = ("save_kv_layer", "wait_for_save")


class _Timers:
    """Step, lookup and connector-hook timers wrapped around an in-process engine (opt-in: spec
    ``instrument``); ``leak_report()`` asks both connector sides for theirs."""

    def __init__(self, llm: Any) -> None:
        self.steps: list[float] = []
        self.lookups: list[float] = []
        self.sched_hooks: list[float] = []
        self.worker_load: list[float] = []
        self.worker_save: list[float] = []
        engine = llm.llm_engine
        engine.step = self._timed(engine.step, self.steps)
        self.found = {"step": True, "lookup": False, "worker": False}
        # InprocClient -> EngineCore (absent with EngineCore in another process: no lookup timer)
        core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
        connector = getattr(getattr(core, "scheduler", None), "connector", None)
        self.connectors: list[Any] = []
        if connector is not None:
            connector.get_num_new_matched_tokens = self._timed(
                connector.get_num_new_matched_tokens, self.lookups
            )
            self._wrap(connector, _SCHEDULER_HOOKS, self.sched_hooks)
            self.connectors.append(connector)
            self.found["lookup"] = True
            try:  # the worker side lives in this process too when the engine is in-process
                from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

                if has_kv_transfer_group():
                    worker = get_kv_transfer_group()
                    self._wrap(worker, _WORKER_LOAD_HOOKS, self.worker_load)
                    self._wrap(worker, _WORKER_SAVE_HOOKS, self.worker_save)
                    self.connectors.append(worker)
                    self.found["worker"] = True
            except Exception:  # noqa: BLE001 - timers are best effort
                traceback.print_exc()

    def _wrap(self, obj: Any, names: tuple[str, ...], sink: list[float]) -> None:
        for name in names:
            fn = getattr(obj, name, None)
            if callable(fn):
                setattr(obj, name, self._timed(fn, sink))

    def leak_report(self) -> list[dict[str, int] | None]:
        """Each connector side's ``leak_report()`` (None where it has none)."""
        out = []
        for c in self.connectors:
            fn = getattr(c, "leak_report", None)
            out.append(dict(fn()) if callable(fn) else None)
        return out

    @staticmethod
    def _timed(fn: Any, sink: list[float]) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                sink.append(time.perf_counter() - t0)

        return timed

    def take(self) -> dict[str, list[float]]:
        res = {"step_s": list(self.steps), "lookup_s": list(self.lookups), "sched_hook_s": list(self.sched_hooks),
               "worker_load_s": list(self.worker_load), "worker_save_s": list(self.worker_save)}
        for sink in (self.steps, self.lookups, self.sched_hooks, self.worker_load, self.worker_save):
            sink.clear()
        return res


def _shutdown(llm: Any, timeout_s: float = 30.0) -> None:
    """Graceful stop with a generous grace period, so connector ``shutdown()`` hooks run even on a
    loaded machine (vLLM's default force-kills EngineCore after 5 s)."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    fn = getattr(client, "shutdown", None)
    if not callable(fn):
        return
    try:
        try:
            fn(timeout=timeout_s)
        except TypeError:
            fn()
    except Exception:  # noqa: BLE001 - best effort; the parent kills the tree anyway
        traceback.print_exc()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Reply channel = original stdout; everything else printed to fd 1 goes to stderr.
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
        timers = _Timers(llm) if spec.get("instrument") else None
    except BaseException:  # noqa: BLE001 - report every start failure to the parent
        _send(chan, {"event": "error", "error": traceback.format_exc()})
        return 1
    t_start = time.perf_counter() - t0
    ready: dict[str, Any] = {"event": "ready", "pid": os.getpid(), "import_s": t_import, "start_s": t_start}
    if timers is not None:
        ready["instrumented"] = timers.found
    _send(chan, ready)

    default_max_tokens = int(spec.get("max_tokens", 16))
    rc = 0
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
                if timers is None:
                    raise RuntimeError("timings: start the engine with instrument=True")
                _send(chan, {"ok": True, "result": timers.take()})
            elif op == "leak_report":
                if timers is None:
                    raise RuntimeError("leak_report: start the engine with instrument=True")
                _send(chan, {"ok": True, "result": {"connectors": timers.leak_report()}})
            elif op == "reset_prefix_cache":
                _send(chan, {"ok": True, "result": {"reset": bool(llm.reset_prefix_cache())}})
            elif op == "metrics":
                _send(chan, {"ok": True, "result": {"metrics": _metrics(llm, str(req.get("prefix", "vllm:")))}})
            elif op == "ping":
                _send(chan, {"ok": True, "result": {"pid": os.getpid()}})
            else:
                _send(chan, {"ok": False, "error": f"unknown op {op!r}"})
        except Exception:  # noqa: BLE001
            _send(chan, {"ok": False, "error": traceback.format_exc()})
    _shutdown(llm, float(spec.get("shutdown_timeout_s", 30.0)))
    del llm
    _send(chan, {"event": "closed"})
    chan.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
