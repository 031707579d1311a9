"""``vllm_compat.kv_byte_settings``: the settings that change KV bytes, normalised once for
kv-mooncake's handshake and kv-store's namespace."""

from __future__ import annotations

import pytest
from kv_common.kv_byte_settings import KVByteSettings, cache_dtype_name, dtype_name
from kv_common.testing.fake_vllm_config import FakeDtype, fake_vllm_config
from kv_common.vllm_compat import kv_byte_settings


def test_settings_of_a_config():
    assert kv_byte_settings(fake_vllm_config()) == KVByteSettings(
        model="org/m", model_weights="unverified", model_dtype="bfloat16", cache_dtype="bfloat16", block_size=16,
        cp_kv_cache_interleave_size=16)
    s = kv_byte_settings(fake_vllm_config(revision="abc", quantization="fp8", cache_dtype="fp8_e5m2", tp=2, dcp=2,
                                          interleave=1, pp=2, use_mla=True))
    assert (s.revision, s.quantization, s.cache_dtype, s.model_dtype) == ("abc", "fp8", "fp8_e5m2", "bfloat16")
    assert (s.tp_size, s.dcp_size, s.pipeline_parallel_size, s.cp_kv_cache_interleave_size, s.use_mla) == \
        (2, 2, 2, 1, True)


@pytest.mark.parametrize("dtype", [FakeDtype("float16"), "float16", "torch.float16"])
def test_auto_is_the_model_dtype_by_name(dtype):
    auto = kv_byte_settings(fake_vllm_config(dtype=dtype))
    explicit = kv_byte_settings(fake_vllm_config(dtype=dtype, cache_dtype="float16"))
    assert auto.cache_dtype == explicit.cache_dtype == auto.model_dtype == "float16"


def test_names():
    assert dtype_name(None) == "" and dtype_name(FakeDtype("bfloat16")) == "bfloat16"
    assert cache_dtype_name(None, "float32") == cache_dtype_name("auto", "float32") == "float32"
    assert cache_dtype_name("fp8_e4m3", "float32") == "fp8_e4m3"  # both fp8 kinds are uint8 tensors: by name


def test_one_dcp_rank_interleaves_whole_blocks():
    assert kv_byte_settings(fake_vllm_config(interleave=1)).cp_kv_cache_interleave_size == 16
    assert kv_byte_settings(fake_vllm_config(interleave=1, dcp=2)).cp_kv_cache_interleave_size == 1
