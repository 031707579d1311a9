"""The exact keys and tags the store uses, pinned: a key that changes is another block (or a block of
another rank read as ours). Written against the survivors of the mutation run (docs/mutation-report.md)."""

from __future__ import annotations

import hashlib

import pytest
from kv_store import keys


def test_namespace_is_20_hex_digits_of_the_sorted_settings():
    ns = keys.namespace({"model": "m", "block_size": 16})
    assert len(ns) == 20 and int(ns, 16) >= 0
    assert ns == keys.namespace({"block_size": 16, "model": "m"})


@pytest.mark.parametrize(("tp_rank", "tp_size"), [(0, 0), (-1, 4), (4, 4), (5, 4)])
def test_a_tp_rank_outside_its_size_is_refused(tp_rank, tp_size):
    with pytest.raises(ValueError, match="outside size"):
        keys.head_group(tp_rank, tp_size, 8)


@pytest.mark.parametrize(
    ("tp_rank", "tp_size", "heads", "group"),
    [
        (0, 1, 1, (0, 1)),
        (3, 4, 4, (3, 4)),  # one head per rank
        (3, 4, 8, (3, 4)),  # two heads per rank
        (1, 4, 0, (1, 4)),  # heads unknown: every rank its own group
        (1, 4, 1, (0, 1)),  # one head on 4 ranks: one group
        (3, 4, 2, (1, 2)),  # 2 heads on 4 ranks: ranks 2 and 3 share head 1
        (5, 8, 2, (1, 2)),
    ],
)
def test_head_groups(tp_rank, tp_size, heads, group):
    assert keys.head_group(tp_rank, tp_size, heads) == group


def test_rank_tags_spelled_out():
    assert keys.rank_tag() == "hg0of1.pcp0of1.dcp0of1"
    assert keys.rank_tag(tp_rank=3, tp_size=4) == "hg3of4.pcp0of1.dcp0of1"
    assert keys.rank_tag(tp_rank=3, tp_size=4, total_kv_heads=1) == "hg0of1.pcp0of1.dcp0of1"
    assert keys.rank_tag(pcp_rank=1, pcp_size=2, dcp_rank=1, dcp_size=2) == "hg0of1.pcp1of2.dcp1of2"
    assert keys.rank_tag(pp_rank=1, pp_size=2) == "pp1of2.hg0of1.pcp0of1.dcp0of1"
    assert keys.rank_tag(pp_rank=2, pp_size=3, use_mla=True) == "pp2of3.mla"


def test_mla_tags_name_the_token_shard_whenever_there_is_context_parallelism():
    assert keys.rank_tag(use_mla=True, tp_rank=1, tp_size=2) == "mla"
    assert keys.rank_tag(use_mla=True, pcp_rank=1, pcp_size=2) == "mla.pcp1of2.dcp0of1"
    assert keys.rank_tag(use_mla=True, dcp_rank=1, dcp_size=2) == "mla.pcp0of1.dcp1of2"
    assert keys.rank_tag(use_mla=True, pcp_size=2, dcp_size=2) == "mla.pcp0of2.dcp0of2"


@pytest.mark.parametrize(("pp_rank", "pp_size"), [(0, 0), (-1, 2), (2, 2)])
def test_a_pp_rank_outside_its_size_is_refused(pp_rank, pp_size):
    with pytest.raises(ValueError, match="pp rank"):
        keys.rank_tag(pp_rank=pp_rank, pp_size=pp_size)


def test_all_rank_tags_spelled_out():
    assert keys.all_rank_tags() == ["hg0of1.pcp0of1.dcp0of1"]
    assert keys.all_rank_tags(tp_size=2) == ["hg0of2.pcp0of1.dcp0of1", "hg1of2.pcp0of1.dcp0of1"]
    # DCP reuses the TP ranks: rank t is DCP rank t % dcp; 2 heads on 4 ranks -> head groups 0, 0, 1, 1.
    assert keys.all_rank_tags(tp_size=4, dcp_size=2, total_kv_heads=2) == [
        "hg0of2.pcp0of1.dcp0of2", "hg0of2.pcp0of1.dcp1of2", "hg1of2.pcp0of1.dcp0of2", "hg1of2.pcp0of1.dcp1of2",
    ]
    assert keys.all_rank_tags(pcp_size=2, use_mla=True) == ["mla.pcp0of2.dcp0of1", "mla.pcp1of2.dcp0of1"]
    assert keys.all_rank_tags(pp_size=2, use_mla=True) == ["pp0of2.mla", "pp1of2.mla"]
    assert keys.all_rank_tags(tp_size=4, use_mla=True) == ["mla"]


def test_the_lowest_rank_of_a_shared_tag_writes_it():
    assert keys.writes_tag(tp_rank=0)
    assert keys.writes_tag(tp_rank=1, tp_size=2)  # heads unknown: every rank its own tag
    assert not keys.writes_tag(tp_rank=1, tp_size=2, use_mla=True)
    assert keys.writes_tag(tp_rank=1, tp_size=2, dcp_size=2, use_mla=True)  # its own token shard
    assert not keys.writes_tag(tp_rank=1, tp_size=2, total_kv_heads=1)
    assert keys.writes_tag(tp_rank=1, tp_size=2, total_kv_heads=2)
    assert not keys.writes_tag(tp_rank=3, tp_size=4, total_kv_heads=2, pp_rank=1, pp_size=2)
    with pytest.raises(ValueError):
        keys.writes_tag(tp_rank=0, pp_rank=1)


class _HashWrapper:
    def __init__(self, inner):
        self.hash_value = inner


@pytest.mark.parametrize(
    ("block_hash", "hexed"),
    [
        (b"\x01\xab", "01ab"),
        (bytearray(b"\xff"), "ff"),
        (memoryview(b"\x00\x10"), "0010"),
        (5, "5"),
        (0, "0"),
        (-1, "f" * 64),  # Python's unbounded ints folded into 256 bits
        ((1 << 256) + 7, "7"),
        ((1 << 255) | 3, "8" + "0" * 62 + "3"),
        (_HashWrapper(b"\x02"), "02"),
        (_HashWrapper(17), "11"),
    ],
)
def test_hash_hex(block_hash, hexed):
    assert keys.hash_hex(block_hash) == hexed


def test_hash_hex_of_an_old_style_tuple_is_a_digest_of_its_repr():
    old = (12, (1, 2, 3))
    assert keys.hash_hex(old) == hashlib.sha256(repr(old).encode()).hexdigest()


def test_keys_spelled_out():
    assert keys.manifest_key("ns", "hg0of1") == "kv/ns/hg0of1/manifest"
    assert keys.block_key("ns", "mla", b"\x0a") == "kv/ns/mla/0a"
    assert keys.block_keys("ns", "mla", [b"\x01", 2]) == ["kv/ns/mla/01", "kv/ns/mla/2"]
    assert keys.keys_for_ranks("ns", ["a", "b"], [b"\x01", b"\x02"]) == [
        ["kv/ns/a/01", "kv/ns/a/02"], ["kv/ns/b/01", "kv/ns/b/02"],
    ]
