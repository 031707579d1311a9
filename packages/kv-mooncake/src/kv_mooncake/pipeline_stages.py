"""Which layers each pipeline stage of a prefill holds, and where each stage listens: pure functions.

vLLM splits the decoder layers of a pipeline-parallel (PP) instance into contiguous ranges, one per
stage (``vllm.distributed.utils.get_pp_indices``): ``VLLM_PP_LAYER_PARTITION`` (e.g. ``"3,1"``) when
set, else ``num_layers // pp`` layers per stage with the remainder added one each to the stages
before the last, from the second-to-last backwards (the last stage also holds the final norm and the
LM head). Each stage's workers register only their own layers' KV caches.

A decode runs with PP 1 and holds every layer. It expects stage ``s`` to hold exactly its own layers
whose index (the one integer in the layer's name, as vLLM's ``extract_layer_index`` reads it) lies in
the partition's range of ``s``; layers past the partition (a draft / MTP layer) belong to the last
stage, where vLLM runs the drafter. The partition comes from the decode's
``kv_connector_extra_config.prefill.pp_layer_partition`` (vllm-ascend's key: the prefill's
``VLLM_PP_LAYER_PARTITION``), else vLLM's default rule. Every stage's handshake names the layers it
holds: a stage that holds other layers than expected is refused by name, never read by position.

Ranks and ports: vLLM orders an instance's workers (DP, PP, PCP, TP), TP fastest
(``parallel_state``); a prefill worker's side channel listens on the instance's base port plus its
rank inside its DP group, ``pp_rank * tp * pcp + pcp_rank * tp + tp_rank``
(``pull.plan.PrefillRank.index``). The pull plan of one stage is the plan of every stage (each stage
has the same TP / PCP / DCP layout over its own layers), so each stage's ranks get the same readers
and each stage's workers count their own DONEs and report their own ``finished_sending``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, TypeVar

from kv_mooncake.errors import StageError

_T = TypeVar("_T")
_PARTITION = re.compile(r"^\s*\d+\s*(,\s*\d+\s*)*$")


def parse_partition(text: str | Sequence[int]) -> tuple[int, ...]:
    """``"32,29"`` (vLLM's ``VLLM_PP_LAYER_PARTITION``, vllm-ascend's ``pp_layer_partition``) or a
    list of ints: layers per stage, each at least 1."""
    if isinstance(text, str):
        if not _PARTITION.match(text):
            raise StageError(f"layer partition {text!r} is not comma-separated layer counts (e.g. '32,29')")
        parts = tuple(int(p) for p in text.split(","))
    else:
        parts = tuple(int(p) for p in text)
    if not parts or any(p < 1 for p in parts):
        raise StageError(f"layer partition {list(parts)}: every stage needs at least one layer")
    return parts


def stage_partition(num_layers: int, pp_size: int, explicit: str | Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per stage, as vLLM places them (``get_pp_indices``)."""
    if pp_size < 1:
        raise StageError(f"pipeline_parallel_size {pp_size} (must be >= 1)")
    if explicit is not None:
        parts = parse_partition(explicit)
        if len(parts) != pp_size:
            raise StageError(f"layer partition {list(parts)} has {len(parts)} stages, "
                             f"pipeline_parallel_size is {pp_size}")
        if sum(parts) != num_layers:
            raise StageError(f"layer partition {list(parts)} places {sum(parts)} layers, the model has {num_layers}")
        return parts
    if num_layers < pp_size:
        raise StageError(f"{num_layers} layers cannot fill {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    counts = [base] * pp_size
    for stage in range(pp_size - 1 - extra, pp_size - 1):  # one more each, before the last stage
        counts[stage] += 1
    return tuple(counts)


def stage_range(partition: Sequence[int], pp_rank: int) -> tuple[int, int]:
    """[first, end) layer indices of stage ``pp_rank``."""
    if not 0 <= pp_rank < len(partition):
        raise StageError(f"pipeline stage {pp_rank} outside {len(partition)} stages")
    first = sum(partition[:pp_rank])
    return first, first + partition[pp_rank]


def layer_index(layer_name: str) -> int:
    """The layer index in ``layer_name``: its one integer component (``model.layers.7.self_attn.attn``)."""
    ints = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(ints) != 1:
        raise StageError(f"layer {layer_name!r}: no single layer index in its name, so its pipeline stage "
                         "is unknown")
    return ints[0]


def stage_of(index: int, partition: Sequence[int]) -> int:
    """The stage holding layer ``index``; past the partition (draft / MTP layers): the last stage."""
    end = 0
    for stage, count in enumerate(partition):
        end += count
        if index < end:
            return stage
    return len(partition) - 1


def layers_by_stage(layer_names: Sequence[str], partition: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    """``layer_names`` (in their order) grouped by the stage that holds each."""
    stages: list[list[str]] = [[] for _ in partition]
    for name in layer_names:
        stages[stage_of(layer_index(name), partition)].append(name)
    return tuple(tuple(names) for names in stages)


def stage_layer_problem(expected: Sequence[str], reported: Sequence[str], pp_rank: int,
                        partition: Sequence[int]) -> str | None:
    """Why the layers a stage reports at the handshake are not the ones this decode pulls from it
    (None: the same names)."""
    missing = sorted(set(expected) - set(reported), key=_natural)
    extra = sorted(set(reported) - set(expected), key=_natural)
    if not missing and not extra and len(set(reported)) == len(reported):
        return None
    first, end = stage_range(partition, pp_rank)
    what = "; ".join(part for part in (f"it lacks {_few(missing)}" if missing else "",
                                       f"it also holds {_few(extra)}" if extra else "") if part) or \
        "it names a layer twice"
    return (f"pipeline stage {pp_rank} does not hold the layers this decode expects from it (layers "
            f"{first}..{end - 1} of the partition {','.join(map(str, partition))}): {what}. Set "
            "prefill.pp_layer_partition on the decode to the prefill's VLLM_PP_LAYER_PARTITION")


def own_stage_problem(layer_names: Sequence[str], pp_rank: int, partition: Sequence[int]) -> str | None:
    """On a prefill stage: whether the layers it registered lie in its range of ``partition`` (the
    rule every decode derives the stage's layers from); None when they do."""
    wrong = [name for name in layer_names if stage_of(layer_index(name), partition) != pp_rank]
    if not wrong:
        return None
    first, end = stage_range(partition, pp_rank)
    return (f"pipeline stage {pp_rank} holds {_few(wrong)}, outside its layers {first}..{end - 1} of the "
            f"partition {','.join(map(str, partition))}")


def for_each_stage(pulls: Sequence[_T], pp_size: int) -> list[_T]:
    """The same pulls (``pull.plan.RankPull``) addressed to every stage: ``source.pp_rank`` set."""
    return [dataclasses.replace(pull, source=pull.source._replace(pp_rank=stage))  # type: ignore[type-var,attr-defined]
            for stage in range(pp_size) for pull in pulls]


def waive_stage_fields(decode: Any, stage: Any) -> Any:
    """The decode's ``wire.messages.Compatibility`` as a prefill stage compares it: a stage of a PP prefill
    holds fewer layers than a PP 1 decode, so ``num_layers`` and ``pipeline_parallel_size`` are not
    compared there (the decode checks the stage's layers by name instead)."""
    if stage.pipeline_parallel_size > 1 and decode.pipeline_parallel_size == 1:
        import msgspec

        return msgspec.structs.replace(decode, num_layers=stage.num_layers,
                                       pipeline_parallel_size=stage.pipeline_parallel_size)
    return decode


def _natural(name: str) -> tuple[int, str]:
    try:
        return layer_index(name), name
    except StageError:
        return -1, name


def _few(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def decode_stage_layers(layer_names: Sequence[str], num_hidden_layers: int, pp_size: int,
                        declared: str | None) -> tuple[tuple[int, ...], tuple[tuple[str, ...], ...]]:
    """On a PP 1 decode: the prefill's partition (``declared``: ``prefill.pp_layer_partition``, else
    vLLM's rule over ``num_hidden_layers``, else over the distinct layer indices of ``layer_names``)
    and this decode's layers grouped by the stage each is pulled from."""
    layers = num_hidden_layers or len({layer_index(name) for name in layer_names})
    partition = stage_partition(layers, pp_size, declared)
    return partition, layers_by_stage(layer_names, partition)
