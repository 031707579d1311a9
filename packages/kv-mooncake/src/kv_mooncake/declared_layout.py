"""vllm-ascend's ``prefill`` / ``decode`` sizes checked against the layouts that really run.

Pure functions: they return what contradicts (empty / None when nothing does), the caller refuses.
A size that is not declared is not checked.
"""

from __future__ import annotations

from kv_mooncake.config import MooncakeConfig, ParallelSizes


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
    config: MooncakeConfig, *, is_producer: bool, is_consumer: bool, tp_size: int, pp_size: int
) -> list[str]:
    """Declared sizes of this instance's own side(s) that differ from its actual layout."""
    out = []
    # The pull plan maps TP/PCP/DCP ranks only: a pipeline-parallel prefill's stages hold different
    # layers, so pulling from one is refused here rather than at every request's handshake.
    declared_pp = config.prefill.pp_size if config.prefill is not None else None
    if declared_pp is not None and declared_pp > 1:
        out.append(f"prefill.pp_size is {declared_pp} but MooncakeConnectorV1 moves KV only between "
                   "instances with pipeline_parallel_size 1")
    if is_producer:
        out += _own_side("prefill", config.prefill, tp_size, pp_size)
    if is_consumer:
        out += _own_side("decode", config.decode, tp_size, pp_size)
    return out


def peer_layout_contradiction(config: MooncakeConfig, *, remote_tp_size: int) -> str | None:
    """On the decode: the declared prefill tp_size against the one a prefill reports."""
    declared = config.prefill.tp_size if config.prefill is not None else None
    if declared is None or declared == remote_tp_size:
        return None
    return f"prefill.tp_size is {declared} but the prefill instance reports tensor_parallel_size {remote_tp_size}"
