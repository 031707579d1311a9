"""Opt-in test harness for kv-* connectors (``pip install kv-common[testing]``).

Light at import time: torch, transformers and vLLM load only when a helper needs them, and vLLM
itself only ever runs in child processes (see :mod:`kv_common.testing.engine`).
"""

from kv_common.testing.engine import EngineError, EngineProcess, EngineResult, max_model_len_for
from kv_common.testing.engine_runs import assert_same_tokens, baseline, run_engine, run_engine_batches
from kv_common.testing.leaks import LeakBaseline, LeakError, assert_no_leaks
from kv_common.testing.ports import free_port
from kv_common.testing.probe import (
    PROBE_NAME,
    PROBE_SPEC,
    SCHEDULER_HOOKS,
    WORKER_HOOKS,
    probe_config,
    read_probe_trace,
    register,
    summarize_trace,
)
from kv_common.testing.tiny_model import build_tiny_llama, cached_tiny_model, model_cache_root

__all__ = [
    "PROBE_NAME",
    "PROBE_SPEC",
    "SCHEDULER_HOOKS",
    "WORKER_HOOKS",
    "EngineError",
    "EngineProcess",
    "EngineResult",
    "LeakBaseline",
    "LeakError",
    "assert_no_leaks",
    "assert_same_tokens",
    "baseline",
    "build_tiny_llama",
    "cached_tiny_model",
    "free_port",
    "max_model_len_for",
    "model_cache_root",
    "probe_config",
    "read_probe_trace",
    "register",
    "run_engine",
    "run_engine_batches",
    "summarize_trace",
]
