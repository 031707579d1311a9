"""Shared by the hybrid-model e2e modules (store, UCM): the tiny Gemma2-style model, prompts longer
than its window, and one run of three engines at once: a no-connector reference, A that saves,
and B, a fresh engine over the same store, that must hit.

The model alternates sliding-window (128 tokens) and full-attention layers, so vLLM's hybrid
KV-cache manager gives it two KV-cache groups; the prompts are longer than the window, so the
sliding group holds vLLM's null block in front of its window. Every engine must keep the hybrid
manager on: no "Turning off hybrid kv cache manager" line, the KV capacity of the reference.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

from conftest import BLOCK

WINDOW = 128
MAX_TOKENS = 12
HMA_OFF_LINES = ("Turning off hybrid kv cache manager", "Hybrid KV cache manager is disabled")


def hybrid_model() -> Any:
    from kv_common.testing import cached_tiny_model

    return cached_tiny_model(arch="gemma2", sliding_window=WINDOW)


def hybrid_prompts() -> list[list[int]]:
    """Longer than the window; two share a 3-block prefix; one fills its last block exactly."""
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


def run_hybrid(kv_transfer_config: dict, *, name: str, env: dict | None = None, timeout_s: float = 300) -> dict:
    """Three in-process engines started at once (prefix caching off, so every cached token of B came
    from the store); returns the prompts, each engine's result, log and KV capacity."""
    from kv_common.testing import EngineProcess

    model = hybrid_model()
    common = dict(max_tokens=MAX_TOKENS, kv_cache_bytes=16 << 20, max_model_len=1024, multiprocess=False,
                  keep_logs=True, extra_llm_kwargs={"enable_prefix_caching": False}, env=env,
                  start_timeout_s=timeout_s)
    specs = {"reference": dict(kv_transfer_config=None), "a": dict(kv_transfer_config=kv_transfer_config, instrument=True),
             "b": dict(kv_transfer_config=kv_transfer_config)}
    engines = {key: EngineProcess(model, name=f"{name}-{key}", **{**common, **spec}).start(wait=False)
               for key, spec in specs.items()}
    try:
        for eng in engines.values():
            eng.wait_ready()
        prompts = hybrid_prompts()
        t0 = time.perf_counter()
        out: dict[str, Any] = {"prompts": prompts, "want": engines["reference"].generate(prompts, timeout_s=timeout_s)}
        out["a"] = engines["a"].generate(prompts, timeout_s=timeout_s)
        engines["a"].wait_saves_done()
        out["b"] = engines["b"].generate(prompts, timeout_s=timeout_s)
        print(f"\n[{name}] three generate calls in {time.perf_counter() - t0:.1f} s")
        metrics = engines["b"].metrics("vllm:prompt_tokens_by_source")
        out["b_external"] = sum(m["value"] for m in metrics if m["labels"].get("source") == "external_kv_transfer")
        out["logs"] = {key: eng.log_path.read_text(errors="replace") for key, eng in engines.items()}
        return out
    finally:
        for eng in engines.values():
            eng.close()


def check_hit(runs: dict) -> None:
    """A matches the reference from an empty store; fresh B matches it with the full hit."""
    from kv_common.testing import assert_same_tokens

    assert_same_tokens(runs["a"], runs["want"])
    assert runs["a"].num_cached_tokens == [0] * len(runs["prompts"])
    b = runs["b"]
    assert_same_tokens(b, runs["want"])
    assert b.num_cached_tokens == [expected_hit(p) for p in runs["prompts"]], b.num_cached_tokens
    # vLLM's own count: B's external tokens are the store's hit
    assert runs["b_external"] == sum(expected_hit(p) for p in runs["prompts"]), runs["b_external"]


def check_hybrid_manager_on(runs: dict) -> None:
    for key, log in runs["logs"].items():
        for line in HMA_OFF_LINES:
            assert line not in log, f"{key}: {line!r} in its log"
    reference = kv_capacity_tokens(runs["logs"]["reference"])
    assert kv_capacity_tokens(runs["logs"]["a"]) == reference
    assert kv_capacity_tokens(runs["logs"]["b"]) == reference
