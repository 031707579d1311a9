"""Store keys for KV blocks. Pure functions: no vLLM, no torch.

A key names one block of one rank's KV cache::

    kv/<namespace>/<rank tag>/<block hash hex>

- the block hash is vLLM's (``Request.block_hashes``): each hash already chains its parent, so a
  key identifies the whole prefix up to and including its block;
- the namespace is a digest of everything two instances must agree on before they may exchange a
  block (model, dtype, KV-cache dtype, block size, layout, parallel sizes, hash algorithm);
- the rank tag says which slice of the heads and tokens the value holds. MLA caches are identical
  on every rank, so they get one copy (tag ``mla``). When TP is larger than the number of KV heads,
  ranks holding the same replicated heads share one copy (their head group). Context parallelism
  shards tokens: each (pcp, dcp) shard has its own tag. DCP reuses the TP ranks as in vLLM (TP rank
  ``t`` is DCP rank ``t % dcp``).
- pipeline parallelism: each PP stage holds other layers, so each stage has its own tags
  (``pp<stage>of<size>.`` in front; nothing without PP). The namespace covers the whole model's
  layer count and vLLM's layer split, so a tag always names the same layers.
- several KV-cache groups (vLLM's hybrid manager: sliding-window and full-attention layers): each
  group's blocks are values of their own, under the rank tag plus ``.g<group>`` (``group_blocks``);
  the group layouts are in the namespace. One group: no suffix, the keys of before.
- of the ranks that share a tag, only the lowest TP rank writes it (:func:`writes_tag`): the others
  hold the same bytes.
- each tag also holds a layout manifest (``kv/<namespace>/<rank tag>/manifest``, see
  ``manifest``) that every worker checks at start-up: it covers what the digest cannot (the
  worker's tensor layout, the kernel block size) and a namespace pinned by name (config
  ``namespace``), which bypasses the digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

KEY_PREFIX = "kv"


def namespace(fingerprint: Mapping[str, Any]) -> str:
    """Digest of a model/layout fingerprint (order-independent)."""
    text = repr(sorted((str(k), repr(v)) for k, v in fingerprint.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def head_group(tp_rank: int, tp_size: int, total_kv_heads: int) -> tuple[int, int]:
    """(group, number of groups): ranks in one group hold the same KV heads."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp rank {tp_rank} outside size {tp_size}")
    if total_kv_heads <= 0 or tp_size <= total_kv_heads:
        return tp_rank, tp_size
    # More ranks than heads: vLLM replicates each head on tp_size // total_kv_heads ranks.
    per_head = tp_size // total_kv_heads
    return tp_rank // per_head, total_kv_heads


def rank_tag(
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pcp_rank: int = 0,
    pcp_size: int = 1,
    dcp_rank: int = 0,
    dcp_size: int = 1,
    use_mla: bool = False,
    total_kv_heads: int = 0,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> str:
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp rank {pp_rank} outside size {pp_size}")
    stage = f"pp{pp_rank}of{pp_size}." if pp_size > 1 else ""
    shard = f"pcp{pcp_rank}of{pcp_size}.dcp{dcp_rank}of{dcp_size}"
    if use_mla:
        # One latent copy per token shard (plain "mla" without context parallelism).
        return stage + ("mla" if pcp_size == dcp_size == 1 else f"mla.{shard}")
    group, groups = head_group(tp_rank, tp_size, total_kv_heads)
    return f"{stage}hg{group}of{groups}.{shard}"


def _tags_by_tp_rank(
    *, tp_size: int, pcp_rank: int, pcp_size: int, dcp_size: int, use_mla: bool, total_kv_heads: int,
    pp_rank: int, pp_size: int,
) -> list[str]:
    return [
        rank_tag(tp_rank=tp, tp_size=tp_size, pcp_rank=pcp_rank, pcp_size=pcp_size, dcp_rank=tp % dcp_size,
                 dcp_size=dcp_size, use_mla=use_mla, total_kv_heads=total_kv_heads, pp_rank=pp_rank,
                 pp_size=pp_size)
        for tp in range(tp_size)
    ]


def all_rank_tags(
    *, tp_size: int = 1, pcp_size: int = 1, dcp_size: int = 1, use_mla: bool = False, total_kv_heads: int = 0,
    pp_size: int = 1,
) -> list[str]:
    """Every distinct tag of one instance: a block is usable only when all of them are stored."""
    tags: dict[str, None] = {}
    for pp in range(pp_size):
        for pcp in range(pcp_size):
            for tag in _tags_by_tp_rank(tp_size=tp_size, pcp_rank=pcp, pcp_size=pcp_size, dcp_size=dcp_size,
                                        use_mla=use_mla, total_kv_heads=total_kv_heads, pp_rank=pp,
                                        pp_size=pp_size):
                tags[tag] = None
    return list(tags)


def writes_tag(
    *,
    tp_rank: int,
    tp_size: int = 1,
    pcp_rank: int = 0,
    pcp_size: int = 1,
    dcp_size: int = 1,
    use_mla: bool = False,
    total_kv_heads: int = 0,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> bool:
    """Whether this rank saves its tag: only the lowest TP rank of those holding the same bytes."""
    tags = _tags_by_tp_rank(tp_size=tp_size, pcp_rank=pcp_rank, pcp_size=pcp_size, dcp_size=dcp_size,
                            use_mla=use_mla, total_kv_heads=total_kv_heads, pp_rank=pp_rank, pp_size=pp_size)
    return tags.index(tags[tp_rank]) == tp_rank


def hash_hex(block_hash: Any) -> str:
    """vLLM block hashes are bytes; older versions used ints or (hash, tokens) tuples."""
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return bytes(block_hash).hex()
    if isinstance(block_hash, int):
        return format(block_hash & ((1 << 256) - 1), "x")
    inner = getattr(block_hash, "hash_value", None)
    if inner is not None:
        return hash_hex(inner)
    return hashlib.sha256(repr(block_hash).encode()).hexdigest()


def manifest_key(ns: str, tag: str) -> str:
    """The reserved key of a tag's layout manifest: a block key ends in a hex hash, never in this."""
    return f"{KEY_PREFIX}/{ns}/{tag}/manifest"


def block_key(ns: str, tag: str, block_hash: Any) -> str:
    return f"{KEY_PREFIX}/{ns}/{tag}/{hash_hex(block_hash)}"


def block_keys(ns: str, tag: str, block_hashes: Iterable[Any]) -> list[str]:
    return [block_key(ns, tag, h) for h in block_hashes]


def keys_for_ranks(ns: str, tags: Sequence[str], block_hashes: Sequence[Any]) -> list[list[str]]:
    """One key list per rank tag, each aligned with ``block_hashes``."""
    return [block_keys(ns, tag, block_hashes) for tag in tags]
