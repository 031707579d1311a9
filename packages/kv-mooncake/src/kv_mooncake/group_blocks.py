"""Which blocks of which KV-cache group a decode pulls: one model for one group and for vLLM's hybrid
manager's several (a sliding window's group keeps only the blocks its window still needs).

Pure arithmetic on ``kv_common.kv_cache_groups``; the params (what a prefill answers), the step (what
the scheduler hands the worker) and the plan (which rank reads what) all speak it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kv_common.kv_cache_groups import KVGroup, first_needed_block


class GroupBlocks(NamedTuple):
    """The logical blocks ``[first, end)`` of one KV-cache group that a decode pulls."""

    first: int
    end: int


def plans_per_group(groups: Sequence[KVGroup]) -> bool:
    """Whether a request's blocks are planned group by group: several groups (vLLM's hybrid
    manager), or one whose blocks are not all kept (a sliding window's). One full-attention group
    (or none known) keeps the single-list plan, and its wire form."""
    return len(groups) > 1 or any(group.kind != "full" for group in groups)


def group_blocks_to_pull(groups: Sequence[KVGroup], *, num_tokens: int,
                         num_computed_tokens: int) -> list[GroupBlocks]:
    """Each KV-cache group's logical blocks a decode pulls for a request of ``num_tokens`` tokens of
    which ``num_computed_tokens`` are a local prefix-cache hit: from the first block not computed
    locally that the group still needs after ``num_tokens`` tokens (vLLM drops a sliding window's
    earlier blocks, leaving its null block there) to the block holding the last token."""
    out = []
    for group in groups:
        end = -(-num_tokens // group.block_size)
        first = max(num_computed_tokens // group.block_size, first_needed_block(num_tokens, group))
        out.append(GroupBlocks(min(first, end), end))
    return out
