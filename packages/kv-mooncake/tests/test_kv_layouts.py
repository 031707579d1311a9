"""Region and offset arithmetic of every KV layout the connector accepts, against a byte-exact copy.

No GPU here: the device layouts (CUDA ``[2, blocks, block, heads, dim]`` in either stride order,
FlashInfer ``[blocks, 2, block, heads, dim]``, vllm-ascend's separate K and V tensors, MLA's
``[blocks, block, dim]``, a kernel block smaller than the logical block) are CPU tensors of those
shapes. The pull's byte ranges come from the worker's own arithmetic (``_addresses``) and are copied
with ``ctypes.memmove`` in place of the TransferEngine (whose reads are tested on their own); the
decode's KV must then equal the prefill's, element for element, for the heads and blocks it owns.
"""

from __future__ import annotations

import ctypes

import msgspec
import pytest

torch = pytest.importorskip("torch")

from conftest import FakeTransferEngine  # noqa: E402
from kv_common.kv_byte_settings import KVByteSettings
from kv_mooncake.config import MooncakeConfig  # noqa: E402
from kv_mooncake.errors import PullFailed
from kv_mooncake.group_blocks import GroupBlocks
from kv_mooncake.params import RemoteSource
from kv_mooncake.pull.plan import plan_pulls, request_seed
from kv_mooncake.rank_layout import DecodeLayout, DecodeRank, PrefillLayout
from kv_mooncake.step import PullRequest
from kv_mooncake.wire import messages as P
from kv_mooncake.worker import MooncakeWorker, RankContext

HEADS, HEAD, LAYERS = 4, 8, 2


