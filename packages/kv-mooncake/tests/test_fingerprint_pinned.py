"""kv-mooncake's config fingerprint, pinned: it travels in the handshake, so a refactor that spells a
value differently would make this release refuse a peer of the previous one for no reason."""

from __future__ import annotations

import msgspec
import pytest
from kv_common.testing.fake_vllm_config import PINNED_CONFIGS, fake_vllm_config
from kv_mooncake.identity import config_fingerprint

# model_weights: none of these paths is on disk or in the hub cache (kv_common.model_identity)
_ONE_RANK = {"tp_size": 1, "pcp_size": 1, "dcp_size": 1, "pipeline_parallel_size": 1, "use_mla": False,
             "model_weights": "unverified"}
PINNED = {
    "auto_over_bf16": {**_ONE_RANK, "model": "org/m", "revision": "", "quantization": "", "model_dtype": "bfloat16",
                       "cache_dtype": "bfloat16", "block_size": 16, "cp_kv_cache_interleave_size": 16},
    "fp8_tp2_dcp2": {**_ONE_RANK, "model": "/models/Qwen3-8B", "revision": "abc", "quantization": "fp8",
                     "model_dtype": "float16", "cache_dtype": "fp8_e4m3", "block_size": 16,
                     "cp_kv_cache_interleave_size": 16, "tp_size": 2, "dcp_size": 2},
    "mla_pcp2_pp2": {**_ONE_RANK, "model": "org/m", "revision": "", "quantization": "", "model_dtype": "float32",
                     "cache_dtype": "bfloat16", "block_size": 128, "pipeline_parallel_size": 2,
                     "cp_kv_cache_interleave_size": 128, "pcp_size": 2, "use_mla": True},
}


@pytest.mark.parametrize("name", sorted(PINNED_CONFIGS))
def test_config_fingerprint_is_pinned(name):
    assert msgspec.structs.asdict(config_fingerprint(fake_vllm_config(**PINNED_CONFIGS[name]))) == PINNED[name]
