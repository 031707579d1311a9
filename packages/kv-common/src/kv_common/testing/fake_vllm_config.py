"""A ``VllmConfig``-shaped namespace with the fields the fingerprints read (vLLM's real one needs a
model on disk). Shared by the fingerprint tests of kv-common, kv-mooncake and kv-store."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class FakeDtype:
    """Prints like a ``torch.dtype`` (``torch.bfloat16``) without importing torch."""

    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


def fake_vllm_config(
    *, model: str = "org/m", dtype: Any = FakeDtype("bfloat16"), revision: str | None = None,
    quantization: str | None = None, use_mla: bool = False, block_size: int = 16, cache_dtype: Any = "auto",
    tp: int = 1, pcp: int = 1, dcp: int = 1, pp: int = 1, interleave: int = 1,
    total_kv_heads: int = 4, head_size: int = 32, num_layers: int = 4, hash_algo: str = "sha256",
) -> SimpleNamespace:
    model_config = SimpleNamespace(
        model=model, dtype=dtype, revision=revision, quantization=quantization, use_mla=use_mla,
        get_total_num_kv_heads=lambda: total_kv_heads, get_head_size=lambda: head_size,
        get_total_num_hidden_layers=lambda: num_layers,
    )
    cache_config = SimpleNamespace(block_size=block_size, cache_dtype=cache_dtype, prefix_caching_hash_algo=hash_algo)
    parallel_config = SimpleNamespace(
        tensor_parallel_size=tp, prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp,
        pipeline_parallel_size=pp, cp_kv_cache_interleave_size=interleave, rank=0,
    )
    return SimpleNamespace(model_config=model_config, cache_config=cache_config, parallel_config=parallel_config)


# Configs whose fingerprints are pinned (stored namespaces and manifests depend on their values).
PINNED_CONFIGS: dict[str, dict[str, Any]] = {
    "auto_over_bf16": {},
    "fp8_tp2_dcp2": dict(model="/models/Qwen3-8B", dtype=FakeDtype("float16"), cache_dtype="fp8_e4m3",
                         revision="abc", quantization="fp8", tp=2, dcp=2, interleave=16),
    "mla_pcp2_pp2": dict(dtype=FakeDtype("float32"), cache_dtype="bfloat16", use_mla=True, pp=2, pcp=2,
                         block_size=128, total_kv_heads=1, head_size=576, num_layers=8),
}
