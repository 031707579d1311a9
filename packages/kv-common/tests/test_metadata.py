from __future__ import annotations

import msgspec
import pytest
from kv_common.metadata import BlockLayout, KVTransferParams, ParallelRank, RequestBlocks, StepMetadata


def layout(**overrides) -> BlockLayout:
    base = dict(
        num_layers=2,
        block_size=16,
        bytes_per_block_per_layer=4096,
        num_kv_heads=4,
        head_size=64,
        dtype="float32",
    )
    base.update(overrides)
    return BlockLayout(**base)


def test_parallel_rank_validates():
    ParallelRank(tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match="tp rank 2 outside size 2"):
        ParallelRank(tp_rank=2, tp_size=2)
    with pytest.raises(ValueError):
        ParallelRank(dcp_size=0)


def test_compatibility_key_ignores_tp_split_but_not_model_facts():
    tp1 = layout(num_kv_heads=8, rank=ParallelRank(tp_size=1))
    tp2 = layout(num_kv_heads=4, rank=ParallelRank(tp_rank=1, tp_size=2))
    assert tp1.compatibility_key("m") == tp2.compatibility_key("m")
    assert tp1.compatibility_key("m") != tp1.compatibility_key("other-model")
    assert layout().compatibility_key("m") != layout(dtype="bfloat16").compatibility_key("m")
    assert layout().compatibility_key("m") != layout(block_size=32).compatibility_key("m")
    mla = layout(use_mla=True, num_kv_heads=1, rank=ParallelRank(tp_size=4))
    assert mla.compatibility_key("m") == layout(use_mla=True, num_kv_heads=1).compatibility_key("m")


def test_kv_transfer_params_dict_round_trip():
    params = KVTransferParams(
        do_remote_prefill=True, remote_host="127.0.0.1", remote_port=1234, remote_block_ids=[3, 4]
    )
    data = params.to_dict()
    assert "do_remote_decode" not in data  # defaults omitted: small on the wire
    assert KVTransferParams.from_dict(data) == params
    assert KVTransferParams.from_dict(None) is None
    assert KVTransferParams.from_dict({}) is None


def test_kv_transfer_params_validates_on_arrival():
    with pytest.raises(msgspec.ValidationError):
        KVTransferParams.from_dict({"remote_port": "not a port"})
    # Unknown keys from other connectors' params are tolerated.
    assert KVTransferParams.from_dict({"remote_port": 1, "extra": 1}).remote_port == 1


def test_step_metadata_msgpack_round_trip():
    step = StepMetadata(
        loads=[RequestBlocks(request_id="r1", block_ids=((1, 2), (7,)), num_tokens=30, block_hashes=(b"h",))],
        saves=[
            RequestBlocks(
                request_id="r2", block_ids=((3,),), transfer=KVTransferParams(do_remote_decode=True)
            )
        ],
        frees=["r3"],
        aborts=["r4"],
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(step), type=StepMetadata)
    assert decoded == step
    assert decoded.loads[0].block_ids == ((1, 2), (7,))


def test_layout_msgpack_round_trip():
    lay = layout(rank=ParallelRank(tp_rank=1, tp_size=2))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(lay), type=BlockLayout) == lay
