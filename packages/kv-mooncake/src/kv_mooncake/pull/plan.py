"""Which bytes a decode rank pulls from which prefill rank: pure arithmetic, no torch, no sockets.

Model of the KV cache (per layer, per rank): ``[num_blocks, heads_on_rank, block_size, 2*head_size]``
so a run of heads inside one block is one contiguous byte range.

* Ranks: an instance has ``tp * pcp`` ranks. Decode context parallelism (DCP) adds no ranks: as in
  vLLM, it reuses the TP ranks, and TP rank ``t`` is DCP rank ``t % dcp`` (DCP groups are runs of
  consecutive TP ranks: ``parallel_state`` reshapes the TP ranks into groups of ``dcp``).
* Heads: with ``H`` KV heads in total and TP size ``T``, rank ``r`` holds heads
  ``[r*H/T, (r+1)*H/T)`` when ``H >= T``; when ``H < T`` (GQA with more ranks than heads) it holds the
  single head ``r // (T/H)``, replicated on ``T/H`` consecutive ranks. DCP shards tokens over those
  replicas, so a DCP group must sit inside one head's replicas (vLLM requires ``T > H`` for GQA
  DCP). MLA keeps one latent "head" on every rank.
* Tokens: DCP shards whole blocks round-robin (vLLM's block-level interleave,
  ``cp_kv_cache_interleave_size == block_size``; start-up refuses any other interleave with DCP,
  ``identity.unsupported_settings``). Logical block ``b`` (``block_size`` tokens) of a request
  is on DCP rank ``b % Dcp`` at position ``b // Dcp`` of the request's block list (vLLM's
  scheduler block is ``block_size * dcp`` tokens, its table shared by the DCP ranks), on both sides.
* PCP (vLLM 0.32, without DCP): every PCP rank keeps a full replica of the KV (the slot mapping
  spreads tokens over the DCP group only); the source PCP rank is picked like a replica below.
  PCP together with DCP is refused.
* Stages: a pipeline-parallel prefill has ``tp * pcp`` ranks per stage, each stage laid out like
  the others over its own layers; every pull of the plan goes to each stage
  (``kv_mooncake.pipeline_stages``: which layers, which ports).
* Replicas: when several prefill ranks hold the same head and shard (GQA replicas, or MLA), the
  source is chosen from a seed both instances derive from the request id, so the prefill and every
  decode rank agree without talking, and the load spreads over the replicas.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kv_mooncake.errors import PlanError
from kv_mooncake.group_blocks import GroupBlocks
from kv_mooncake.pipeline_stages import for_each_stage
from kv_mooncake.rank_layout import DecodeLayout, DecodeRank, PrefillLayout, PrefillRank


@dataclass(frozen=True)
class HeadSpan:
    """``num_heads`` consecutive heads: local head index on the source rank and on the destination."""

    src_head: int
    dst_head: int
    num_heads: int


@dataclass(frozen=True)
class RankPull:
    """Everything one decode rank reads from one prefill rank (identical for every layer)."""

    source: PrefillRank
    spans: tuple[HeadSpan, ...]
    blocks: tuple[tuple[int, int], ...]  # (position in remote block list, position in local block list)
    group: int = 0  # the KV-cache group whose block lists the positions index (and whose layers move)


def request_seed(request_id: str) -> int:
    """Stable across processes and Python runs (unlike ``hash``)."""
    return zlib.crc32(request_id.encode())


def heads_of_rank(total_heads: int, tp_size: int, tp_rank: int, use_mla: bool = False) -> tuple[int, int]:
    """(first global head, number of heads) held by ``tp_rank``."""
    if use_mla:
        return 0, 1
    _check_heads_divide(total_heads, tp_size)
    if total_heads >= tp_size:
        per = total_heads // tp_size
        return tp_rank * per, per
    return tp_rank // (tp_size // total_heads), 1


def _check_heads_divide(total_heads: int, tp_size: int) -> None:
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise PlanError(f"{total_heads} KV heads do not divide over TP {tp_size}")
    elif tp_size % total_heads:
        raise PlanError(f"TP {tp_size} is not a multiple of {total_heads} KV heads")


def _source_tp_rank(prefill: PrefillLayout, head: int, dcp_rank: int, decode_tp_rank: int, seed: int) -> int:
    """The prefill TP rank that serves ``head`` for the token shard of DCP rank ``dcp_rank``."""
    dcp = prefill.dcp_size
    if prefill.use_mla:
        # One copy, the same rank for every decode rank: candidates are the ranks of that DCP rank.
        return (seed % (prefill.tp_size // dcp)) * dcp + dcp_rank
    heads, tp = prefill.total_kv_heads, prefill.tp_size
    if heads >= tp:
        return head // (heads // tp)  # dcp is 1 here (validated)
    choices = (tp // heads) // dcp  # replicas of the head that hold this shard
    return head * (tp // heads) + dcp_rank + ((seed + decode_tp_rank) % choices) * dcp


def _head_spans(
    prefill: PrefillLayout, decode: DecodeLayout, tp_rank: int, dcp_rank: int, seed: int
) -> dict[int, list[HeadSpan]]:
    """Source TP rank -> spans of heads this decode TP rank reads from it, for one prefill DCP rank."""
    first, count = heads_of_rank(prefill.total_kv_heads, decode.tp_size, tp_rank, prefill.use_mla)
    spans: dict[int, list[HeadSpan]] = {}
    for local in range(count):
        head = first + local
        src_tp = _source_tp_rank(prefill, head, dcp_rank, tp_rank, seed)
        src_first, _ = heads_of_rank(prefill.total_kv_heads, prefill.tp_size, src_tp, prefill.use_mla)
        src_local = head - src_first
        rank_spans = spans.setdefault(src_tp, [])
        last = rank_spans[-1] if rank_spans else None
        if last and last.src_head + last.num_heads == src_local and last.dst_head + last.num_heads == local:
            rank_spans[-1] = HeadSpan(last.src_head, last.dst_head, last.num_heads + 1)
        else:
            rank_spans.append(HeadSpan(src_local, local, 1))
    return spans


def _validate_dcp(side: str, tp: int, dcp: int, heads: int, use_mla: bool) -> None:
    if tp % dcp:
        raise PlanError(f"{side}: TP {tp} is not a multiple of DCP {dcp} (DCP reuses the TP ranks)")
    if dcp > 1 and not use_mla and (heads >= tp or (tp // heads) % dcp):
        raise PlanError(
            f"{side}: DCP {dcp} needs each DCP group inside one KV head's replicas "
            f"(TP {tp} / {heads} KV heads = {tp / heads:g} replicas, not a multiple of {dcp})"
        )


def validate(prefill: PrefillLayout, decode: DecodeLayout) -> None:
    for name, value in (("prefill tp", prefill.tp_size), ("prefill pcp", prefill.pcp_size),
                        ("prefill pp", prefill.pp_size),
                        ("prefill dcp", prefill.dcp_size), ("decode tp", decode.tp_size),
                        ("decode dcp", decode.dcp_size)):
        if value < 1:
            raise PlanError(f"{name} size must be >= 1, got {value}")
    if not prefill.use_mla:
        if prefill.total_kv_heads < 1:
            raise PlanError("total_kv_heads must be >= 1")
        _check_heads_divide(prefill.total_kv_heads, prefill.tp_size)
        _check_heads_divide(prefill.total_kv_heads, decode.tp_size)
    if prefill.pcp_size > 1 and prefill.dcp_size > 1:
        raise PlanError(f"prefill: PCP {prefill.pcp_size} with DCP {prefill.dcp_size} (vLLM then shards "
                        "tokens over PCP and TP ranks together; only PCP without DCP is supported)")
    heads = prefill.total_kv_heads
    _validate_dcp("prefill", prefill.tp_size, prefill.dcp_size, heads, prefill.use_mla)
    _validate_dcp("decode", decode.tp_size, decode.dcp_size, heads, prefill.use_mla)


def plan_pulls(
    prefill: PrefillLayout,
    decode: DecodeLayout,
    rank: DecodeRank,
    num_blocks: int,
    skip_blocks: int = 0,
    seed: int = 0,
) -> list[RankPull]:
    """What decode ``rank`` reads for a request of ``num_blocks`` logical blocks, of which the first
    ``skip_blocks`` are already computed locally (prefix-cache hit)."""
    validate(prefill, decode)
    if not 0 <= rank.tp_rank < decode.tp_size:
        raise PlanError(f"decode rank {rank} outside layout {decode}")
    cp, my_dcp = prefill.cp_size, decode.dcp_rank_of(rank)
    blocks_by_shard: dict[int, list[tuple[int, int]]] = {}
    for block in range(max(0, skip_blocks), num_blocks):
        if block % decode.dcp_size == my_dcp:
            blocks_by_shard.setdefault(block % cp, []).append((block // cp, block // decode.dcp_size))
    pulls = []
    # PCP replicas: spread the decode ranks over them (the same choice on every instance).
    pcp_rank = (seed + rank.tp_rank) % prefill.pcp_size
    for shard in sorted(blocks_by_shard):
        dcp_rank = shard
        spans = _head_spans(prefill, decode, rank.tp_rank, dcp_rank, seed)
        for src_tp in sorted(spans):
            pulls.append(RankPull(PrefillRank(src_tp, pcp_rank), tuple(spans[src_tp]),
                                  tuple(blocks_by_shard[shard])))
    return for_each_stage(pulls, prefill.pp_size)  # every stage: the same blocks and heads, its own layers


def plan_group_pulls(
    prefill: PrefillLayout,
    decode: DecodeLayout,
    rank: DecodeRank,
    groups: Sequence[GroupBlocks],
    seed: int = 0,
) -> list[RankPull]:
    """``plan_pulls`` for each KV-cache group's blocks (``groups[g]`` for group ``g``): one
    ``RankPull`` per (prefill rank, group), ordered by prefill rank. The heads and the source ranks
    do not depend on the group; only which positions of the group's block lists move."""
    pulls = [replace(pull, group=g) for g, blocks in enumerate(groups)
             for pull in plan_pulls(prefill, decode, rank, blocks.end, blocks.first, seed)]
    return sorted(pulls, key=lambda pull: (pull.source.pp_rank, pull.source.pcp_rank, pull.source.tp_rank, pull.group))


