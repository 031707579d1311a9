"""What the scheduler side tells the worker side each step, and what workers report back.

Plain msgspec structs, importable without vLLM; the vLLM wrapper types are in ``vllm_metadata``.
"""

from __future__ import annotations

import msgspec


class BlockTransfer(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Blocks of one request to load or save: ``block_hashes[i]`` lives in ``block_ids[g][i]``."""

    request_id: str
    block_hashes: list[bytes]
    block_ids: list[list[int]]  # one list per KV-cache group, aligned with block_hashes
    # With several KV-cache groups (``group_blocks``): the one group (vLLM's index) whose blocks
    # these are, ``block_ids`` then holds its one list.
    group: int = 0


class StorePlan(msgspec.Struct, kw_only=True):
    loads: list[BlockTransfer] = []
    saves: list[BlockTransfer] = []
    preempted: list[str] = []  # in-flight saves of these must finish before their blocks are reused
    idle: bool = False  # vLLM scheduled no token this step: the worker may wait for news (idle_step)


class StoreReport(msgspec.Struct, kw_only=True):
    """Worker -> scheduler: block hashes stored and found missing this step (for KV events).

    ``stored_by_tag``: rank tag -> hashes that rank stored this step. The scheduler announces a
    block only once every tag of the instance has stored it (ranks finish saves in different steps,
    and vLLM skips a rank that reports nothing when it aggregates). ``stored``: hashes stored for
    every tag at once (single-tag callers)."""

    stored: list[bytes] = []
    stored_by_tag: dict[str, list[bytes]] = {}
    removed: list[bytes] = []
