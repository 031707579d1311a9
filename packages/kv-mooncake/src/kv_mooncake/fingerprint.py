"""What an instance's vLLM config says about its KV bytes, and the parallel settings we refuse.

Read with ``getattr`` only (no vLLM import), so it is testable with a plain namespace. The handshake
compares the fingerprint field by field; ``unsupported_settings`` runs at start-up so that a layout
the pull plan cannot read right stops the engine with the setting to change, instead of loading the
wrong KV later.
"""

from __future__ import annotations

from typing import Any


def _name(value: Any) -> str:
    return "" if value is None else str(value).removeprefix("torch.")


def config_fingerprint(vllm_config: Any) -> dict[str, Any]:
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    par = vllm_config.parallel_config
    model_dtype = _name(getattr(model, "dtype", ""))
    block_size = int(getattr(cache, "block_size", 0) or 0)
    dcp = int(getattr(par, "decode_context_parallel_size", 1) or 1)
    interleave = int(getattr(par, "cp_kv_cache_interleave_size", 1) or 1)
    cache_dtype = _name(getattr(cache, "cache_dtype", "auto")) or "auto"
    return {
        "model": _name(getattr(model, "model", "")),
        "revision": _name(getattr(model, "revision", None)),
        "quantization": _name(getattr(model, "quantization", None)),
        "model_dtype": model_dtype,
        # "auto" stores KV in the model's dtype; fp8 variants keep their own name (fp8_e4m3 and
        # fp8_e5m2 tensors are both uint8, so the tensor dtype alone cannot tell them apart).
        "cache_dtype": model_dtype if cache_dtype == "auto" else cache_dtype,
        "block_size": block_size,
        "pipeline_parallel_size": int(getattr(par, "pipeline_parallel_size", 1) or 1),
        # With one DCP rank every interleave size lays tokens out alike (whole blocks on one rank).
        "cp_kv_cache_interleave_size": interleave if dcp > 1 else block_size,
        "tp_size": int(getattr(par, "tensor_parallel_size", 1) or 1),
        "pcp_size": int(getattr(par, "prefill_context_parallel_size", 1) or 1),
        "dcp_size": dcp,
        "use_mla": bool(getattr(model, "use_mla", False)),
    }


def unsupported_settings(fp: dict[str, Any], *, is_consumer: bool) -> list[str]:
    """Why this instance's parallel layout cannot be served (empty: supported)."""
    problems = []
    pp = fp["pipeline_parallel_size"]
    if pp > 1:
        # Each stage holds a range of layers; side-channel ports and the plan address TP x PCP ranks
        # of one stage only, so ranks of different stages would collide.
        problems.append(f"pipeline_parallel_size={pp}: MooncakeConnectorV1 supports 1 (pipeline stages "
                        "are not addressed by its side channel or pull plan)")
    dcp, pcp, block, interleave = fp["dcp_size"], fp["pcp_size"], fp["block_size"], fp["cp_kv_cache_interleave_size"]
    if dcp > 1 and interleave != block:
        # vLLM's default (1) spreads single tokens over the DCP ranks; the plan moves whole blocks.
        problems.append(f"cp_kv_cache_interleave_size={interleave} with decode_context_parallel_size={dcp}: "
                        f"MooncakeConnectorV1 moves whole blocks; set cp_kv_cache_interleave_size={block} "
                        "(the block size)")
    if pcp > 1 and dcp > 1:
        problems.append(f"prefill_context_parallel_size={pcp} with decode_context_parallel_size={dcp}: "
                        "MooncakeConnectorV1 supports PCP only without DCP (vLLM then keeps a full KV "
                        "replica on every PCP rank)")
    if pcp > 1 and is_consumer:
        problems.append(f"prefill_context_parallel_size={pcp} on a kv_consumer: each decode PCP rank would "
                        "need its own copy; run the decode with prefill_context_parallel_size=1")
    return problems
