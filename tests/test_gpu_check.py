"""scripts/gpu-check.sh and its Python part, on this CPU machine: the shell script parses, the plan
prints without a GPU or vLLM (``--dry-run``), and the verdict fails on any mismatch. The real
check needs a CUDA GPU and has not run yet (README, "Models"); its data-path part
(scripts/gpu_connector_check.py) ran on an H200 and runs here on host memory."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def test_the_shell_script_parses():
    bash = shutil.which("bash")
    assert bash is not None
    subprocess.run([bash, "-n", str(SCRIPT)], check=True)


def test_dry_run_prints_the_plan_without_vllm(tmp_path):
    """The shell script's --dry-run path: no GPU, no venv, no vLLM imported (a bare interpreter
    with -S and -I sees no site-packages)."""
    out = subprocess.run([sys.executable, "-S", "-I", str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu",
                          "--dry-run", "--json"], capture_output=True, text=True, check=True, timeout=60, cwd=tmp_path)
    plan = json.loads(out.stdout)
    checks = [(c["model"], c["scenario"]) for c in plan["plan"]["checks"]]
    assert checks == [("llama", "p2p-1p1d"), ("llama", "store-hit"), ("gemma2", "p2p-1p1d"), ("gemma2", "store-hit")]
    p2p = plan["plan"]["checks"][0]["kv_transfer_config"]
    assert (p2p["prefill"]["kv_role"], p2p["decode"]["kv_role"]) == ("kv_producer", "kv_consumer")
    assert p2p["decode"]["kv_load_failure_policy"] == "fail"  # a failed pull is an error, not a recompute
    store = plan["plan"]["checks"][1]["kv_transfer_config"]["a"]
    assert store["kv_connector_extra_config"]["backend"] == "mooncake"
    assert plan["plan"]["checks"][2]["tiny_model"] == {"arch": "gemma2"}
    assert all(r["status"] == "planned" for r in plan["rows"])


def test_cuda_settings_share_one_gpu(gpu_check):
    cuda = gpu_check.engine_settings("cuda", "llama")
    assert cuda["extra_llm_kwargs"]["gpu_memory_utilization"] * 3 < 1  # baseline + two engines fit
    assert cuda["block_size"] == 16 and gpu_check.engine_settings("cpu", "llama")["block_size"] == 128
    assert max(gpu_check.PROMPT_LENGTHS) + gpu_check.MAX_TOKENS < cuda["max_model_len"]
    assert min(gpu_check.PROMPT_LENGTHS) > 128  # longer than the Gemma2 window


def test_any_mismatch_fails_the_check(gpu_check):
    want = [[1, 2, 3], [4, 5, 6]]

    def row(**kw):
        return gpu_check.Row("gemma2", "p2p-1p1d", "cuda", loaded=[6, 6], expected_loaded=[6, 6], **kw)

    good = gpu_check.judge(row(hybrid_manager="on"), [[1, 2, 3], [4, 5, 6]], want)
    assert good.status == "pass" and gpu_check.exit_code([good]) == 0
    tokens = gpu_check.judge(row(), [[1, 2, 3], [4, 5, 7]], want)
    assert tokens.status == "FAIL" and "tokens differ in 1 of 2" in tokens.detail
    unloaded = gpu_check.judge(gpu_check.Row("llama", "store-hit", "cuda", loaded=[0, 6], expected_loaded=[6, 6]),
                               want, want)
    assert unloaded.status == "FAIL" and "loaded [0, 6]" in unloaded.detail
    hma_off = gpu_check.judge(row(hybrid_manager=gpu_check.hybrid_manager("... Turning off hybrid kv cache manager")),
                              want, want)
    assert hma_off.status == "FAIL" and "hybrid" in hma_off.detail
    assert gpu_check.exit_code([good, tokens]) == 1
    assert gpu_check.exit_code([]) == 1  # nothing checked is not a pass
    table = gpu_check.format_table([good, tokens])
    assert "same tokens" in table.splitlines()[0] and "1/2" in table and "FAIL" in table


def test_expected_store_hit_counts_full_blocks_only(gpu_check):
    assert gpu_check.expected_store_hit([0] * 300, 128) == 256
    assert gpu_check.expected_store_hit([0] * 256, 128) == 128  # the last full block is computed
    assert gpu_check.expected_store_hit([0] * 437, 16) == 432


def test_the_connector_data_path_check_passes_on_host_memory():
    """scripts/gpu_connector_check.py (what ran on a lent H200, README "Models") on host memory:
    every check passes here too, so the script cannot rot between GPU loans."""
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "MC_LOG_LEVEL": "ERROR"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_connector_check.py")], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=env)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    checks = {row["check"]: row for row in rows if "check" in row}
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert set(checks) == {"doctor", "p2p-hybrid", "p2p-bulk", "store-embedded", "store-mooncake"}
    assert all(row["status"] == "pass" for row in checks.values()), checks
    assert checks["p2p-hybrid"]["blocks_pulled"] == 16 and checks["p2p-hybrid"]["blocks_untouched"] == 112
    assert rows[-1] == {"checks": 5, "failed": 0}
