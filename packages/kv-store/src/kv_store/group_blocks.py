"""Which blocks of each KV-cache group a store hit, a load and a save cover. Pure functions.

With vLLM's hybrid KV-cache manager a request has one block table per KV-cache group. A stored
value holds one block of one group (its layers, then the trailer), under the group's own rank tag
(:func:`group_tag`). A full-attention group keeps every block of a request; a sliding-window (or
chunked-local) group keeps only the blocks its window still reads, and vLLM's null block (id 0)
stands in for the others (``kv_common.kv_cache_groups.first_needed_block``).

- A hit of ``end`` blocks (``end * block_size`` tokens) needs every block of a full group up to
  ``end`` and, of a windowed group, the blocks from ``first_needed_block(end * block_size)``.
  That is exactly what vLLM allocates for external tokens in a windowed group
  (``SingleTypeKVCacheManager.add_local_computed_blocks`` pads the skipped blocks with the null
  block, ``allocate_external_computed_blocks`` allocates the rest).
- Blocks below the local hit (``first``) are vLLM's own prefix-cache blocks: never loaded.
- A save runs in the step that computed the blocks; a windowed group saves only the blocks vLLM
  still held when the step was allocated (``first_needed_block`` of the tokens computed before the
  step): earlier ones were freed, possibly to another request, and would store stale KV.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_common.kv_cache_groups import FULL, NULL_BLOCK_ID, KVGroup, first_needed_block

__all__ = ["NULL_BLOCK_ID", "event_groups", "group_tag", "hit_blocks", "hit_range", "lookup_range", "save_range"]


def group_tag(rank_tag: str, group: KVGroup, num_groups: int) -> str:
    """The rank tag of one group's values: the rank's own tag when there is one group (the keys of
    a single-group instance stay as they were)."""
    return rank_tag if num_groups <= 1 else f"{rank_tag}.g{group.index}"


def hit_range(group: KVGroup, first: int, end: int, block_size: int) -> tuple[int, int]:
    """Blocks ``[lo, end)`` of ``group`` a hit of ``end`` blocks loads beyond a local hit of ``first``."""
    return max(first, first_needed_block(end * block_size, group)), end


def lookup_range(group: KVGroup, first: int, end: int, block_size: int) -> tuple[int, int]:
    """Blocks of ``group`` any hit from ``first + 1`` to ``end`` blocks could need (to ask the store
    about once)."""
    return hit_range(group, first, first + 1, block_size)[0], end


def hit_blocks(groups: Sequence[KVGroup], present: Sequence[Sequence[bool]], first: int, end: int,
               block_size: int) -> int:
    """Blocks beyond ``first`` a hit can load: the largest ``m - first`` (``first < m <= end``) such
    that every group has every block of its ``hit_range(first, m)``. ``present[g][k - first]``:
    block ``k`` of ``groups[g]`` is in the store (for every rank), for ``k`` in ``[first, end)``."""
    for m in range(end, first, -1):
        if all(all(present[g][k - first] for k in range(*hit_range(group, first, m, block_size)))
               for g, group in enumerate(groups)):
            return m - first
    return 0


def save_range(group: KVGroup, start: int, full: int, computed_before: int) -> tuple[int, int]:
    """Blocks ``[lo, full)`` of ``group`` a save of blocks ``[start, full)`` may read in a step that
    began with ``computed_before`` tokens computed."""
    return max(start, first_needed_block(computed_before, group)), full


def event_groups(groups: Sequence[KVGroup]) -> list[KVGroup]:
    """The groups that store every block of a prefix (full attention): a block is announced once
    they all stored it. A model with none announces by every group."""
    full = [g for g in groups if g.kind == FULL]
    return full or list(groups)
