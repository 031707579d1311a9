"""The parallel layouts refused at start-up, each at its boundary (1 is served, 2 is refused), with the
setting named. Written against the survivors of the mutation run (docs/mutation-report.md)."""

from __future__ import annotations

import pytest
from kv_common.kv_byte_settings import KVByteSettings
from kv_mooncake.identity import unsupported_settings


def fp(pp: int = 1, dcp: int = 1, pcp: int = 1, block: int = 16, interleave: int = 1) -> KVByteSettings:
    return KVByteSettings(model="m", pipeline_parallel_size=pp, dcp_size=dcp, pcp_size=pcp, block_size=block,
                          cp_kv_cache_interleave_size=interleave)


@pytest.mark.parametrize("consumer", [False, True])
def test_the_plain_layout_is_served(consumer):
    assert unsupported_settings(fp(), is_consumer=consumer) == []


def test_pipeline_parallelism_is_refused_on_a_decode_only():
    (problem,) = unsupported_settings(fp(pp=2), is_consumer=True)
    assert problem.startswith("pipeline_parallel_size=2 on a kv_consumer:")
    assert unsupported_settings(fp(pp=2), is_consumer=False) == []


@pytest.mark.parametrize("consumer", [False, True])
def test_dcp_needs_a_block_interleave(consumer):
    (problem,) = unsupported_settings(fp(dcp=2, interleave=1), is_consumer=consumer)
    assert "cp_kv_cache_interleave_size=1 with decode_context_parallel_size=2" in problem
    assert "set cp_kv_cache_interleave_size=16" in problem
    assert unsupported_settings(fp(dcp=2, interleave=16), is_consumer=consumer) == []
    # Without DCP the interleave changes nothing.
    assert unsupported_settings(fp(dcp=1, interleave=7), is_consumer=consumer) == []


def test_pcp_with_dcp_is_refused():
    (problem,) = unsupported_settings(fp(pcp=2, dcp=2, interleave=16), is_consumer=False)
    assert problem.startswith("prefill_context_parallel_size=2 with decode_context_parallel_size=2")
    assert unsupported_settings(fp(pcp=2), is_consumer=False) == []  # PCP alone, on a producer


def test_pcp_on_a_consumer_is_refused():
    (problem,) = unsupported_settings(fp(pcp=2), is_consumer=True)
    assert problem.startswith("prefill_context_parallel_size=2 on a kv_consumer")
    assert unsupported_settings(fp(pcp=1, dcp=2, interleave=16), is_consumer=True) == []


def test_every_problem_is_listed():
    problems = unsupported_settings(fp(pp=2, pcp=2, dcp=2, interleave=1), is_consumer=True)
    assert [p.split("=")[0] for p in problems] == [
        "pipeline_parallel_size", "cp_kv_cache_interleave_size", "prefill_context_parallel_size",
        "prefill_context_parallel_size",
    ]


def test_group_layouts_are_sent_only_when_blocks_are_planned_per_group():
    from kv_common.kv_cache_groups import KVGroup
    from kv_mooncake.identity import group_layouts

    full = KVGroup(0, "full", "FullAttentionSpec", 16, ("l0",))
    window = KVGroup(1, "sliding_window", "SlidingWindowSpec", 16, ("l1",), sliding_window=32)
    assert group_layouts(()) == () and group_layouts((full,)) == ()  # what peers without hybrid support send
    layouts = group_layouts((full, window))
    assert len(layouts) == 2 and '"kind":"sliding_window"' in layouts[1] and '"kind":"full"' in layouts[0]
    # One spelling for every release: keys sorted, no spaces (a peer compares the strings).
    assert layouts[1].startswith('{"attention_chunk_size":null,"block_size":16,') and ", " not in layouts[1]


def test_verify_kv_without_xxhash_names_the_extra(monkeypatch):
    import sys

    from kv_mooncake.identity import head_digests

    monkeypatch.setitem(sys.modules, "xxhash", None)  # not installed
    with pytest.raises(ImportError, match=r"pip install 'kv-mooncake\[verify\]'"):
        head_digests(lambda layer, block, head: [], [0], 0, [0])
