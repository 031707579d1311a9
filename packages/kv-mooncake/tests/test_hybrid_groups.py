"""MooncakeConnectorV1 with vLLM's hybrid KV-cache manager: which groups it serves, the per-group
pull plan against an oracle that is not the plan, the per-group ``kv_transfer_params`` at the edge,
and the group layouts in the handshake.

The oracle reads attention's definition token by token (token ``n`` sees token ``t`` of a sliding
window ``w`` when ``n - t < w``; of a chunked-local group when both are in one chunk; of full
attention always) and vLLM's real ``KVCacheManager`` for where the null blocks are, on a prefill
that computed the prompt in random chunks and on a decode that allocated it for a load.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")

from conftest import FakeTransferEngine  # noqa: E402
from kv_common.kv_byte_settings import KVByteSettings
from kv_common.kv_cache_groups import KVGroup, UnsupportedKVGroup, kv_groups  # noqa: E402
from kv_mooncake.config import MooncakeConfig  # noqa: E402
from kv_mooncake.group_blocks import GroupBlocks, group_blocks_to_pull
from kv_mooncake.identity import group_layouts, prompt_digest
from kv_mooncake.kv_regions import check_kv_cache_groups
from kv_mooncake.params import MAX_KV_GROUPS, pull_problem, read_transfer_params
from kv_mooncake.pull.plan import group_readers_per_prefill_rank, plan_group_pulls
from kv_mooncake.rank_layout import DecodeLayout, PrefillLayout, PrefillRank
from kv_mooncake.scheduler import MooncakeScheduler  # noqa: E402
from kv_mooncake.wire import messages as P
from kv_mooncake.worker import MooncakeWorker, RankContext

HEADS, HEAD = 2, 8


def _spec(kind: str, block: int, window: int = 0):
    common = dict(block_size=block, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    if kind == "full":
        return kv_iface.FullAttentionSpec(**common)
    if kind == "sliding_window":
        return kv_iface.SlidingWindowSpec(**common, sliding_window=window)
    if kind == "chunked_local":
        return kv_iface.ChunkedLocalAttentionSpec(**common, attention_chunk_size=window)
    return kv_iface.MambaSpec(block_size=block, shapes=((4, 8),), dtypes=(torch.float32,))


def _kv_cache_config(*specs, num_blocks: int = 400):
    groups = [kv_iface.KVCacheGroupSpec([f"model.layers.{2 * i + j}.attn" for j in range(2)], spec)
              for i, spec in enumerate(specs)]
    return kv_iface.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


# ---- which groups are served ---------------------------------------------------------------------
def test_the_connector_supports_vllms_hybrid_manager():
    from kv_mooncake.connector import KvMooncakeConnectorV1, MooncakeConnectorV1
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    assert supports_hma(MooncakeConnectorV1) and supports_hma(KvMooncakeConnectorV1)


def test_full_sliding_and_chunked_local_groups_are_served():
    config = _kv_cache_config(_spec("full", 16), _spec("sliding_window", 16, 64), _spec("chunked_local", 16, 32))
    groups = check_kv_cache_groups(config)
    assert [g.kind for g in groups] == ["full", "sliding_window", "chunked_local"]
    assert check_kv_cache_groups(None) == ()  # older vLLM hands no config: one group, every layer


def test_a_state_group_is_refused_at_start_up_naming_it():
    with pytest.raises(UnsupportedKVGroup, match=r"group 1 \(state: vLLM MambaSpec, layers model.layers.2.attn"):
        check_kv_cache_groups(_kv_cache_config(_spec("full", 16), _spec("mamba", 16)))


def test_groups_of_different_block_sizes_are_refused_naming_them():
    with pytest.raises(UnsupportedKVGroup, match="group 0 full: 16, group 1 sliding_window: 32"):
        check_kv_cache_groups(_kv_cache_config(_spec("full", 16), _spec("sliding_window", 32, 64)))


# ---- the per-group plan against the oracle --------------------------------------------------------
def _sees(kind: str, size: int, n: int, t: int) -> bool:
    """Attention's definition: does the token at position ``n`` attend to the token at ``t < n``?"""
    if kind == "sliding_window":
        return n - t < size
    if kind == "chunked_local":
        return t // size == n // size
    return True


