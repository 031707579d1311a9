"""What an instance's vLLM config says about its KV bytes, and the parallel settings we refuse.

Read with ``getattr`` only (no vLLM import, ``kv_common.vllm_compat``), so it is testable with a plain namespace. The handshake
compares the fingerprint field by field; ``unsupported_settings`` runs at start-up so that a layout
the pull plan cannot read right stops the engine with the setting to change, instead of loading the
wrong KV later.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec
from kv_common.kv_cache_groups import KVGroup
from kv_common.vllm_compat import kv_byte_settings

from kv_mooncake.pull_plan import plans_per_group


def config_fingerprint(vllm_config: Any) -> dict[str, Any]:
    """The settings that change KV bytes (``kv_common.kv_byte_settings``), by the names the
    handshake's ``Compatibility`` gives them, with the parallel sizes ``unsupported_settings`` reads.
    ``model_weights`` names the checkpoint the model path holds: a prefill and a decode serving the
    same path with different weights refuse each other's pulls."""
    return msgspec.structs.asdict(kv_byte_settings(vllm_config))


def group_layouts(groups: Sequence[KVGroup]) -> tuple[str, ...]:
    """Each KV-cache group's layout (kind, block size, window, layers) for the handshake: a prefill and
    a decode pair only when every group matches, since each layer is read through its own group's
    block ids. Empty for one full-attention group, as peers without hybrid support send."""
    if not plans_per_group(groups):
        return ()
    return tuple(json.dumps(group.describe(), sort_keys=True, separators=(",", ":")) for group in groups)


def unsupported_settings(fp: dict[str, Any], *, is_consumer: bool) -> list[str]:
    """Why this instance's parallel layout cannot be served (empty: supported)."""
    problems = []
    pp = fp["pipeline_parallel_size"]
    if pp > 1 and is_consumer:
        # A prefill's stages each serve their own layers (pipeline_stages); a decode's stages would
        # each need their own part of every pull. vllm-ascend requires decode PP 1 as well.
        problems.append(f"pipeline_parallel_size={pp} on a kv_consumer: MooncakeConnectorV1 pulls into a "
                        "decode with pipeline_parallel_size=1 only (a pipeline-parallel prefill is supported: "
                        "run it with kv_role kv_producer)")
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
