"""vllm-ascend's ``prefill`` / ``decode`` sizes checked against the layouts that really run.

Pure functions: they return what contradicts (empty / None when nothing does), the caller refuses.
A size that is not declared is not checked.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_mooncake.config import MooncakeConfig, ParallelSizes
from kv_mooncake.pipeline_stages import parse_partition


def _own_side(side: str, declared: ParallelSizes | None, tp_size: int, pp_size: int) -> list[str]:
    if declared is None:
        return []
    out = []
    if declared.tp_size is not None and declared.tp_size != tp_size:
        out.append(f"{side}.tp_size is {declared.tp_size} but this {side} instance runs tensor_parallel_size {tp_size}")
    if declared.pp_size is not None and declared.pp_size != pp_size:
        out.append(f"{side}.pp_size is {declared.pp_size} but this {side} instance runs pipeline_parallel_size {pp_size}")
    return out


def start_up_contradictions(
    config: MooncakeConfig, *, is_producer: bool, is_consumer: bool, tp_size: int, pp_size: int,
    layer_partition: Sequence[int] | None = None,
) -> list[str]:
    """Declared sizes of this instance's own side(s) that differ from its actual layout
    (``layer_partition``: the layers per pipeline stage a producer runs, when it runs PP > 1)."""
    out = []
    if is_producer:
        out += _own_side("prefill", config.prefill, tp_size, pp_size)
        declared = config.prefill.pp_layer_partition if config.prefill is not None else None
        if declared is not None and layer_partition is not None and parse_partition(declared) != tuple(layer_partition):
            out.append(f"prefill.pp_layer_partition is {declared!r} but this prefill instance places its layers "
                       f"{','.join(map(str, layer_partition))} (VLLM_PP_LAYER_PARTITION, else vLLM's even split)")
    if is_consumer:
        out += _own_side("decode", config.decode, tp_size, pp_size)
    return out


def peer_layout_contradiction(config: MooncakeConfig, *, remote_tp_size: int, remote_pp_size: int = 1) -> str | None:
    """On the decode: the declared prefill tp_size / pp_size against the ones a prefill reports."""
    declared = config.prefill
    if declared is not None and declared.tp_size is not None and declared.tp_size != remote_tp_size:
        return f"prefill.tp_size is {declared.tp_size} but the prefill instance reports tensor_parallel_size {remote_tp_size}"
    if declared is not None and declared.pp_size is not None and declared.pp_size != remote_pp_size:
        return (f"prefill.pp_size is {declared.pp_size} but the prefill instance reports pipeline_parallel_size "
                f"{remote_pp_size}")
    return None
