"""An oracle for the pull plan that is not the plan: where vLLM 0.32 puts token t of a request.

``VllmPlacement`` is written from vLLM 0.32's own code, not from ``pull.plan``:

* slot of token ``pos`` on a rank: ``vllm/v1/worker/block_table.py`` ``ComputeSlotMappingKernel``
  (a Triton kernel, so transcribed here): virtual blocks of ``block_size * dcp`` tokens, token
  ``o`` of a virtual block lives on DCP rank ``(o // interleave) % dcp`` at local offset
  ``(o // (dcp * interleave)) * interleave + o % interleave``; the total CP world of the slot
  mapping is the DCP group only, so PCP ranks keep full replicas (``ParallelConfig.
  pcp_shard_decode_requests``: "PCP-only execution replicates the KV cache");
  cross-checked against vLLM's ``get_dcp_local_seq_lens`` (called, not transcribed);
* DCP rank of a TP rank (PCP 1): ``vllm/distributed/parallel_state.py`` builds DCP groups of
  consecutive TP ranks, so ``dcp_rank = tp_rank % dcp``;
* heads of a TP rank: ``QKVParallelLinear`` gives rank ``r`` KV heads
  ``[(r // replicas) * per_rank, ... + per_rank)`` with ``per_rank = max(1, H // tp)`` and
  ``replicas = max(1, tp // H)``; MLA keeps its one latent vector on every rank;
* the scheduler's block is ``block_size * dcp`` tokens (``resolve_kv_cache_block_sizes``), so a
  request's block table has ``ceil(n / (block_size * dcp))`` entries, shared by the DCP ranks.

Every plan is executed slot by slot on this model, up to 16 ranks a side: each (head, token) a
decode rank needs must arrive from a prefill slot that holds that very token. A layout the
connector refuses (at start-up, ``unsupported_settings``, or in the plan, ``PlanError``) is not
executed; ``test_refused_layouts_would_load_wrong_tokens`` shows why they are refused.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kv_common.kv_byte_settings import KVByteSettings
from kv_mooncake.errors import PlanError
from kv_mooncake.identity import unsupported_settings
from kv_mooncake.pull.plan import plan_pulls, request_seed
from kv_mooncake.rank_layout import DecodeLayout, PrefillLayout

torch = pytest.importorskip("torch")
vllm_utils = pytest.importorskip("vllm.v1.attention.backends.utils")

BLOCK = 4  # tokens per block on one rank (small: many blocks per request)


class VllmPlacement:
    """One instance: which rank holds (head, token) of a request, in which block and slot."""

    def __init__(self, tp, pcp, dcp, interleave, heads, use_mla, num_tokens, rng):
        self.tp, self.pcp, self.dcp, self.interleave = tp, pcp, dcp, interleave
        self.heads, self.use_mla = heads, use_mla
        n_sched_blocks = -(-num_tokens // (BLOCK * dcp))
        self.block_table = rng.sample(range(10 * n_sched_blocks + 10), n_sched_blocks)
        self.num_tokens = num_tokens

    def heads_of(self, tp_rank):
        if self.use_mla:
            return [0]
        per = max(1, self.heads // self.tp)
        replicas = max(1, self.tp // self.heads)
        first = (tp_rank // replicas) * per
        return list(range(first, first + per))

    def dcp_rank_of(self, tp_rank):
        return tp_rank % self.dcp

    def slot(self, pos, dcp_rank):
        """(block id, slot) of token ``pos`` on a rank of ``dcp_rank``, or None (not stored there)."""
        vbs = BLOCK * self.dcp
        vblock, off = divmod(pos, vbs)
        if (off // self.interleave) % self.dcp != dcp_rank:
            return None
        local = (off // (self.dcp * self.interleave)) * self.interleave + off % self.interleave
        return self.block_table[vblock], local

    def ranks(self):
        return [(t, p) for p in range(self.pcp) for t in range(self.tp)]

    def contents(self):
        """(tp, pcp, block id, slot, head) -> token, on every rank (replicas included)."""
        out = {}
        for tp_rank, pcp_rank in self.ranks():
            dcp_rank = self.dcp_rank_of(tp_rank)
            for pos in range(self.num_tokens):
                where = self.slot(pos, dcp_rank)
                if where is not None:
                    for h in self.heads_of(tp_rank):
                        out[(tp_rank, pcp_rank, *where, h)] = pos
        return out


def _check_against_vllm_seq_lens(place: VllmPlacement) -> None:
    lens = vllm_utils.get_dcp_local_seq_lens(torch.tensor([place.num_tokens]), place.dcp, None, place.interleave)
    for r in range(place.dcp):
        stored = sum(place.slot(p, r) is not None for p in range(place.num_tokens))
        assert stored == int(lens.flatten()[r]), "the transcribed slot mapping disagrees with vLLM"


def _run_plan(p: VllmPlacement, d: VllmPlacement, skip_tokens: int, request_id: str) -> dict:
    """Execute every decode rank's plan slot by slot: (decode tp, block id, slot, head) -> token."""
    prefill = PrefillLayout(tp_size=p.tp, total_kv_heads=p.heads, pcp_size=p.pcp, dcp_size=p.dcp,
                            use_mla=p.use_mla)
    decode = DecodeLayout(tp_size=d.tp, dcp_size=d.dcp)
    stored = p.contents()
    num_blocks = -(-d.num_tokens // BLOCK)  # what the decode scheduler passes (per-rank blocks)
    got: dict = {}
    for rank in decode.ranks():
        d_heads = d.heads_of(rank.tp_rank)
        for pull in plan_pulls(prefill, decode, rank, num_blocks, skip_tokens // BLOCK, request_seed(request_id)):
            s_heads = p.heads_of(pull.source.tp_rank)
            for src_pos, dst_pos in pull.blocks:
                for slot in range(BLOCK):
                    for span in pull.spans:
                        for k in range(span.num_heads):
                            src = (pull.source.tp_rank, pull.source.pcp_rank, p.block_table[src_pos], slot,
                                   s_heads[span.src_head + k])
                            dst = (rank.tp_rank, d.block_table[dst_pos], slot, d_heads[span.dst_head + k])
                            assert dst not in got, f"slot written twice: {dst}"
                            got[dst] = stored.get(src)
    return got


def _needed(d: VllmPlacement, skip_tokens: int) -> dict:
    need = {}
    for tp_rank in range(d.tp):
        for pos in range(skip_tokens, d.num_tokens):
            where = d.slot(pos, d.dcp_rank_of(tp_rank))
            if where is not None:
                for h in d.heads_of(tp_rank):
                    need[(tp_rank, *where, h)] = pos
    return need


def _fingerprint(tp, pcp, dcp, interleave):
    return KVByteSettings(model="m", pipeline_parallel_size=1, tp_size=tp, pcp_size=pcp, dcp_size=dcp,
                          block_size=BLOCK, cp_kv_cache_interleave_size=interleave)


def _vllm_accepts(tp, pcp, dcp, heads, use_mla, interleave):
    if pcp == 1 and tp % dcp:
        return False
    if pcp > 1 and dcp not in (1, pcp, tp * pcp):
        return False
    if not use_mla and (heads % tp if heads >= tp else tp % heads):
        return False
    return BLOCK % interleave == 0


@st.composite
def deployments(draw):
    use_mla = draw(st.booleans())
    heads = 1 if use_mla else draw(st.sampled_from([1, 2, 4, 8, 16]))
    p_tp, d_tp = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    pcp = draw(st.sampled_from([1, 1, 2, 4]))
    assume(p_tp * pcp <= 16)
    p_dcp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    d_dcp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    p_int, d_int = draw(st.sampled_from([1, 2, BLOCK])), draw(st.sampled_from([1, 2, BLOCK]))
    assume(_vllm_accepts(p_tp, pcp, p_dcp, heads, use_mla, p_int))
    assume(_vllm_accepts(d_tp, 1, d_dcp, heads, use_mla, d_int))
    num_tokens = draw(st.integers(1, 6 * BLOCK * max(p_dcp, d_dcp)))
    skip_vblocks = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**31))
    return (p_tp, pcp, p_dcp, p_int), (d_tp, d_dcp, d_int), heads, use_mla, num_tokens, skip_vblocks, seed


