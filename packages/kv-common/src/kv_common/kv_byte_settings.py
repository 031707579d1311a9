"""The settings of a vLLM instance that change the bytes of its KV blocks, each normalised once.

Read from vLLM's config by ``kv_common.vllm_compat.kv_byte_settings``; kv-mooncake compares them at
its handshake, kv-store derives its namespace from them. Normalised so that two spellings of one
setting agree: a dtype is named without ``torch.``, cache dtype ``auto`` is the model dtype.
"""

from __future__ import annotations

from typing import Any

import msgspec


class KVByteSettings(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    revision: str = ""
    # Which weights the model path holds (``kv_common.model_identity``): a model re-written in place
    # keeps its path, revision and shapes, but its KV bytes are another model's.
    model_weights: str = ""
    quantization: str = ""
    model_dtype: str = ""  # "bfloat16", not "torch.bfloat16"
    # "auto" stores KV in the model's dtype; fp8 variants keep their own name (fp8_e4m3 and
    # fp8_e5m2 tensors are both uint8, so the tensor dtype alone cannot tell them apart).
    cache_dtype: str = ""
    block_size: int = 0  # logical (scheduler) tokens per block
    pipeline_parallel_size: int = 1
    # With one DCP rank every interleave size lays tokens out alike (whole blocks on one rank), so
    # it is the block size there: a DCP 1 instance matches a DCP 2 one that interleaves whole blocks.
    cp_kv_cache_interleave_size: int = 0
    tp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    use_mla: bool = False


def text(value: Any) -> str:
    """A setting vLLM may leave None, as text ("" for None)."""
    return "" if value is None else str(value)


def dtype_name(value: Any) -> str:
    """``torch.bfloat16`` (or the string ``bfloat16``) -> ``bfloat16``; None -> ""."""
    return text(value).removeprefix("torch.")


def cache_dtype_name(cache_dtype: Any, model_dtype: str) -> str:
    """vLLM's ``cache_dtype`` by the dtype it stores: ``auto`` (or unset) is the model dtype."""
    name = dtype_name(cache_dtype) or "auto"
    return model_dtype if name == "auto" else name


def effective_interleave(interleave: int, *, dcp_size: int, block_size: int) -> int:
    return interleave if dcp_size > 1 else block_size
