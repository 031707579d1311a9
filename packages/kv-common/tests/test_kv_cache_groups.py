"""kv_cache_groups against vLLM's real spec classes and its own managers' skipping rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
managers = pytest.importorskip("vllm.v1.core.single_type_kv_cache_manager")

from kv_common.kv_cache_groups import (  # noqa: E402
    CHUNKED_LOCAL,
    FULL,
    SLIDING_WINDOW,
    STATE,
    UnsupportedKVGroup,
    first_needed_block,
    kv_groups,
    refuse_state_groups,
    skipped_tokens,
)


def _attn(cls, **extra):
    return cls(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, **extra)


def _config(*specs, transfer=None):
    groups = [
        kvi.KVCacheGroupSpec(layer_names=[f"model.layers.{i}.attn"], kv_cache_spec=spec,
                             enable_kv_transfer=True if transfer is None else transfer[i])
        for i, spec in enumerate(specs)
    ]
    return kvi.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_kinds_of_vllms_specs() -> None:
    mamba = kvi.MambaSpec(block_size=16, shapes=((2, 4),), dtypes=(torch.float32,))
    config = _config(_attn(kvi.FullAttentionSpec), _attn(kvi.SlidingWindowSpec, sliding_window=128),
                     _attn(kvi.ChunkedLocalAttentionSpec, attention_chunk_size=64), mamba)
    groups = kv_groups(config)
    assert [g.kind for g in groups] == [FULL, SLIDING_WINDOW, CHUNKED_LOCAL, STATE]
    assert groups[1].sliding_window == 128 and groups[1].block_size == 16
    assert groups[1].describe()["layers"] == ["model.layers.1.attn"]
    with pytest.raises(UnsupportedKVGroup, match=r"group 3 \(state: vLLM MambaSpec, layers model.layers.3.attn"):
        refuse_state_groups(groups, "SomeConnector")
    refuse_state_groups(groups[:3], "SomeConnector")


def test_groups_vllm_does_not_transfer_are_left_out() -> None:
    config = _config(_attn(kvi.FullAttentionSpec), _attn(kvi.FullAttentionSpec), transfer=[True, False])
    assert [g.index for g in kv_groups(config)] == [0]
    assert kv_groups(SimpleNamespace()) == ()


@pytest.mark.parametrize("window,extra", [(128, 0), (4, 0), (17, 3)])
def test_skipped_tokens_follow_vllms_sliding_window_manager(window: int, extra: int) -> None:
    spec = _attn(kvi.SlidingWindowSpec, sliding_window=window, extra_retained_tokens=extra)
    (group,) = kv_groups(_config(spec))
    vllm_rule = SimpleNamespace(sliding_window=window, extra_retained_tokens=extra)
    for n in range(0, 400, 7):
        expected = managers.SlidingWindowManager.get_num_skipped_tokens(vllm_rule, n)
        assert skipped_tokens(n, group) == expected
        assert first_needed_block(n, group) == expected // 16


def test_chunked_local_and_full() -> None:
    chunked, full = kv_groups(_config(_attn(kvi.ChunkedLocalAttentionSpec, attention_chunk_size=8),
                                      _attn(kvi.FullAttentionSpec)))
    vllm_rule = SimpleNamespace(attention_chunk_size=8)
    for n in (0, 7, 8, 13, 100):
        assert skipped_tokens(n, chunked) == managers.ChunkedLocalAttentionManager.get_num_skipped_tokens(vllm_rule, n)
        assert skipped_tokens(n, full) == 0 and first_needed_block(n, full) == 0
