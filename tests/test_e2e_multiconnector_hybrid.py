"""P2P plus pool under vLLM's MultiConnector with a hybrid model: the combination stays HMA.

vLLM keeps its hybrid KV-cache manager on under MultiConnector only when every child is
``SupportsHMA``. Prefill P and decode D each run vllm-ascend's documented MultiConnector of
``MooncakeConnectorV1`` and ``AscendStoreConnector`` (``test_e2e_multiconnector._multi``) over the
tiny Gemma2 (sliding-window and full-attention layers, window 128; prompts longer than it):

* a request with ``kv_transfer_params`` is pulled from P, group by group: D reports the whole
  prompt as cached;
* a request without them hits the pool P saved it to: D reports the full blocks;
* tokens equal P's own (P's store child only saves and its P2P child is inert without
  ``kv_transfer_params``: a run without a connector's effect), and neither engine logs that it
  turned the hybrid manager off; both have the hybrid manager's KV capacity.

Two engines, started in parallel once for the module.
"""

from __future__ import annotations

import random

import pytest
from conftest import requires_vllm, running_engines
from hybrid_e2e import HMA_OFF_LINES, expected_hit, hybrid_model, kv_capacity_tokens
from test_e2e_multiconnector import (
    PULL_TIMEOUT_S,
    _forward,
    _full_blocks,
    _multi,
    _prefill,
    _spill_files,
    _wait_saved,
)

pytestmark = [requires_vllm, pytest.mark.e2e]

pytest.importorskip("mooncake.engine")

P_PORT, D_PORT = 18610, 18660
MAX_TOKENS = 8
# vLLM recomputes the last prompt token after a full load; at n = 127 (mod 128) tokens its window
# reaches a block vLLM itself dropped (see test_e2e_mooncake_hybrid): lengths stay clear of that.
PROMPT_LENGTHS = (300, 530)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from kv_common.testing import EngineProcess

    spill = tmp_path_factory.mktemp("multi-hybrid-spill")
    common = dict(max_tokens=MAX_TOKENS, max_model_len=1024, kv_cache_bytes=64 << 20, keep_logs=True,
                  env={"MC_LOG_LEVEL": "ERROR"})
    model = hybrid_model()
    engines = {
        "p": EngineProcess(model, kv_transfer_config=_multi("kv_producer", P_PORT, spill), cpu_bind="0",
                           name="hybrid-p", **common),
        "d": EngineProcess(model, kv_transfer_config=_multi("kv_consumer", D_PORT, spill), cpu_bind="1",
                           name="hybrid-d", **common),
    }
    with running_engines(list(engines.values())):
        yield {**engines, "spill": spill}


def test_pull_and_pool_with_the_hybrid_manager_on(fleet):
    from kv_common.testing import assert_same_tokens

    p, d, spill = fleet["p"], fleet["d"], fleet["spill"]
    pulled, pooled = _prompts(41), _prompts(42)
    before = _spill_files(spill)
    reference = p.generate(pulled + pooled)  # P's store child saves every full block of each group
    # (P saves in the background: wait for a value per full block and group; a missing one shows
    # below as a shorter pool hit.)
    _wait_saved(spill, before, 2 * _full_blocks(pulled + pooled))
    params = _prefill(p, pulled)
    out = d.generate(pulled + pooled, _forward(params) + [None] * len(pooled), timeout_s=PULL_TIMEOUT_S + 60)
    assert_same_tokens(out, reference)
    want = [len(q) for q in pulled] + [expected_hit(q) for q in pooled]
    assert out.num_cached_tokens == want, (out.num_cached_tokens, want, out.log_warnings)
    logs = {key: fleet[key].log_path.read_text(errors="replace") for key in ("p", "d")}
    for key, log in logs.items():
        for line in HMA_OFF_LINES:
            assert line not in log, f"{key}: {line!r} in its log"
    assert kv_capacity_tokens(logs["p"]) == kv_capacity_tokens(logs["d"])
