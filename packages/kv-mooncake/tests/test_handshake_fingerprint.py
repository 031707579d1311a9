"""The handshake refuses every mismatch that changes which bytes a block id names or how they decode,
and names the setting and both values; start-up refuses the parallel layouts the plan cannot read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from conftest import FakeTransferEngine  # noqa: E402
from kv_common.kv_byte_settings import KVByteSettings
from kv_mooncake.config import MooncakeConfig  # noqa: E402
from kv_mooncake.identity import config_fingerprint, unsupported_settings
from kv_mooncake.rank_layout import PrefillLayout
from kv_mooncake.wire import messages as P
from kv_mooncake.worker import MooncakeWorker, RankContext

HEADS, HEAD = 4, 8


def _vllm_config(**over):
    model = SimpleNamespace(model="org/m", revision=over.get("revision"), quantization=over.get("quantization"),
                            dtype=over.get("dtype", torch.float16), use_mla=False)
    cache = SimpleNamespace(block_size=over.get("block_size", 16), cache_dtype=over.get("cache_dtype", "auto"))
    par = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=over.get("pp", 1),
                          prefill_context_parallel_size=over.get("pcp", 1),
                          decode_context_parallel_size=over.get("dcp", 1),
                          cp_kv_cache_interleave_size=over.get("interleave", 1))
    return SimpleNamespace(model_config=model, cache_config=cache, parallel_config=par)


def test_config_fingerprint_names_the_cache_dtype():
    assert config_fingerprint(_vllm_config()).cache_dtype == "float16"  # auto: the model's dtype
    assert config_fingerprint(_vllm_config(cache_dtype="fp8_e4m3")).cache_dtype == "fp8_e4m3"
    assert config_fingerprint(_vllm_config(cache_dtype="fp8_e5m2")).cache_dtype == "fp8_e5m2"
    fp = config_fingerprint(_vllm_config(revision="abc", quantization="fp8"))
    assert (fp.revision, fp.quantization, fp.model_dtype) == ("abc", "fp8", "float16")
    # One DCP rank: any interleave size is block-level, so a DCP 1 prefill matches a DCP 2 decode.
    assert config_fingerprint(_vllm_config(interleave=1)).cp_kv_cache_interleave_size == 16
    assert config_fingerprint(_vllm_config(dcp=2, interleave=16)).cp_kv_cache_interleave_size == 16


def _worker(engine_id, *, tensors=None, tp=1, **settings):
    kv_bytes = KVByteSettings(**{"model": "m", "block_size": 16, "cache_dtype": "uint8", "model_dtype": "bfloat16",
                                 **settings})
    context = RankContext(engine_id=engine_id, is_producer=False, is_consumer=False, side_channel_port=1,
                          total_kv_heads=HEADS, prefill_layout=PrefillLayout(tp_size=tp, total_kv_heads=HEADS),
                          kv_byte_settings=kv_bytes, kv_shape=(HEADS // tp, HEAD))
    w = MooncakeWorker(MooncakeConfig(), context, engine_factory=FakeTransferEngine)
    if tensors is None:
        tensors = {f"l{i}": torch.zeros(4, HEADS // tp, 16, 2 * HEAD, dtype=torch.uint8) for i in range(2)}
    w.register_kv_caches(tensors)
    return w


def _refusal(prefill, decode) -> str:
    reply = prefill.handle(P.Handshake(engine_id=prefill.context.engine_id, compatibility=decode.compatibility,
                                       reader_id="d"))
    assert isinstance(reply, P.Refused), f"not refused: {reply}"
    return reply.reason


def _cuda(blocks=4, block=16, layers=2, dtype=torch.uint8, heads=HEADS, head=HEAD):
    return {f"l{i}": torch.zeros(2, blocks, block, heads, head, dtype=dtype) for i in range(layers)}


CONFIG_FIELDS = [  # (field, prefill value, decode value)
    ("cache_dtype", "fp8_e4m3", "fp8_e5m2"),  # both uint8 tensors
    ("model", "org/a", "org/b"),
    ("revision", "r1", "r2"),
    ("quantization", "fp8", "awq"),
    ("model_dtype", "bfloat16", "float16"),
    ("pipeline_parallel_size", 1, 2),
    ("cp_kv_cache_interleave_size", 16, 1),
]


@pytest.mark.parametrize("field,theirs,mine", CONFIG_FIELDS)
def test_config_settings_are_compared_by_name(field, theirs, mine):
    reason = _refusal(_worker("P", **{field: theirs}), _worker("P", **{field: mine}))
    assert f"{field}: decode {mine!r}, prefill {theirs!r}" in reason


def test_kernel_block_size_is_compared():
    # Same logical block (32) and tensor bytes per block id, but the prefill split it into kernel
    # blocks of 16: block id b names other bytes there.
    prefill = _worker("P", tensors=_cuda(blocks=8, block=16), block_size=32)
    decode = _worker("P", tensors=_cuda(blocks=4, block=32), block_size=32)
    assert "kernel_block_size: decode 32, prefill 16" in _refusal(prefill, decode)


def test_logical_block_size_is_compared():
    reason = _refusal(_worker("P", tensors=_cuda(blocks=8, block=16), block_size=32),
                      _worker("P", tensors=_cuda(blocks=8, block=16), block_size=16))
    assert "block_size: decode 16, prefill 32" in reason


def test_layers_layout_stride_order_and_dtype_are_compared():
    base = _cuda()
    assert "num_layers: decode 3, prefill 2" in _refusal(_worker("P", tensors=base), _worker("P", tensors=_cuda(layers=3)))
    hnd = {k: torch.zeros(2, 4, HEADS, 16, HEAD, dtype=torch.uint8).permute(0, 1, 3, 2, 4) for k in base}
    assert "layout: decode" in _refusal(_worker("P", tensors=base), _worker("P", tensors=hnd))
    cpu = {k: torch.zeros(4, HEADS, 16, 2 * HEAD, dtype=torch.uint8) for k in base}
    assert "layout: decode" in _refusal(_worker("P", tensors=base), _worker("P", tensors=cpu))
    half = _cuda(dtype=torch.float16)
    assert "dtype: decode 'float16', prefill 'uint8'" in _refusal(_worker("P", tensors=base), _worker("P", tensors=half))


def test_same_fingerprint_across_tp_sizes_is_accepted():
    prefill = _worker("P", tensors={f"l{i}": torch.zeros(4, 2, 16, 2 * HEAD, dtype=torch.uint8) for i in range(2)}, tp=2)
    decode = _worker("P")
    reply = prefill.handle(P.Handshake(engine_id="P", compatibility=decode.compatibility, reader_id="d"))
    assert isinstance(reply, P.HandshakeReply) and (reply.tp_size, reply.pcp_size, reply.dcp_size) == (2, 1, 1)


@pytest.mark.parametrize("over,consumer,names", [
    ({"pp": 2}, True, ["pipeline_parallel_size=2 on a kv_consumer", "pipeline_parallel_size=1"]),
    ({"dcp": 2, "interleave": 1}, False, ["cp_kv_cache_interleave_size=1", "set cp_kv_cache_interleave_size=16"]),
    ({"pcp": 2, "dcp": 2, "interleave": 16}, False, ["prefill_context_parallel_size=2 with decode_context_parallel_size=2"]),
    ({"pcp": 2}, True, ["prefill_context_parallel_size=2 on a kv_consumer"]),
])
def test_unsupported_parallel_settings_are_refused_naming_the_setting(over, consumer, names):
    problems = "; ".join(unsupported_settings(config_fingerprint(_vllm_config(**over)), is_consumer=consumer))
    for name in names:
        assert name in problems, problems


@pytest.mark.parametrize("over,consumer", [
    ({}, True), ({"dcp": 2, "interleave": 16}, True), ({"pcp": 2}, False), ({"dcp": 4, "interleave": 16}, False),
    ({"pp": 2}, False),  # a pipeline-parallel prefill: each stage serves its own layers
])
def test_supported_parallel_settings_pass(over, consumer):
    assert unsupported_settings(config_fingerprint(_vllm_config(**over)), is_consumer=consumer) == []


@pytest.mark.parametrize("over,role,needle", [
    ({"pp": 2}, "kv_both", "pipeline_parallel_size=2 on a kv_consumer"),
    ({"dcp": 2, "interleave": 1}, "kv_consumer", "set cp_kv_cache_interleave_size=16"),
])
def test_connector_refuses_at_start_up(over, role, needle):
    pytest.importorskip("vllm")
    from kv_mooncake.connector import MooncakeConnectorV1
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = _vllm_config(**over)
    cfg.parallel_config.data_parallel_rank = 0
    cfg.kv_transfer_config = SimpleNamespace(
        kv_connector_extra_config={}, engine_id="e", kv_port=20000,
        is_kv_producer=role != "kv_consumer", is_kv_consumer=role != "kv_producer")
    with pytest.raises(ValueError, match=needle):
        MooncakeConnectorV1(cfg, KVConnectorRole.SCHEDULER, None)
