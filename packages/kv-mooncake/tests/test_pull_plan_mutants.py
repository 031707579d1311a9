"""The pull plan spelled out on small layouts: exact sources, spans, block positions and reader
counts, and every refusal at its boundary. Written against the survivors of the mutation run
(docs/mutation-report.md); the property tests (test_pull_plan.py) check the plan as a whole."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
from kv_mooncake.errors import PlanError
from kv_mooncake.pull.plan import (
    HeadSpan,
    RankPull,
    expected_done_count,
    heads_of_rank,
    plan_pulls,
    readers_per_prefill_rank,
    request_seed,
)
from kv_mooncake.rank_layout import DecodeLayout, DecodeRank, PrefillLayout, PrefillRank


def test_ranks_and_their_side_channel_offsets():
    assert PrefillRank(3) == PrefillRank(3, 0)
    layout = PrefillLayout(tp_size=4, total_kv_heads=4, pcp_size=3)
    assert PrefillRank(1, 2).index(layout) == 9
    assert PrefillRank(3, 0).index(layout) == 3
    assert DecodeRank(3).index(DecodeLayout(tp_size=4)) == 3
    assert layout.world_size == 12
    assert layout.ranks() == [PrefillRank(t, p) for p in range(3) for t in range(4)]
    assert DecodeLayout(tp_size=3).world_size == 3
    assert DecodeLayout(tp_size=3).ranks() == [DecodeRank(0), DecodeRank(1), DecodeRank(2)]


def test_layout_defaults_are_one_of_everything():
    prefill = PrefillLayout(tp_size=2, total_kv_heads=2)
    assert (prefill.pcp_size, prefill.dcp_size, prefill.dp_size, prefill.use_mla) == (1, 1, 1, False)
    assert prefill.cp_size == 1
    decode = DecodeLayout(tp_size=2)
    assert (decode.dcp_size, decode.dp_size) == (1, 1)


def test_dcp_rank_of_a_tp_rank_is_its_remainder():
    assert PrefillLayout(tp_size=8, total_kv_heads=1, dcp_size=4).shard_of(PrefillRank(6)) == 2
    assert PrefillLayout(tp_size=8, total_kv_heads=1, dcp_size=4).cp_size == 4
    assert DecodeLayout(tp_size=8, dcp_size=4).dcp_rank_of(DecodeRank(7)) == 3


@pytest.mark.parametrize(
    "value",
    [
        PrefillLayout(tp_size=2, total_kv_heads=2),
        DecodeLayout(tp_size=2),
        HeadSpan(0, 0, 1),
        RankPull(PrefillRank(0), (HeadSpan(0, 0, 1),), ((0, 0),)),
    ],
)
def test_plan_values_are_immutable_and_hashable(value):
    assert hash(value) == hash(dataclasses.replace(value))
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.tp_size = 3  # type: ignore[misc]


def test_request_seed_is_crc32_of_the_id():
    assert request_seed("req-1") == zlib.crc32(b"req-1")
    assert request_seed("") == 0


@pytest.mark.parametrize(
    ("total", "tp", "rank", "mla", "expected"),
    [
        (8, 4, 3, False, (6, 2)),
        (4, 4, 3, False, (3, 1)),
        (2, 8, 5, False, (1, 1)),  # head 1 is replicated on ranks 4..7
        (1, 4, 3, False, (0, 1)),
        (8, 4, 3, True, (0, 1)),  # MLA: one latent head on every rank
        (3, 2, 1, True, (0, 1)),  # MLA ignores the head count
    ],
)
def test_heads_of_rank(total, tp, rank, mla, expected):
    assert heads_of_rank(total, tp, rank, mla) == expected


def test_heads_of_rank_defaults_to_no_mla():
    assert heads_of_rank(8, 4, 1) == (2, 2)


@pytest.mark.parametrize(("total", "tp"), [(6, 4), (2, 3), (3, 4)])
def test_heads_that_do_not_divide_are_refused(total, tp):
    with pytest.raises(PlanError):
        heads_of_rank(total, tp, 0)
    with pytest.raises(PlanError):
        plan_pulls(PrefillLayout(tp_size=tp, total_kv_heads=total), DecodeLayout(tp_size=1), DecodeRank(0), 1)
    with pytest.raises(PlanError):
        plan_pulls(PrefillLayout(tp_size=1, total_kv_heads=total), DecodeLayout(tp_size=tp), DecodeRank(0), 1)


def _pulls(prefill, decode, rank=0, blocks=2, **kw):
    return plan_pulls(prefill, decode, DecodeRank(rank), blocks, **kw)


def test_a_decode_rank_reading_from_two_prefill_ranks():
    prefill, decode = PrefillLayout(tp_size=2, total_kv_heads=4), DecodeLayout(tp_size=1)
    assert _pulls(prefill, decode) == [
        RankPull(PrefillRank(0), (HeadSpan(0, 0, 2),), ((0, 0), (1, 1))),
        RankPull(PrefillRank(1), (HeadSpan(0, 2, 2),), ((0, 0), (1, 1))),
    ]


def test_a_decode_rank_holding_part_of_a_prefill_rank():
    prefill, decode = PrefillLayout(tp_size=2, total_kv_heads=4), DecodeLayout(tp_size=4)
    assert _pulls(prefill, decode, rank=3, blocks=1) == [RankPull(PrefillRank(1), (HeadSpan(1, 0, 1),), ((0, 0),))]
    assert _pulls(prefill, decode, rank=1, blocks=1) == [RankPull(PrefillRank(0), (HeadSpan(1, 0, 1),), ((0, 0),))]


def test_equal_tp_reads_all_heads_of_one_rank_in_one_span():
    prefill, decode = PrefillLayout(tp_size=2, total_kv_heads=8), DecodeLayout(tp_size=2)
    assert _pulls(prefill, decode, rank=1, blocks=1) == [RankPull(PrefillRank(1), (HeadSpan(0, 0, 4),), ((0, 0),))]


def test_replicated_heads_are_read_from_the_seeded_replica():
    # One KV head on 4 prefill ranks: the source is (seed + decode rank) % 4.
    prefill = PrefillLayout(tp_size=4, total_kv_heads=1)
    assert _pulls(prefill, DecodeLayout(tp_size=1), seed=6)[0].source == PrefillRank(2)
    assert _pulls(prefill, DecodeLayout(tp_size=2), rank=1, seed=6)[0].source == PrefillRank(3)
    assert _pulls(prefill, DecodeLayout(tp_size=1))[0].source == PrefillRank(0)  # seed defaults to 0
    # Two heads, each on two ranks (0-1 and 2-3): decode rank 1 holds head 1.
    prefill = PrefillLayout(tp_size=4, total_kv_heads=2)
    assert _pulls(prefill, DecodeLayout(tp_size=2), rank=1, seed=0)[0].source == PrefillRank(3)
    assert _pulls(prefill, DecodeLayout(tp_size=2), rank=1, seed=1)[0].source == PrefillRank(2)
    assert _pulls(prefill, DecodeLayout(tp_size=1), seed=1) == [
        RankPull(PrefillRank(1), (HeadSpan(0, 0, 1),), ((0, 0), (1, 1))),
        RankPull(PrefillRank(3), (HeadSpan(0, 1, 1),), ((0, 0), (1, 1))),
    ]


def test_replicated_heads_with_dcp_read_each_shard_from_its_dcp_rank():
    # One head on 4 ranks, DCP 2: shard d lives on ranks d and d + 2; the seed picks one of the two.
    prefill = PrefillLayout(tp_size=4, total_kv_heads=1, dcp_size=2)
    pulls = _pulls(prefill, DecodeLayout(tp_size=1), blocks=4, seed=1)
    assert pulls == [
        RankPull(PrefillRank(2), (HeadSpan(0, 0, 1),), ((0, 0), (1, 2))),
        RankPull(PrefillRank(3), (HeadSpan(0, 0, 1),), ((0, 1), (1, 3))),
    ]
    assert [p.source for p in _pulls(prefill, DecodeLayout(tp_size=1), blocks=4, seed=2)] == [
        PrefillRank(0), PrefillRank(1)]


def test_mla_reads_one_copy_chosen_by_the_seed():
    prefill = PrefillLayout(tp_size=4, total_kv_heads=8, dcp_size=2, use_mla=True)
    for rank in range(2):  # every decode rank reads the same prefill rank
        assert [p.source for p in _pulls(prefill, DecodeLayout(tp_size=2), rank=rank, blocks=2, seed=3)] == [
            PrefillRank(2), PrefillRank(3)]
    prefill = PrefillLayout(tp_size=3, total_kv_heads=8, use_mla=True)
    assert _pulls(prefill, DecodeLayout(tp_size=1), seed=5) == [
        RankPull(PrefillRank(2), (HeadSpan(0, 0, 1),), ((0, 0), (1, 1)))]


def test_decode_dcp_reads_its_own_blocks_at_their_local_positions():
    prefill, decode = PrefillLayout(tp_size=2, total_kv_heads=1, dcp_size=2), DecodeLayout(tp_size=2, dcp_size=2)
    assert _pulls(prefill, decode, rank=1, blocks=5) == [
        RankPull(PrefillRank(1), (HeadSpan(0, 0, 1),), ((0, 0), (1, 1)))]
    assert _pulls(prefill, decode, rank=0, blocks=5) == [
        RankPull(PrefillRank(0), (HeadSpan(0, 0, 1),), ((0, 0), (1, 1), (2, 2)))]
    # Prefill DCP 2, decode without DCP: remote position block // 2, local position block.
    decode = DecodeLayout(tp_size=1)
    assert _pulls(prefill, decode, blocks=3) == [
        RankPull(PrefillRank(0), (HeadSpan(0, 0, 1),), ((0, 0), (1, 2))),
        RankPull(PrefillRank(1), (HeadSpan(0, 0, 1),), ((0, 1),)),
    ]


def test_skipped_blocks_are_not_read_and_a_negative_skip_is_none():
    prefill, decode = PrefillLayout(tp_size=1, total_kv_heads=1), DecodeLayout(tp_size=1)
    assert _pulls(prefill, decode, blocks=4, skip_blocks=2)[0].blocks == ((2, 2), (3, 3))
    assert _pulls(prefill, decode, blocks=3)[0].blocks == ((0, 0), (1, 1), (2, 2))
    assert _pulls(prefill, decode, blocks=3, skip_blocks=-3) == _pulls(prefill, decode, blocks=3)
    assert _pulls(prefill, decode, blocks=3, skip_blocks=3) == []


def test_pcp_replicas_are_spread_over_the_decode_ranks():
    prefill = PrefillLayout(tp_size=1, total_kv_heads=1, pcp_size=3)
    decode = DecodeLayout(tp_size=3)
    assert [_pulls(prefill, decode, rank=r, seed=1)[0].source for r in range(3)] == [
        PrefillRank(0, 1), PrefillRank(0, 2), PrefillRank(0, 0)]


@pytest.mark.parametrize("rank", [-1, 2, 3])
def test_a_decode_rank_outside_the_layout_is_refused(rank):
    with pytest.raises(PlanError, match="outside layout"):
        _pulls(PrefillLayout(tp_size=2, total_kv_heads=2), DecodeLayout(tp_size=2), rank=rank)


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        (PrefillLayout(tp_size=0, total_kv_heads=2), DecodeLayout(tp_size=1)),
        (PrefillLayout(tp_size=1, total_kv_heads=2, pcp_size=0), DecodeLayout(tp_size=1)),
        (PrefillLayout(tp_size=1, total_kv_heads=2, dcp_size=0), DecodeLayout(tp_size=1)),
        (PrefillLayout(tp_size=1, total_kv_heads=2), DecodeLayout(tp_size=0)),
        (PrefillLayout(tp_size=1, total_kv_heads=2), DecodeLayout(tp_size=1, dcp_size=0)),
        (PrefillLayout(tp_size=1, total_kv_heads=0), DecodeLayout(tp_size=1)),
        (PrefillLayout(tp_size=1, total_kv_heads=-1), DecodeLayout(tp_size=1)),
        # PCP with DCP
        (PrefillLayout(tp_size=2, total_kv_heads=1, pcp_size=2, dcp_size=2), DecodeLayout(tp_size=1)),
        # TP not a multiple of DCP
        (PrefillLayout(tp_size=3, total_kv_heads=1, dcp_size=2), DecodeLayout(tp_size=1)),
        (PrefillLayout(tp_size=1, total_kv_heads=1), DecodeLayout(tp_size=3, dcp_size=2)),
        # DCP group not inside one head's replicas
        (PrefillLayout(tp_size=2, total_kv_heads=2, dcp_size=2), DecodeLayout(tp_size=1)),
        (PrefillLayout(tp_size=2, total_kv_heads=4, dcp_size=2), DecodeLayout(tp_size=1)),
        (PrefillLayout(tp_size=6, total_kv_heads=2, dcp_size=2), DecodeLayout(tp_size=1)),
        (PrefillLayout(tp_size=1, total_kv_heads=2), DecodeLayout(tp_size=2, dcp_size=2)),
    ],
)
def test_layouts_the_plan_refuses(prefill, decode):
    with pytest.raises(PlanError):
        _pulls(prefill, decode)


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        (PrefillLayout(tp_size=2, total_kv_heads=1), DecodeLayout(tp_size=1)),  # one head is fine
        (PrefillLayout(tp_size=1, total_kv_heads=1, pcp_size=2), DecodeLayout(tp_size=1)),  # PCP alone
        (PrefillLayout(tp_size=2, total_kv_heads=1, dcp_size=2), DecodeLayout(tp_size=1)),  # DCP alone
        (PrefillLayout(tp_size=8, total_kv_heads=2, dcp_size=2), DecodeLayout(tp_size=8, dcp_size=4)),
        (PrefillLayout(tp_size=2, total_kv_heads=0, dcp_size=2, use_mla=True), DecodeLayout(tp_size=2, dcp_size=2)),
    ],
)
def test_layouts_the_plan_accepts(prefill, decode):
    assert _pulls(prefill, decode)


def test_reader_counts_spelled_out():
    prefill, decode = PrefillLayout(tp_size=4, total_kv_heads=1), DecodeLayout(tp_size=1)
    assert readers_per_prefill_rank(prefill, decode, 2) == {
        PrefillRank(0): 1, PrefillRank(1): 0, PrefillRank(2): 0, PrefillRank(3): 0}
    assert readers_per_prefill_rank(prefill, decode, 2, seed=1)[PrefillRank(1)] == 1
    assert readers_per_prefill_rank(prefill, DecodeLayout(tp_size=4), 2)[PrefillRank(0)] == 1
    assert readers_per_prefill_rank(PrefillLayout(tp_size=1, total_kv_heads=2), DecodeLayout(tp_size=2), 1) == {
        PrefillRank(0): 2}
    # Nothing left to read after the skip: nobody reads, every rank may free at once.
    assert readers_per_prefill_rank(prefill, decode, 1, skip_blocks=1) == dict.fromkeys(prefill.ranks(), 0)
    assert readers_per_prefill_rank(prefill, decode, 1)[PrefillRank(0)] == 1  # skip defaults to 0


def test_expected_done_count_defaults():
    prefill, decode = PrefillLayout(tp_size=4, total_kv_heads=1), DecodeLayout(tp_size=1)
    assert expected_done_count(PrefillRank(0), prefill, decode, 1) == 1
    assert expected_done_count(PrefillRank(1), prefill, decode, 1) == 0
    assert expected_done_count(PrefillRank(1), prefill, decode, 1, seed=1) == 1
    assert expected_done_count(PrefillRank(0), prefill, decode, 1, skip_blocks=1) == 0


@pytest.mark.parametrize(("p_tp", "heads", "d_tp"), [(4, 6, 1), (1, 3, 2)])
def test_heads_that_do_not_divide_are_refused_with_nothing_to_pull(p_tp, heads, d_tp):
    # No block to read (all cached, or an empty request): the layout is still refused, not planned as
    # "nobody reads".
    prefill, decode = PrefillLayout(tp_size=p_tp, total_kv_heads=heads), DecodeLayout(tp_size=d_tp)
    with pytest.raises(PlanError):
        _pulls(prefill, decode, blocks=0)
    with pytest.raises(PlanError):
        readers_per_prefill_rank(prefill, decode, 2, skip_blocks=2)


# ---- per KV-cache group, and the rank layout (moved out of the plan, issue 43) ---------------------

def test_plan_group_pulls_tags_each_group_and_orders_by_prefill_rank():
    from kv_mooncake.group_blocks import GroupBlocks
    from kv_mooncake.pull.plan import plan_group_pulls

    prefill, decode = PrefillLayout(tp_size=2, total_kv_heads=2), DecodeLayout(tp_size=1)
    groups = [GroupBlocks(0, 2), GroupBlocks(1, 3)]
    pulls = plan_group_pulls(prefill, decode, DecodeRank(0), groups)
    assert [(p.source.tp_rank, p.group, p.blocks) for p in pulls] == [
        (0, 0, ((0, 0), (1, 1))), (0, 1, ((1, 1), (2, 2))), (1, 0, ((0, 0), (1, 1))), (1, 1, ((1, 1), (2, 2)))]
    assert plan_group_pulls(prefill, decode, DecodeRank(0), groups, seed=0) == pulls  # seed 0 by default
    # Replicas (one head on two prefill ranks): the seed picks the source, the default is seed 0.
    replicas = PrefillLayout(tp_size=2, total_kv_heads=1)
    by_seed = {seed: plan_group_pulls(replicas, decode, DecodeRank(0), groups[:1], seed)[0].source
               for seed in (0, 1)}
    assert by_seed[0] != by_seed[1]
    assert plan_group_pulls(replicas, decode, DecodeRank(0), groups[:1])[0].source == by_seed[0]


def test_group_readers_count_each_decode_rank_once_per_prefill_rank():
    from kv_mooncake.group_blocks import GroupBlocks
    from kv_mooncake.pull.plan import group_readers_per_prefill_rank, plan_group_pulls

    prefill, decode = PrefillLayout(tp_size=2, total_kv_heads=2), DecodeLayout(tp_size=1)
    groups = [GroupBlocks(0, 2), GroupBlocks(1, 2)]
    both = {PrefillRank(0): 1, PrefillRank(1): 1}
    assert group_readers_per_prefill_rank(prefill, decode, groups) == both  # two groups, one reader each
    own = plan_group_pulls(prefill, decode, DecodeRank(0), groups)
    assert group_readers_per_prefill_rank(prefill, decode, groups, planned={DecodeRank(0): own}) == both
    first_only = [p for p in own if p.source == PrefillRank(0)]
    assert group_readers_per_prefill_rank(prefill, decode, groups, planned={DecodeRank(0): first_only}) == {
        PrefillRank(0): 1, PrefillRank(1): 0}  # a decode rank's own plan is taken as given
    one_prefill = PrefillLayout(tp_size=1, total_kv_heads=2)
    assert group_readers_per_prefill_rank(one_prefill, DecodeLayout(tp_size=2), groups) == {PrefillRank(0): 2}
    assert group_readers_per_prefill_rank(prefill, decode, [GroupBlocks(2, 2)]) == dict.fromkeys(both, 0)
    replicas = PrefillLayout(tp_size=2, total_kv_heads=1)  # the seed picks the replica; 0 by default
    by_seed = [group_readers_per_prefill_rank(replicas, decode, groups, seed) for seed in (0, 1, -1)]
    assert group_readers_per_prefill_rank(replicas, decode, groups) == by_seed[0] != by_seed[1] == by_seed[2]


def test_rank_index_and_world_size_count_every_stage():
    layout = PrefillLayout(tp_size=2, total_kv_heads=2, pcp_size=2, pp_size=2)
    assert PrefillRank(1, 1, 1).index(layout) == 7  # (pp * pcp + pcp_rank) * tp + tp_rank
    assert PrefillRank(0, 0, 1).index(layout) == 4
    assert layout.world_size == 8 and PrefillLayout(tp_size=2, total_kv_heads=2, pp_size=2).world_size == 4
