"""The shared KV layout model: whole-block views for the store, refusals that name the layout."""

from __future__ import annotations

import pytest
from kv_common.kv_layout import KVPart, LayoutError, infer_roles, whole_block_bytes


def _part(shape, strides, roles, element_size=4):
    return KVPart(base=0, shape=shape, strides=strides, element_size=element_size, roles=roles)


def test_vllm_032_packed_layout_is_whole_blocks():
    shape = (10, 2, 16, 64)  # [blocks, heads, block, 2*head] (LBHNC)
    roles = infer_roles(shape, heads=2, head_size=32, use_mla=False)
    part = _part(shape, (2 * 16 * 64, 16 * 64, 64, 1), roles)
    assert whole_block_bytes(part) == 2 * 16 * 64 * 4


def test_heads_inside_tokens_is_still_whole_blocks():
    # LBNHC: logical [blocks, heads, block, 2*head], physically [blocks, block, heads, 2*head].
    part = _part((10, 2, 16, 64), (2 * 16 * 64, 64, 2 * 64, 1), ("block", "head", "token", "dim"))
    assert whole_block_bytes(part) == 2 * 16 * 64 * 4


def test_kv_outside_blocks_is_refused():
    shape = (2, 10, 16, 2, 32)  # older CUDA [2, blocks, block, heads, head]: shape[0] is not the blocks
    roles = infer_roles(shape, heads=2, head_size=32, use_mla=False)
    part = _part(shape, (10 * 16 * 2 * 32, 16 * 2 * 32, 2 * 32, 32, 1), roles)
    with pytest.raises(LayoutError, match="not one contiguous run"):
        whole_block_bytes(part)


def test_cross_layer_view_with_a_gap_is_refused():
    # A layer's slice of a cross-layer buffer (BLHNC with 3 layers): blocks 3x apart.
    block = 2 * 16 * 64
    part = _part((10, 2, 16, 64), (3 * block, 16 * 64, 64, 1), ("block", "head", "token", "dim"))
    with pytest.raises(LayoutError, match="outermost"):
        whole_block_bytes(part)


def test_separate_k_and_v_and_mla():
    k = _part((10, 16, 2, 32), (16 * 2 * 32, 2 * 32, 32, 1), infer_roles((10, 16, 2, 32), 2, 32, False))
    assert whole_block_bytes(k) == 16 * 2 * 32 * 4
    mla = _part((10, 16, 576), (16 * 576, 576, 1), infer_roles((10, 16, 576), 1, 576, True), element_size=2)
    assert whole_block_bytes(mla) == 16 * 576 * 2


def test_unknown_shape_names_the_known_layouts():
    with pytest.raises(LayoutError, match=r"vLLM 0.32 \[blocks, heads, block, 2\*head\]"):
        infer_roles((3, 3, 3), heads=2, head_size=32, use_mla=False)
