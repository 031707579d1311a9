"""P2P plus pool under vLLM's MultiConnector: vllm-ascend's standard deployment, end to end.

Prefill P and decode D each run a ``MultiConnector`` of ``MooncakeConnectorV1`` (P2P pull) and
``AscendStoreConnector`` (the pool, here the embedded backend over one shared spill directory),
written the way vllm-ascend documents it: the children carry the roles and ``kv_port``, the outer
config carries no ``kv_load_failure_policy`` (vLLM's default, "fail"), and vLLM's stats logging is
on (its Prometheus observer sees every child's stats).

* a request with ``kv_transfer_params`` is pulled from P (MultiConnector picks the first child
  reporting a hit): D reports the whole prompt as cached;
* a request without them hits the pool (P saved it when it served it): D reports the full blocks;
* a pool value that fails its checksum is a miss (recomputed), never a failed request, while a
  P2P pull in the same batch still comes from P.

The reference tokens come from P on plain requests (P's store child only saves, and its P2P child is
inert without ``kv_transfer_params``: a no-connector run).
"""

from __future__ import annotations

import random
import struct
import time
import zlib
from pathlib import Path

import pytest
from conftest import BLOCK, requires_vllm, running_engines

pytestmark = [requires_vllm, pytest.mark.e2e]

pytest.importorskip("mooncake.engine")

P_PORT, D_PORT = 17810, 17820
MAX_TOKENS = 8
HOLD_TIMEOUT_S = 180.0  # far above a loaded machine's prefill-to-pull gap (see test_e2e_mooncake)
PULL_TIMEOUT_S = 90.0


def _multi(role: str, port: int, spill: Path, **mooncake_extra) -> dict:
    """vllm-ascend's documented MultiConnector config (keys our connectors reject left out)."""
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": str(port),
             "kv_connector_extra_config": {"hold_timeout_s": HOLD_TIMEOUT_S, "pull_timeout_s": PULL_TIMEOUT_S,
                                           **mooncake_extra}},
            {"kv_connector": "AscendStoreConnector", "kv_role": role,
             "kv_connector_extra_config": {"backend": "embedded",
                                           "embedded": {"spill_dir": str(spill), "write_through": True}}},
        ]},
    }


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Distinct prompts of 2-3 blocks plus a partial block (no shared prefix: no local hit)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(2 * BLOCK + 17 + 29 * i)] for i in range(n)]


def _pool_hit(prompt: list[int]) -> int:
    full = len(prompt) // BLOCK
    return (full - 1 if full * BLOCK == len(prompt) else full) * BLOCK


