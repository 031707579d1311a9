"""Property tests of the pull plan over every layout up to 16 ranks a side."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kv_mooncake.errors import PlanError
from kv_mooncake.pull.plan import (
    expected_done_count,
    heads_of_rank,
    plan_pulls,
    readers_per_prefill_rank,
    request_seed,
)
from kv_mooncake.rank_layout import DecodeLayout, DecodeRank, PrefillLayout

SIZES = st.integers(1, 16)


def _valid(heads: int, tp: int, dcp: int, use_mla: bool) -> bool:
    if tp % dcp:
        return False
    if use_mla:
        return True
    if dcp > 1 and (heads >= tp or (tp // heads) % dcp):
        return False
    return heads % tp == 0 if heads >= tp else tp % heads == 0


@st.composite
def layouts(draw):
    use_mla = draw(st.booleans())
    p_tp, d_tp = draw(SIZES), draw(SIZES)
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32]))
    pcp = draw(st.integers(1, 4))
    p_dcp, d_dcp = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    assume(p_tp * pcp <= 16)
    assume(pcp == 1 or p_dcp == 1)  # PCP with DCP is refused (test_pcp_with_dcp_is_refused)
    assume(_valid(heads, p_tp, p_dcp, use_mla) and _valid(heads, d_tp, d_dcp, use_mla))
    prefill = PrefillLayout(tp_size=p_tp, total_kv_heads=heads, pcp_size=pcp, dcp_size=p_dcp, use_mla=use_mla)
    decode = DecodeLayout(tp_size=d_tp, dcp_size=d_dcp)
    return prefill, decode


@settings(max_examples=500, deadline=None)
@given(layouts(), st.integers(0, 24), st.integers(0, 30), st.integers(0, 2**32 - 1))
def test_every_needed_piece_arrives_exactly_once(layout, num_blocks, skip, seed):
    prefill, decode = layout
    skip = min(skip, num_blocks)
    for rank in decode.ranks():
        first, count = heads_of_rank(prefill.total_kv_heads, decode.tp_size, rank.tp_rank, prefill.use_mla)
        needed = {
            (first + h, b)
            for h in range(count)
            for b in range(skip, num_blocks)
            if b % decode.dcp_size == decode.dcp_rank_of(rank)
        }
        got: list[tuple[int, int]] = []
        for pull in plan_pulls(prefill, decode, rank, num_blocks, skip, seed):
            src_first, src_count = heads_of_rank(
                prefill.total_kv_heads, prefill.tp_size, pull.source.tp_rank, prefill.use_mla
            )
            for src_pos, dst_pos in pull.blocks:
                # The remote position is where that prefill context rank stored the logical block.
                block = dst_pos * decode.dcp_size + decode.dcp_rank_of(rank)
                assert block % prefill.cp_size == prefill.shard_of(pull.source)
                assert block // prefill.cp_size == src_pos
                for span in pull.spans:
                    assert span.src_head >= 0 and span.src_head + span.num_heads <= src_count
                    assert span.dst_head >= 0 and span.dst_head + span.num_heads <= count
                    for k in range(span.num_heads):
                        head = src_first + span.src_head + k
                        assert head == first + span.dst_head + k  # the same head lands in place
                        got.append((head, block))
        assert len(got) == len(set(got)), "a piece arrives twice"
        assert set(got) == needed


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(0, 24), st.integers(0, 30), st.integers(0, 2**32 - 1))
def test_expected_done_counts_match_real_pulls(layout, num_blocks, skip, seed):
    prefill, decode = layout
    skip = min(skip, num_blocks)
    real = {r: 0 for r in prefill.ranks()}
    for rank in decode.ranks():
        sources = [p.source for p in plan_pulls(prefill, decode, rank, num_blocks, skip, seed)]
        assert len(sources) == len(set(sources)), "one decode rank pulls a prefill rank once"
        for s in sources:
            real[s] += 1
    assert readers_per_prefill_rank(prefill, decode, num_blocks, skip, seed) == real
    for r in prefill.ranks():
        assert expected_done_count(r, prefill, decode, num_blocks, skip, seed) == real[r]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16), st.integers(1, 16), st.integers(1, 12), st.text(min_size=1, max_size=8))
def test_mla_pulls_one_copy_from_one_rank(p_tp, d_tp, num_blocks, request_id):
    prefill = PrefillLayout(tp_size=p_tp, total_kv_heads=1, use_mla=True)
    decode = DecodeLayout(tp_size=d_tp)
    seed = request_seed(request_id)
    sources = {p.source for r in decode.ranks() for p in plan_pulls(prefill, decode, r, num_blocks, 0, seed)}
    assert len(sources) == 1


def test_gqa_replicas_spread_over_decode_ranks():
    # 2 heads, prefill TP 8: 4 replicas per head; 8 decode ranks use all 8 prefill ranks.
    prefill, decode = PrefillLayout(tp_size=8, total_kv_heads=2), DecodeLayout(tp_size=8)
    counts = readers_per_prefill_rank(prefill, decode, num_blocks=4, seed=0)
    assert sorted(counts.values()) == [1] * 8


def test_decode_tp_smaller_than_prefill_tp():
    prefill, decode = PrefillLayout(tp_size=4, total_kv_heads=8), DecodeLayout(tp_size=2)
    pulls = plan_pulls(prefill, decode, decode.ranks()[1], num_blocks=3)
    assert [p.source.tp_rank for p in pulls] == [2, 3]
    assert [p.spans[0].dst_head for p in pulls] == [0, 2]


def test_prefix_hit_skips_blocks_and_frees_unused_ranks():
    prefill, decode = PrefillLayout(tp_size=1, total_kv_heads=4, pcp_size=2), DecodeLayout(tp_size=1)
    # Logical blocks 0..2; the decode already has 0 and 1: only cp rank 0 (block 2) is read.
    counts = readers_per_prefill_rank(prefill, decode, num_blocks=3, skip_blocks=2)
    assert list(counts.values()) == [1, 0]


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(PlanError, match="do not divide"):
        plan_pulls(PrefillLayout(tp_size=4, total_kv_heads=6), DecodeLayout(tp_size=1), decode_rank(0), 1)


def test_dcp_reuses_tp_ranks_and_shards_tokens():
    # MLA prefill TP 4 with DCP 4: 4 ranks (not 16), each holds every 4th block; decode TP 1 reads
    # each block from the one rank that holds it.
    prefill, decode = PrefillLayout(tp_size=4, total_kv_heads=1, dcp_size=4, use_mla=True), DecodeLayout(1)
    assert prefill.world_size == 4 and prefill.cp_size == 4
    pulls = plan_pulls(prefill, decode, DecodeRank(0), num_blocks=6)
    assert {p.source.tp_rank: p.blocks for p in pulls} == {
        0: ((0, 0), (1, 4)), 1: ((0, 1), (1, 5)), 2: ((0, 2),), 3: ((0, 3),)
    }


def test_gqa_dcp_group_must_sit_inside_one_heads_replicas():
    with pytest.raises(PlanError, match="DCP 2 needs"):
        plan_pulls(PrefillLayout(tp_size=6, total_kv_heads=2, dcp_size=2), DecodeLayout(1), DecodeRank(0), 1)
    with pytest.raises(PlanError, match="not a multiple of DCP"):
        plan_pulls(PrefillLayout(tp_size=2, total_kv_heads=1, dcp_size=4, use_mla=True), DecodeLayout(1),
                   DecodeRank(0), 1)


def decode_rank(t):
    return DecodeRank(t)


def test_pcp_with_dcp_is_refused():
    with pytest.raises(PlanError, match="PCP 2 with DCP 2"):
        plan_pulls(PrefillLayout(tp_size=2, total_kv_heads=1, pcp_size=2, dcp_size=2, use_mla=True),
                   DecodeLayout(1), DecodeRank(0), 1)


def test_pcp_ranks_are_replicas_spread_over_decode_ranks():
    # vLLM 0.32 keeps the whole KV on every PCP rank: each decode rank reads every block from one.
    prefill, decode = PrefillLayout(tp_size=1, total_kv_heads=2, pcp_size=2), DecodeLayout(tp_size=2)
    pulls = {r.tp_rank: plan_pulls(prefill, decode, r, num_blocks=3, seed=0) for r in decode.ranks()}
    assert {t: [(p.source.pcp_rank, p.blocks) for p in ps] for t, ps in pulls.items()} == {
        0: [(0, ((0, 0), (1, 1), (2, 2)))], 1: [(1, ((0, 0), (1, 1), (2, 2)))]
    }