def _alloc(layout: str, heads: int, blocks: int, block: int, gen: torch.Generator, dtype=torch.float32):
    """One layer's KV as vLLM / vllm-ascend allocate it; returns (value for kv_caches, canonical view).

    The canonical view is ``[kv, blocks, tokens, heads, dim]`` (kv = 1 where K and V share a row)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    if layout == "cpu":
        t = rnd(blocks, heads, block, 2 * HEAD)
        return t, t.permute(1, 0, 2, 3).unsqueeze(0).transpose(0, 1).permute(1, 2, 3, 0, 4)[None].squeeze(0)
    if layout == "cuda":
        t = rnd(2, blocks, block, heads, HEAD)
        return t, t
    if layout == "cuda_hnd":  # same logical shape, heads outside tokens in memory (stride order)
        phys = rnd(2, blocks, heads, block, HEAD)
        t = phys.permute(0, 1, 3, 2, 4)
        return t, t
    if layout == "flashinfer":
        t = rnd(blocks, 2, block, heads, HEAD)
        return t, t.transpose(0, 1)
    if layout == "separate":
        k, v = rnd(blocks, block, heads, HEAD), rnd(blocks, block, heads, HEAD)
        return (k, v), None  # stacked when read (a stack is a copy)
    if layout == "mla":
        t = rnd(blocks, block, 3 * HEAD)
        return t, t[None, :, :, None, :]
    raise AssertionError(layout)


def _canonical_cpu(t):
    # [blocks, heads, block, 2*dim] -> [1, blocks, block, heads, 2*dim]
    return t.permute(0, 2, 1, 3)[None]


def _worker(engine_id, heads_on_rank, total_heads, block_size, use_mla, tp=1):
    context = RankContext(engine_id=engine_id, is_producer=False, is_consumer=False, side_channel_port=1,
                          total_kv_heads=total_heads, use_mla=use_mla,
                          prefill_layout=PrefillLayout(tp_size=tp, total_kv_heads=total_heads, use_mla=use_mla),
                          kv_byte_settings=KVByteSettings(model="m", block_size=block_size, cache_dtype="float32"),
                          kv_shape=(heads_on_rank, HEAD))
    return MooncakeWorker(MooncakeConfig(), context, engine_factory=FakeTransferEngine)


def _caches(layout, heads, blocks, block, seed):
    gen = torch.Generator().manual_seed(seed)
    values, views = {}, {}
    for i in range(LAYERS):
        value, view = _alloc(layout, heads, blocks, block, gen)
        if layout == "cpu":
            view = _canonical_cpu(value)
        values[f"model.layers.{i}.self_attn"], views[f"model.layers.{i}.self_attn"] = value, view
    return values, views


def _view(value, view):
    return torch.stack(list(value)) if view is None else view


def _prefill(layout, logical, kernel, num_logical):
    """A prefill worker over random KV of ``num_logical`` blocks; (worker, its values, their views, heads)."""
    use_mla = layout == "mla"
    heads = 1 if use_mla else HEADS
    p_vals, p_views = _caches(layout, heads, num_logical * (logical // kernel), kernel, seed=1)
    prefill = _worker("P", heads, heads, logical, use_mla)
    prefill.register_kv_caches(p_vals)
    return prefill, p_vals, p_views, heads


def _decode(prefill, layout, logical, kernel, num_logical, heads, d_rank, decode_tp):
    """Decode rank ``d_rank`` of ``decode_tp`` and the prefill's handshake reply to it, as it crosses
    the wire; (worker, its values, their views, its heads, the reply)."""
    use_mla = layout == "mla"
    d_heads = 1 if use_mla else heads // decode_tp
    d_vals, d_views = _caches(layout, d_heads, num_logical * (logical // kernel), kernel, seed=2 + d_rank)
    decode = _worker("D", d_heads, heads, logical, use_mla, tp=decode_tp)
    decode.puller.decode_rank, decode.puller.decode_layout = DecodeRank(d_rank), DecodeLayout(decode_tp)
    decode.register_kv_caches(d_vals)
    hs = prefill.handle(P.Handshake(engine_id="P", compatibility=decode.compatibility, reader_id="d"))
    assert isinstance(hs, P.HandshakeReply), hs
    # The reply crosses the wire as msgpack: use what the decode would decode.
    return decode, d_vals, d_views, d_heads, msgspec.msgpack.decode(msgspec.msgpack.encode(hs), type=P.HandshakeReply)


CASES = [  # layout, logical block, kernel block
    ("cpu", 16, 16),
    ("cuda", 16, 16),
    ("cuda_hnd", 16, 16),
    ("flashinfer", 16, 16),
    ("separate", 16, 16),
    ("mla", 16, 16),
    ("cuda", 32, 16),  # vLLM split each 32-token block into two kernel blocks of 16
    ("cpu", 16, 8),
]


@pytest.mark.parametrize("layout,logical,kernel", CASES)
@pytest.mark.parametrize("decode_tp", [1, 2, 4])
def test_pulled_bytes_equal_the_prefill_kv(layout, logical, kernel, decode_tp):
    use_mla = layout == "mla"
    ratio = logical // kernel
    num_logical = 6
    prefill, p_vals, p_views, heads = _prefill(layout, logical, kernel, num_logical)
    remote_ids = [4, 1, 5]  # the prefill's block table for the request (3 logical blocks)
    local_ids = [2, 0, 3]
    for d_rank in range(decode_tp):
        decode, d_vals, d_views, d_heads, hs = _decode(prefill, layout, logical, kernel, num_logical, heads,
                                                       d_rank, decode_tp)
        source = RemoteSource(engine_id="P", host="127.0.0.1", port=1, request_id="r", block_ids_by_group=[remote_ids])
        req = PullRequest(request_id="r", source=source, local_block_ids=[local_ids], blocks_by_group=[GroupBlocks(0, 3)])
        layout_p = PrefillLayout(tp_size=1, total_kv_heads=heads, use_mla=use_mla)
        for pull in plan_pulls(layout_p, DecodeLayout(decode_tp), DecodeRank(d_rank), 3, 0, request_seed("r")):
            local, remote, lengths = decode.puller._addresses(req, pull, hs)
            for dst, src, n in zip(local, remote, lengths):
                ctypes.memmove(dst, src, n)
        first = d_rank * d_heads if not use_mla else 0
        for name in p_views:
            pv = _view(p_vals[name], p_views[name]).unflatten(1, (num_logical, ratio)).flatten(2, 3)  # logical blocks
            dv = _view(d_vals[name], d_views[name]).unflatten(1, (num_logical, ratio)).flatten(2, 3)
            for r_block, l_block in zip(remote_ids, local_ids):
                want = pv[:, r_block, :, first:first + d_heads]
                got = dv[:, l_block, :, :]
                assert torch.equal(got, want), (name, layout, d_rank, r_block, l_block)
            untouched = [b for b in range(num_logical) if b not in local_ids]
            f_vals, f_views = _caches(layout, d_heads, num_logical * ratio, kernel, seed=2 + d_rank)
            fresh = _view(f_vals[name], f_views[name]).unflatten(1, (num_logical, ratio)).flatten(2, 3)
            assert torch.equal(dv[:, untouched], fresh[:, untouched]), "bytes written outside the pulled blocks"


def test_unknown_layout_is_refused_at_registration():
    w = _worker("P", HEADS, HEADS, 16, False)
    with pytest.raises(ValueError, match=r"not a known layout"):
        w.register_kv_caches({"l0": torch.zeros(4, 16, HEADS * HEAD)})  # [blocks, block, heads*dim]


def test_kernel_block_that_does_not_tile_the_logical_block_is_refused():
    w = _worker("P", HEADS, HEADS, 24, False)
    with pytest.raises(ValueError, match="block_size=24"):
        w.register_kv_caches({"l0": torch.zeros(2, 4, HEADS, 16, 2 * HEAD)[:, 0]})


def test_layouts_that_differ_are_refused_at_the_handshake():
    prefill = _worker("P", HEADS, HEADS, 16, False)
    prefill.register_kv_caches(_caches("cuda", HEADS, 4, 16, 1)[0])
    decode = _worker("D", HEADS, HEADS, 16, False)
    decode.register_kv_caches(_caches("cuda_hnd", HEADS, 4, 16, 1)[0])
    reply = prefill.handle(P.Handshake(engine_id="P", compatibility=decode.compatibility, reader_id="d"))
    assert isinstance(reply, P.Refused) and "layout:" in reply.reason, reply


def test_prefill_parallel_sizes_must_match_kv_transfer_params():
    prefill = _worker("P", 2, HEADS, 16, False, tp=2)
    prefill.register_kv_caches(_caches("cpu", 2, 4, 16, 1)[0])
    decode = _worker("D", HEADS, HEADS, 16, False)
    decode.register_kv_caches(_caches("cpu", HEADS, 4, 16, 2)[0])
    hs = prefill.handle(P.Handshake(engine_id="P", compatibility=decode.compatibility, reader_id="d"))
    assert isinstance(hs, P.HandshakeReply)
    source = RemoteSource(engine_id="P", host="h", port=1, request_id="r", block_ids_by_group=[[0]], tp_size=1)  # stale
    req = PullRequest(request_id="r", source=source, local_block_ids=[[0]], blocks_by_group=[GroupBlocks(0, 1)])
    pull = plan_pulls(PrefillLayout(1, HEADS), DecodeLayout(1), DecodeRank(0), 1)[0]
    with pytest.raises(PullFailed, match=r"TP/PCP/DCP/PP \(1, 1, 1, 1\), it runs \(2, 1, 1, 1\)"):
        decode.puller._addresses(req, pull, hs)


@pytest.mark.parametrize("layout,logical,kernel", CASES)
@pytest.mark.parametrize("decode_tp", [1, 2])
def test_numpy_ranges_equal_the_per_block_loop(layout, logical, kernel, decode_tp):
    """Issue 25: large pulls get their byte ranges from numpy (``pull.byte_ranges``); the per-block
    Python loop of ``transfer_ranges`` is the oracle: the same ranges, in the same order, merged
    alike (scattered blocks and runs of consecutive ones on both sides), or the same refusal."""
    import random

    from kv_mooncake.pull.byte_ranges import transfer_ranges

    use_mla = layout == "mla"
    ratio = logical // kernel
    num_logical = 48
    prefill, _, _, heads = _prefill(layout, logical, kernel, num_logical)
    rng = random.Random(f"{layout}{logical}{kernel}{decode_tp}")
    remote_ids = list(range(10, 22)) + rng.sample(range(num_logical), 20)  # a run, then scattered
    local_ids = list(range(30, 42)) + rng.sample(range(num_logical), 20)
    for d_rank in range(decode_tp):
        decode, _, _, _, hs = _decode(prefill, layout, logical, kernel, num_logical, heads, d_rank, decode_tp)
        source = RemoteSource(engine_id="P", host="127.0.0.1", port=1, request_id="r", block_ids_by_group=[remote_ids])
        n = len(local_ids)
        req = PullRequest(request_id="r", source=source, local_block_ids=[local_ids], blocks_by_group=[GroupBlocks(0, n)])
        layout_p = PrefillLayout(tp_size=1, total_kv_heads=heads, use_mla=use_mla)
        cache, runs = decode.puller.cache, decode.puller._paired_runs
        for pull in plan_pulls(layout_p, DecodeLayout(decode_tp), DecodeRank(d_rank), n, 0, request_seed("r")):
            loop = transfer_ranges(cache, hs, req, pull, runs, use_arrays=False)
            arrays = transfer_ranges(cache, hs, req, pull, runs, use_arrays=True)
            assert arrays == loop
            assert all(type(x) is int for part in arrays for x in part[:3])
            if layout == "cpu" and decode_tp == 1:  # consecutive blocks are contiguous on both sides there
                assert len(loop[0]) < len(pull.blocks) * LAYERS * ratio, "nothing merged: the test tests less"
        bad = PullRequest(request_id="r", source=RemoteSource(engine_id="P", host="127.0.0.1", port=1, request_id="r",
                                                              block_ids_by_group=[[*remote_ids[:-1], num_logical]]),
                          local_block_ids=[local_ids], blocks_by_group=[GroupBlocks(0, n)])
        pull = plan_pulls(layout_p, DecodeLayout(decode_tp), DecodeRank(d_rank), n, 0, request_seed("r"))[0]
        for use_arrays in (False, True):
            with pytest.raises(PullFailed):
                transfer_ranges(cache, hs, bad, pull, runs, use_arrays=use_arrays)