def _full_blocks(prompts: list[list[int]]) -> int:
    return sum(len(p) // BLOCK for p in prompts)


def _spill_files(spill: Path) -> set[Path]:
    return {p for p in spill.iterdir() if p.is_file() and p.suffix == ".kvb"}


def _wait_saved(spill: Path, before: set[Path], count: int, timeout_s: float = 60.0) -> set[Path]:
    """P saves in a background thread after the forward: wait until ``count`` new values landed."""
    deadline = time.monotonic() + timeout_s
    while len(new := _spill_files(spill) - before) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return new


def _corrupt_payload_keep_file_crc(path: Path) -> None:
    """Flip one KV byte and re-seal the embedded backend's file header: only the connector's
    end-to-end checksum can notice."""
    raw = bytearray(path.read_bytes())
    header = struct.Struct("<8sQI")
    magic, length, _ = header.unpack_from(raw)
    payload = raw[header.size :]
    payload[len(payload) // 3] ^= 0xFF
    path.write_bytes(header.pack(magic, length, zlib.crc32(payload)) + payload)


def _prefill(engine, prompts: list[list[int]]) -> list[dict]:
    extra = [{"kv_transfer_params": {"do_remote_decode": True}}] * len(prompts)
    res = engine.generate(prompts, extra, max_tokens=1)
    assert all(res.kv_transfer_params), ("prefill returned no kv_transfer_params", res.log_warnings)
    return res.kv_transfer_params


def _forward(params: list[dict]) -> list[dict]:
    # vLLM copies the prefill's own prefix hits into the decode's num_cached_tokens: drop them so
    # the decode reports what it loaded.
    return [{"kv_transfer_params": {k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"}}
            for p in params]


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    from kv_common.testing import EngineProcess

    spill = tmp_path_factory.mktemp("multi-spill")
    common = dict(max_tokens=MAX_TOKENS, max_model_len=1024, kv_cache_bytes=64 << 20,
                  env={"MC_LOG_LEVEL": "ERROR"})
    engines = {
        "p": EngineProcess(tiny_model, kv_transfer_config=_multi("kv_producer", P_PORT, spill),
                           cpu_bind="0", name="p", **common),
        "d": EngineProcess(tiny_model, kv_transfer_config=_multi("kv_consumer", D_PORT, spill),
                           cpu_bind="1", name="d", **common),
    }
    with running_engines(list(engines.values())):
        yield {**engines, "spill": spill}


def test_decode_loads_from_the_pull_and_from_the_pool(fleet):
    from kv_common.testing import assert_same_tokens

    p, d, spill = fleet["p"], fleet["d"], fleet["spill"]
    pulled, pooled = _prompts(2, seed=21), _prompts(2, seed=22)
    before = _spill_files(spill)
    reference = p.generate(pulled + pooled)  # P's store child saves every full block
    saved = _wait_saved(spill, before, _full_blocks(pulled + pooled))
    assert len(saved) == _full_blocks(pulled + pooled), (len(saved), reference.log_warnings)
    params = _prefill(p, pulled)
    t0 = time.perf_counter()
    out = d.generate(pulled + pooled, _forward(params) + [None] * len(pooled), timeout_s=PULL_TIMEOUT_S + 60)
    print(f"decode of {len(pulled)} pulled + {len(pooled)} pooled prompts: {time.perf_counter() - t0:.2f}s")
    assert_same_tokens(out, reference)
    # Pulled: the whole prompt came from P. Pooled: the full blocks came from the store.
    want = [len(q) for q in pulled] + [_pool_hit(q) for q in pooled]
    assert out.num_cached_tokens == want, (out.num_cached_tokens, want, out.log_warnings)


def test_corrupt_pool_value_is_a_miss_and_the_pull_still_works(fleet):
    """vLLM's default kv_load_failure_policy ("fail") on the outer config: a store value failing
    its checksum must still only cost a recompute, not fail the request."""
    from kv_common.testing import assert_same_tokens

    p, d, spill = fleet["p"], fleet["d"], fleet["spill"]
    pulled, pooled = _prompts(1, seed=31), _prompts(2, seed=32)
    before = _spill_files(spill)
    reference = p.generate(pulled + pooled)
    saved = _wait_saved(spill, before, _full_blocks(pulled + pooled))
    assert len(saved) == _full_blocks(pulled + pooled), (len(saved), reference.log_warnings)
    for f in saved:
        _corrupt_payload_keep_file_crc(f)
    params = _prefill(p, pulled)
    out = d.generate(pulled + pooled, _forward(params) + [None] * len(pooled), timeout_s=PULL_TIMEOUT_S + 60)
    assert [len(t) for t in out.token_ids] == [MAX_TOKENS] * len(out.token_ids), (
        "a request failed", out.token_ids, out.log_warnings)
    assert_same_tokens(out, reference)
    # (vLLM keeps num_cached_tokens as first scheduled: the pooled ones still show the failed hit.)
    assert out.num_cached_tokens[0] == len(pulled[0]), (out.num_cached_tokens, out.log_warnings)
    assert any("checksum mismatch" in w for w in out.log_warnings), out.log_warnings
    assert any("Recovered from KV load failure" in w for w in out.log_warnings), out.log_warnings
