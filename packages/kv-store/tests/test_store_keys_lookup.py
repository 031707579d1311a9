from hypothesis import given, settings
from hypothesis import strategies as st
from kv_store import keys, lookup


def test_keys_depend_on_namespace_rank_and_hash():
    ns1 = keys.namespace({"model": "m", "dtype": "float32", "block_size": 16})
    ns2 = keys.namespace({"model": "m", "dtype": "bfloat16", "block_size": 16})
    assert ns1 != ns2
    assert ns1 == keys.namespace({"block_size": 16, "dtype": "float32", "model": "m"})
    h = b"\x01" * 32
    assert keys.block_key(ns1, "a", h) != keys.block_key(ns2, "a", h)
    assert keys.block_key(ns1, "a", h) != keys.block_key(ns1, "b", h)
    assert keys.block_key(ns1, "a", h).endswith(h.hex())


def test_mla_stores_one_copy():
    assert keys.all_rank_tags(tp_size=4, use_mla=True) == ["mla"]
    assert len(keys.all_rank_tags(tp_size=4, total_kv_heads=8)) == 4
    # DCP reuses the TP ranks: TP 4 over 2 KV heads, DCP 2 -> 2 head groups x 2 token shards.
    assert len(keys.all_rank_tags(tp_size=4, dcp_size=2, total_kv_heads=2)) == 4


def test_mla_with_context_parallel_keeps_one_copy_per_token_shard():
    tags = keys.all_rank_tags(tp_size=4, dcp_size=2, use_mla=True)
    assert len(tags) == 2 and all(t.startswith("mla.") for t in tags)
    assert len(keys.all_rank_tags(tp_size=2, pcp_size=2, dcp_size=2, use_mla=True)) == 4


@settings(deadline=None)
@given(st.integers(1, 16), st.sampled_from([1, 2, 4, 8, 16, 32]), st.sampled_from([1, 2, 4]),
       st.integers(1, 2), st.booleans())
def test_exactly_one_writer_per_tag(tp_size, heads, dcp, pcp, use_mla):
    if tp_size % dcp:
        return
    writers: dict[str, list[int]] = {}
    for p in range(pcp):
        for t in range(tp_size):
            tag = keys.rank_tag(tp_rank=t, tp_size=tp_size, pcp_rank=p, pcp_size=pcp, dcp_rank=t % dcp,
                                dcp_size=dcp, use_mla=use_mla, total_kv_heads=heads)
            if keys.writes_tag(tp_rank=t, tp_size=tp_size, pcp_rank=p, pcp_size=pcp, dcp_size=dcp,
                               use_mla=use_mla, total_kv_heads=heads):
                writers.setdefault(tag, []).append(t)
    all_tags = keys.all_rank_tags(tp_size=tp_size, pcp_size=pcp, dcp_size=dcp, use_mla=use_mla,
                                  total_kv_heads=heads)
    assert sorted(writers) == sorted(all_tags)  # every tag has a writer ...
    assert all(len(w) == 1 for w in writers.values())  # ... and only one


@settings(deadline=None)
@given(st.integers(1, 64), st.integers(1, 16))
def test_head_groups_share_replicated_heads(tp_size, heads):
    tags = [keys.rank_tag(tp_rank=r, tp_size=tp_size, total_kv_heads=heads) for r in range(tp_size)]
    assert len(set(tags)) == min(tp_size, heads) or tp_size % heads != 0


@settings(deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=1, max_size=4))
def test_leading_present_is_the_common_prefix(present):
    n = lookup.leading_present(present)
    assert all(all(row[:n]) for row in present)
    assert n == 5 or not all(row[n] for row in present)


@settings(deadline=None)
@given(st.integers(0, 5000), st.integers(0, 400), st.sampled_from([16, 32, 128]))
def test_loadable_blocks_leave_a_token_and_skip_partial(num_tokens, num_hashes, block_size):
    n = lookup.loadable_blocks(num_tokens, num_hashes, block_size)
    assert 0 <= n <= num_hashes
    assert n * block_size < max(num_tokens, 1)
    assert n * block_size <= num_tokens
    if num_tokens % block_size and num_hashes >= num_tokens // block_size:
        assert n == num_tokens // block_size  # partial last block skipped, nothing else


def test_full_hit_keeps_last_block_to_compute():
    assert lookup.loadable_blocks(64, 4, 16) == 3
    assert lookup.loadable_blocks(65, 4, 16) == 4
    assert lookup.external_tokens(16, 1, 2, 16) == 32
    assert lookup.external_tokens(16, 1, 0, 16) == 0