def group_readers_per_prefill_rank(
    prefill: PrefillLayout, decode: DecodeLayout, groups: Sequence[GroupBlocks], seed: int = 0,
    planned: Mapping[DecodeRank, Sequence[RankPull]] | None = None,
) -> dict[PrefillRank, int]:
    """For every prefill rank: how many decode ranks pull from it, any group (each reads it once).
    ``planned``: decode ranks' ``plan_group_pulls`` already made (a decode rank knows its own)."""
    counts = {r: 0 for r in prefill.ranks()}
    for d in decode.ranks():
        pulls = planned.get(d) if planned is not None else None
        if pulls is None:
            pulls = plan_group_pulls(prefill, decode, d, groups, seed)
        for source in {pull.source for pull in pulls}:
            counts[source] += 1
    return counts


def readers_per_prefill_rank(
    prefill: PrefillLayout, decode: DecodeLayout, num_blocks: int, skip_blocks: int = 0, seed: int = 0
) -> dict[PrefillRank, int]:
    """For every prefill rank: how many decode ranks will pull from it (0 = told to free at once)."""
    counts = {r: 0 for r in prefill.ranks()}
    for d in decode.ranks():
        for pull in plan_pulls(prefill, decode, d, num_blocks, skip_blocks, seed):
            counts[pull.source] += 1
    return counts


def expected_done_count(
    prefill_rank: PrefillRank,
    prefill: PrefillLayout,
    decode: DecodeLayout,
    num_blocks: int,
    skip_blocks: int = 0,
    seed: int = 0,
) -> int:
    """How many PullDone messages ``prefill_rank`` must see before it frees the request's blocks."""
    return readers_per_prefill_rank(prefill, decode, num_blocks, skip_blocks, seed)[prefill_rank]
