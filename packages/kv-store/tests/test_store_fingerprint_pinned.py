"""The store's fingerprint and namespace, pinned: stored blocks and manifests are found by them, so
a refactor that changes a value would orphan every store written before it."""

from __future__ import annotations

import pytest
from kv_common.testing.fake_vllm_config import PINNED_CONFIGS, fake_vllm_config
from kv_store import keys

# model_weights: none of these paths is on disk or in the hub cache (kv_common.model_identity)
_BASE = {"hash_algo": "sha256", "pp_layer_partition": "", "model_weights": "unverified"}
PINNED = {
    "auto_over_bf16": ({**_BASE, "model": "org/m", "dtype": "torch.bfloat16", "block_size": 16,
                        "cache_dtype": "bfloat16", "tp_size": 1, "pcp_size": 1, "dcp_size": 1, "use_mla": False,
                        "revision": "", "quantization": "", "pp_size": 1, "total_kv_heads": 4, "head_size": 32,
                        "num_layers": 4}, "81c197d8445aa6448460"),
    "fp8_tp2_dcp2": ({**_BASE, "model": "/models/Qwen3-8B", "dtype": "torch.float16", "block_size": 16,
                      "cache_dtype": "fp8_e4m3", "tp_size": 2, "pcp_size": 1, "dcp_size": 2, "use_mla": False,
                      "cp_kv_cache_interleave_size": 16,
                      "revision": "abc", "quantization": "fp8", "pp_size": 1, "total_kv_heads": 4, "head_size": 32,
                      "num_layers": 4}, "7c33df967d8f7e067e4f"),
    "mla_pcp2_pp2": ({**_BASE, "model": "org/m", "dtype": "torch.float32", "block_size": 128,
                      "cache_dtype": "bfloat16", "tp_size": 1, "pcp_size": 2, "dcp_size": 1, "use_mla": True,
                      "revision": "", "quantization": "", "pp_size": 2, "total_kv_heads": 1, "head_size": 576,
                      "num_layers": 8}, "a8cc1ed47aa57ee395c5"),
}


@pytest.mark.parametrize("name", sorted(PINNED_CONFIGS))
def test_store_fingerprint_and_namespace_are_pinned(name, monkeypatch):
    pytest.importorskip("vllm")
    from kv_store.connector_base import store_fingerprint

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    fp = store_fingerprint(fake_vllm_config(**PINNED_CONFIGS[name]))
    expected, namespace = PINNED[name]
    assert fp == expected
    assert keys.namespace(fp) == namespace
