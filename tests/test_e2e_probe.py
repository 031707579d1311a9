"""The probe connector, selected by name through entry points, inside a real multiprocess vLLM engine."""

from __future__ import annotations

import os
import time

import pytest
from conftest import requires_vllm
from kv_common.testing import (
    SCHEDULER_HOOKS,
    EngineProcess,
    LeakBaseline,
    assert_same_tokens,
    probe_config,
    read_probe_trace,
    summarize_trace,
)
from kv_common.testing.probe import PROBE_ENV

pytestmark = [pytest.mark.e2e, requires_vllm]
psutil = pytest.importorskip("psutil")


def test_probe_hooks_fire_in_separate_processes(tiny_model, prompts, baseline_tokens, tmp_path):
    leaks = LeakBaseline.capture()
    trace_dir = tmp_path / "trace"
    cfg = probe_config(trace_dir)
    assert "kv_connector_module_path" not in cfg  # resolved by name only (entry points)
    extra = [{"kv_transfer_params": {"probe_index": i}} for i in range(len(prompts))]

    t0 = time.perf_counter()
    env = {PROBE_ENV: "1"}  # the probe is registered only when asked (EngineProcess would set it too)
    with EngineProcess(tiny_model, kv_transfer_config=cfg, env=env, multiprocess=True, name="probe") as eng:
        started = time.perf_counter() - t0
        engine_pids = set(eng.pids())
        engine_procs = [psutil.Process(p) for p in engine_pids]
        result = eng.generate(prompts, extra)
    total = time.perf_counter() - t0
    print(
        f"\n[probe] multiprocess engine: start {started:.1f} s (child {result.start_s:.1f} s), "
        f"generate {result.wall_s:.2f} s, total with shutdown {total:.1f} s"
    )

    assert_same_tokens(result, baseline_tokens)

    # request_finished's dict comes back as RequestOutput.kv_transfer_params.
    assert all(p and p.get("probe") for p in result.kv_transfer_params), result.kv_transfer_params

    records = read_probe_trace(trace_dir)
    by_role = summarize_trace(records)
    sched, worker = by_role.get("scheduler", {}), by_role.get("worker", {})
    for hook in (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "request_finished",
    ):
        assert hook in sched, f"scheduler hook {hook} never called; saw {sorted(sched)}"
    for hook in (
        "register_kv_caches",
        "start_load_kv",
        "save_kv_layer",
        "wait_for_save",
        "wait_for_layer_load",
    ):
        assert hook in worker, f"worker hook {hook} never called; saw {sorted(worker)}"

    sched_pids = set().union(*(sched[h] for h in SCHEDULER_HOOKS))
    worker_pids = set().union(
        *(worker[h] for h in ("register_kv_caches", "start_load_kv", "save_kv_layer", "wait_for_save"))
    )
    assert len(sched_pids) == 1 and len(worker_pids) == 1, (sched_pids, worker_pids)
    assert sched_pids.isdisjoint(worker_pids)
    assert os.getpid() not in sched_pids | worker_pids
    assert (sched_pids | worker_pids) <= engine_pids  # both live inside the engine's process tree

    # Per-request data reached the scheduler-side connector; every prompt was asked about.
    asked = [r for r in records if r["method"] == "get_num_new_matched_tokens"]
    assert sorted({r["kv_transfer_params"]["probe_index"] for r in asked}) == list(range(len(prompts)))
    assert len([r for r in records if r["method"] == "request_finished"]) == len(prompts)
    # Both sides shut down cleanly.
    assert "shutdown" in sched and "shutdown" in worker
    # save_kv_layer saw the CPU layout [num_blocks, num_kv_heads, block_size, 2 * head_dim].
    shape = next(r["shape"] for r in records if r["method"] == "save_kv_layer")
    assert shape[1:] == [4, 128, 64], shape

    # The engine's process tree is gone and the test process holds nothing new.
    assert not [p for p in engine_procs if _alive(p)], [(p.pid, p.name()) for p in engine_procs if _alive(p)]
    leaks.assert_clean(timeout_s=5.0)


def _alive(proc) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