def _refused(p, d) -> bool:
    (p_tp, pcp, p_dcp, p_int), (d_tp, d_dcp, d_int) = p, d
    return bool(unsupported_settings(_fingerprint(p_tp, pcp, p_dcp, p_int), is_consumer=False)
                or unsupported_settings(_fingerprint(d_tp, 1, d_dcp, d_int), is_consumer=True))


@settings(max_examples=400, deadline=None)
@given(deployments())
def test_every_plan_loads_the_tokens_vllm_placed(dep):
    p_cfg, d_cfg, heads, use_mla, num_tokens, skip_vblocks, seed = dep
    assume(not _refused(p_cfg, d_cfg))
    rng = random.Random(seed)
    p = VllmPlacement(p_cfg[0], p_cfg[1], p_cfg[2], p_cfg[3], heads, use_mla, num_tokens, rng)
    d = VllmPlacement(d_cfg[0], 1, d_cfg[1], d_cfg[2], heads, use_mla, num_tokens, rng)
    _check_against_vllm_seq_lens(p)
    _check_against_vllm_seq_lens(d)
    # A local prefix hit is whole decode scheduler blocks, below the prompt's last token.
    skip_tokens = min(skip_vblocks * BLOCK * d.dcp, ((num_tokens - 1) // (BLOCK * d.dcp)) * BLOCK * d.dcp)
    try:
        got = _run_plan(p, d, skip_tokens, f"req-{seed}")
    except PlanError:
        return  # refused: nothing is read
    need = _needed(d, skip_tokens)
    wrong = {k: (got.get(k), v) for k, v in need.items() if got.get(k) != v}
    assert not wrong, f"{len(wrong)} of {len(need)} needed slots wrong, e.g. {list(wrong.items())[:3]}"
    extra = {k: v for k, v in got.items() if k not in need and v is not None}
    for (tp_rank, block, slot, _head), token in extra.items():
        assert token < skip_tokens or d.slot(token, d.dcp_rank_of(tp_rank)) == (block, slot), "a slot got another token"


@pytest.mark.parametrize("p_cfg,d_cfg", [
    ((1, 2, 1, 1), (1, 1, 1)),  # PCP 2 without DCP: full replicas on both PCP ranks
    ((2, 2, 1, BLOCK), (2, 1, 1)),
    ((4, 1, 4, BLOCK), (1, 1, 1)),  # MLA-style DCP 4, block interleave
    ((4, 1, 2, BLOCK), (4, 4, BLOCK)),
    ((1, 1, 1, 1), (8, 8, BLOCK)),
])
def test_supported_layouts_are_not_refused(p_cfg, d_cfg):
    assert not _refused(p_cfg, d_cfg)
    rng = random.Random(0)
    p = VllmPlacement(*p_cfg, 1, True, 37, rng)
    d = VllmPlacement(d_cfg[0], 1, d_cfg[1], d_cfg[2], 1, True, 37, rng)
    got, need = _run_plan(p, d, 0, "r"), _needed(d, 0)
    assert all(got.get(k) == v for k, v in need.items())


@pytest.mark.parametrize("p_cfg,d_cfg", [
    ((4, 1, 4, 1), (1, 1, 1)),  # vLLM's default token interleave over DCP ranks
    ((2, 1, 2, 2), (2, 1, 1)),
    ((1, 1, 1, 1), (4, 4, 1)),
])
def test_refused_layouts_would_load_wrong_tokens(p_cfg, d_cfg):
    """What start-up refuses: executed anyway, the block-level plan would load wrong tokens."""
    assert _refused(p_cfg, d_cfg)
    rng = random.Random(0)
    p = VllmPlacement(*p_cfg, 1, True, 8 * BLOCK, rng)
    d = VllmPlacement(d_cfg[0], 1, d_cfg[1], d_cfg[2], 1, True, 8 * BLOCK, rng)
    got, need = _run_plan(p, d, 0, "r"), _needed(d, 0)
    assert any(got.get(k) != v for k, v in need.items())