def _oracle(kind: str, size: int, block: int, n: int, local_computed: int) -> set[int]:
    """Blocks of one group a decode needs after loading ``n`` tokens, except whole blocks computed
    locally: those holding a token that position ``n`` (the next one computed) attends to, and the
    block position ``n`` is written into when it holds earlier tokens (vLLM caches it once full:
    its earlier slots must hold their KV)."""
    attended = {t // block for t in range(n) if _sees(kind, size, n, t)}
    written = {n // block} if n % block else set()
    return (attended | written) - set(range(local_computed // block))


def _planned(groups: tuple[KVGroup, ...], n: int, local_computed: int, prefill=None, decode=None) -> list[set[int]]:
    prefill = prefill or PrefillLayout(tp_size=1, total_kv_heads=HEADS)
    decode = decode or DecodeLayout(tp_size=1)
    blocks = group_blocks_to_pull(groups, num_tokens=n, num_computed_tokens=local_computed)
    out: list[set[int]] = [set() for _ in groups]
    for rank in decode.ranks():
        for pull in plan_group_pulls(prefill, decode, rank, blocks, seed=3):
            for src_pos, dst_pos in pull.blocks:
                assert src_pos == dst_pos  # DCP 1: a logical block sits at the same position on both sides
                out[pull.group].add(dst_pos)
    return out


KINDS = st.sampled_from(["full", "sliding_window", "chunked_local"])


@settings(max_examples=300, deadline=None)
@given(kinds=st.lists(KINDS, min_size=1, max_size=3), block=st.sampled_from([1, 2, 4, 16]),
       size=st.integers(1, 70), n=st.integers(1, 300), hit=st.integers(0, 300), tp=st.sampled_from([1, 2]))
def test_each_group_pulls_exactly_the_blocks_attention_still_reads(kinds, block, size, n, hit, tp):
    groups = kv_groups(_kv_cache_config(*(_spec(k, block, size) for k in kinds)))
    local_computed = min(hit, n - 1) // block * block  # vLLM's prefix hits are whole blocks
    expected = [_oracle(k, size, block, n, local_computed) for k in kinds]
    layouts = dict(prefill=PrefillLayout(tp_size=tp, total_kv_heads=HEADS), decode=DecodeLayout(tp_size=2 // tp))
    assert _planned(groups, n, local_computed, **layouts) == expected


def test_readers_count_each_decode_rank_once_whatever_its_groups():
    groups = kv_groups(_kv_cache_config(_spec("full", 4), _spec("sliding_window", 4, 6)))
    blocks = group_blocks_to_pull(groups, num_tokens=23, num_computed_tokens=0)
    prefill = PrefillLayout(tp_size=2, total_kv_heads=HEADS)
    assert group_readers_per_prefill_rank(prefill, DecodeLayout(tp_size=1), blocks) == {
        PrefillRank(0, 0): 1, PrefillRank(1, 0): 1}


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_a_decode_rank_s_own_plan_counts_as_planning_it_again(prefill_tp, decode_tp):
    groups = kv_groups(_kv_cache_config(_spec("full", 4), _spec("sliding_window", 4, 6)))
    blocks = group_blocks_to_pull(groups, num_tokens=23, num_computed_tokens=0)
    prefill, decode = PrefillLayout(tp_size=prefill_tp, total_kv_heads=HEADS), DecodeLayout(tp_size=decode_tp)
    for rank in decode.ranks():
        own = plan_group_pulls(prefill, decode, rank, blocks, seed=7)
        assert group_readers_per_prefill_rank(prefill, decode, blocks, 7, planned={rank: own}) == \
            group_readers_per_prefill_rank(prefill, decode, blocks, 7)


def _allocate_decode(manager, request_id: str, n: int) -> list[list[int]]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request(request_id, list(range(n)), SamplingParams(max_tokens=1), None)
    # What vLLM's scheduler asks for a request loaded asynchronously: all its tokens external.
    assert manager.allocate_slots(request, 0, num_external_computed_tokens=n, delay_cache_blocks=True) is not None
    return [list(ids) for ids in manager.get_block_ids(request_id)]


def _prefill_in_chunks(manager, request_id: str, n: int, chunks: list[int]) -> list[list[int]]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request(request_id, list(range(n)), SamplingParams(max_tokens=1), None)
    done = 0
    for chunk in [*chunks, n]:
        step = min(chunk, n - done)
        if step <= 0:
            break
        assert manager.allocate_slots(request, step) is not None
        done += step
        request.num_computed_tokens = done
    # What vLLM hands request_finished_all_groups.
    return [list(ids) for ids in manager.get_block_ids_for_computed_tokens(request_id, n)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["sliding_window", "chunked_local"]), block=st.sampled_from([2, 4, 8]),
       size=st.integers(2, 40), n=st.integers(2, 200), chunks=st.lists(st.integers(1, 80), max_size=4))
def test_no_planned_block_is_a_null_block_on_either_side(kind, block, size, n, chunks):
    """vLLM's real managers: the prefill dropped what its window left behind while it computed the
    prompt in chunks; the decode allocated null blocks for what its window will never read. No
    planned block is one of those, on either side."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    config = _kv_cache_config(_spec("full", block), _spec(kind, block, size), num_blocks=1000)
    managers = [KVCacheManager(config, max_model_len=4096, scheduler_block_size=block, hash_block_size=block,
                               enable_caching=False) for _ in range(2)]
    remote = _prefill_in_chunks(managers[0], "p", n, chunks)
    local = _allocate_decode(managers[1], "d", n)
    null = managers[0].block_pool.null_block.block_id
    assert null == managers[1].block_pool.null_block.block_id == 0  # kv_common.kv_cache_groups.NULL_BLOCK_ID
    planned = _planned(kv_groups(config), n, 0)
    for g, positions in enumerate(planned):
        for position in positions:
            assert remote[g][position] != null, (g, position, remote[g])
            assert local[g][position] != null, (g, position, local[g])


# ---- kv_transfer_params: per-group lists at the edge ---------------------------------------------
WIRE = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "10.0.0.1", "remote_port": 17000,
        "remote_request_id": "p-r"}
BLOCK_IDS = st.one_of(st.integers(-3, 2**31 + 3), st.text(max_size=3), st.none(), st.floats(allow_nan=False))
NESTED = st.one_of(st.lists(BLOCK_IDS, max_size=6), st.lists(st.lists(BLOCK_IDS, max_size=6), max_size=5),
                   st.lists(st.one_of(BLOCK_IDS, st.lists(BLOCK_IDS, max_size=3)), max_size=5),
                   st.integers(), st.text(max_size=5), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=400, deadline=None)
@given(NESTED)
def test_remote_block_ids_are_read_once_into_bounded_per_group_lists(raw):
    read = read_transfer_params({**WIRE, "remote_block_ids": raw})
    assert read is not None  # never raises, whatever the client sent
    if read.problem is not None:
        assert "remote_block_ids" in read.problem
        assert read.params.block_ids == []  # the refused key is dropped, the address kept
        assert read.params.source() is not None
        return
    groups = read.params.group_block_ids()
    assert 1 <= len(groups) <= MAX_KV_GROUPS
    assert all(isinstance(b, int) and 0 <= b < 2**31 for ids in groups for b in ids)


def test_too_many_groups_or_mixed_lists_are_refused_naming_the_key():
    too_many = read_transfer_params({**WIRE, "remote_block_ids": [[1]] * (MAX_KV_GROUPS + 1)})
    assert too_many.problem and f"at most {MAX_KV_GROUPS}" in too_many.problem
    mixed = read_transfer_params({**WIRE, "remote_block_ids": [1, [2]]})
    assert mixed.problem and "mixes block ids and per-group lists" in mixed.problem


def _groups(block: int = 4, window: int = 6) -> tuple[KVGroup, ...]:
    return kv_groups(_kv_cache_config(_spec("full", block), _spec("sliding_window", block, window)))


def _problem(remote, prompt_len: int = 23, groups=None) -> str | None:
    params = read_transfer_params({**WIRE, "remote_block_ids": remote}).params
    return pull_problem(params, prompt_len=prompt_len, block_size=4, groups=_groups() if groups is None else groups)


def test_per_group_lists_must_fit_this_decodes_groups():
    full, window = [11, 12, 13, 14, 15, 16], [0, 0, 0, 17, 18, 19]  # 23 tokens, window 6: blocks 4 and 5
    assert _problem([full, window]) is None
    assert "1 KV-cache groups, this decode has 2" in _problem(full)
    assert "3 KV-cache groups, this decode has 2" in _problem([full, window, window])
    assert "2 KV-cache groups, this decode has 1" in _problem([full, window], groups=())
    assert "group 1 (sliding_window) lacks blocks 4..5" in _problem([full, [0, 0, 0, 17, 0, 19]])
    assert "group 1 (sliding_window) lacks blocks 4..5" in _problem([full, window[:5]])
    assert "remote_block_ids group 0 has 9 blocks" in _problem([full + [1, 2, 3], window])


def _request(request_id: str, params: dict, n: int = 23):
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, prompt_token_ids=list(range(n)),
                           status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"), prompt_embeds=None,
                           mm_features=None, lora_request=None, cache_salt=None)


def test_prefill_to_decode_per_group_round_trip():
    groups = _groups()
    prefill = MooncakeScheduler(MooncakeConfig(side_channel_host="10.0.0.1"), engine_id="P", block_size=4,
                                is_producer=True, is_consumer=False, side_channel_port=17000, groups=groups)
    held, out = prefill.request_finished(_request("p-r", {"do_remote_decode": True}),
                                         ([1, 2, 3, 4, 5, 6], [0, 0, 0, 7, 8, 9]))
    assert held and out["remote_block_ids"] == [[1, 2, 3, 4, 5, 6], [0, 0, 0, 7, 8, 9]]
    hold = prefill.build_step().holds[0]
    assert hold.block_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9] and hold.num_blocks == 9  # every group's, no null block
    decode = MooncakeScheduler(MooncakeConfig(), engine_id="D", block_size=4, is_producer=False, is_consumer=True,
                               side_channel_port=1, groups=groups)
    request = _request("d-r", dict(out))
    assert decode.get_num_new_matched_tokens(request, 0) == (23, True)
    decode.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([21, 22, 23, 24, 25, 26],
                                                                                     [0, 0, 0, 0, 27, 28])), 23)
    pull = decode.build_step().pulls[0]
    # Window 6 after 23 tokens: tokens 18..22, blocks 4 and 5 of the sliding group; all 6 of the full one.
    assert pull.blocks_by_group == [GroupBlocks(0, 6), GroupBlocks(4, 6)] and pull.check_null_blocks
    assert pull.source.block_ids_by_group == [[1, 2, 3, 4, 5, 6], [0, 0, 0, 7, 8, 9]]
    assert pull.local_block_ids == [[21, 22, 23, 24, 25, 26], [0, 0, 0, 0, 27, 28]]


def test_a_window_the_prefill_dropped_is_computed_locally_with_one_warning(caplog):
    decode = MooncakeScheduler(MooncakeConfig(), engine_id="D", block_size=4, is_producer=False, is_consumer=True,
                               side_channel_port=1, groups=_groups())
    params = {**WIRE, "remote_block_ids": [[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 9]],
              "prompt_digest": prompt_digest(range(23))}
    with caplog.at_level(logging.WARNING, logger="kv_mooncake"):
        assert decode.get_num_new_matched_tokens(_request("d-r", params), 0) == (0, False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "lacks blocks 4..5" in warnings[0], warnings
    assert decode.build_step().frees[0].request_id == "p-r"  # the prefill may free at once


# ---- the handshake compares group layouts --------------------------------------------------------
def _worker(groups: tuple[KVGroup, ...]) -> MooncakeWorker:
    w = MooncakeWorker(MooncakeConfig(), RankContext(engine_id="P", is_producer=False, is_consumer=False,
                                                     side_channel_port=1, total_kv_heads=HEADS,
                                                     kv_byte_settings=KVByteSettings(model="m", block_size=4),
                                                     kv_groups=groups), engine_factory=FakeTransferEngine)
    names = [name for g in groups for name in g.layer_names] or ["model.layers.0.attn", "model.layers.1.attn"]
    w.register_kv_caches({name: torch.zeros(8, HEADS, 4, 2 * HEAD) for name in names})
    return w


def _refusal(prefill: MooncakeWorker, decode: MooncakeWorker) -> str:
    reply = prefill.handle(P.Handshake(engine_id="P", compatibility=decode.compatibility, reader_id="d"))
    assert isinstance(reply, P.Refused), reply
    return reply.reason


def test_group_layouts_must_match_naming_the_group_that_differs():
    hybrid = _worker(_groups(window=6))
    assert isinstance(hybrid.handle(P.Handshake(engine_id="P", compatibility=_worker(_groups(window=6)).compatibility,
                                                reader_id="d")), P.HandshakeReply)
    reason = _refusal(hybrid, _worker(_groups(window=8)))
    assert "kv_groups: group 1: decode" in reason and '"sliding_window":8' in reason and '"sliding_window":6' in reason
    assert "group 0" not in reason
    # A peer without the hybrid manager (one group of every layer) sends no group layouts.
    plain = _worker(())
    assert plain.compatibility.kv_groups == ()
    reason = _refusal(hybrid, plain)
    assert "kv_groups: decode 1 KV-cache groups (one, full attention), prefill 2" in reason


def test_one_full_attention_group_keeps_the_fingerprint_of_a_peer_without_groups():
    one = kv_groups(_kv_cache_config(_spec("full", 4)))
    assert group_layouts(one) == () == group_layouts(())
    assert len(group_layouts(_groups())) == 2


def test_layers_in_no_group_are_refused():
    w = MooncakeWorker(MooncakeConfig(), RankContext(engine_id="P", is_producer=False, is_consumer=False,
                                                     side_channel_port=1, total_kv_heads=HEADS,
                                                     kv_byte_settings=KVByteSettings(model="m", block_size=4),
                                                     kv_groups=_groups()), engine_factory=FakeTransferEngine)
    names = [n for g in _groups() for n in g.layer_names] + ["stray.0"]
    with pytest.raises(ValueError, match=r"\['stray.0'\] are in no KV-cache group"):
        w.register_kv_caches({name: torch.zeros(8, HEADS, 4, 2 * HEAD) for name in names})


def test_blocks_are_planned_per_group_with_several_groups_or_a_window():
    from kv_mooncake.group_blocks import plans_per_group

    full = KVGroup(0, "full", "FullAttentionSpec", 16, ("l0",))
    window = KVGroup(1, "sliding_window", "SlidingWindowSpec", 16, ("l1",), sliding_window=32)
    assert not plans_per_group([]) and not plans_per_group([full])  # one full-attention group: one list
    assert plans_per_group([full, full]) and plans_per_group([window]) and plans_per_group([full, window])
