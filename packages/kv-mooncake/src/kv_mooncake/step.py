"""Scheduler -> worker plan for one step (a msgspec Struct; wrapped by the connector's metadata)."""

from __future__ import annotations

import msgspec

from kv_mooncake.group_blocks import GroupBlocks
from kv_mooncake.params import RemoteSource


class PullRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str  # the decode's own request id (reported in finished_recving)
    source: RemoteSource
    local_block_ids: list[list[int]]  # all blocks of the request, one list per KV-cache group
    # Each KV-cache group's logical blocks to pull, [first, end), one entry per group (one with one
    # group): from the first block not computed locally (prefix-cache hit), or where a sliding
    # window's group still needs them, to the block holding the prompt's last token.
    blocks_by_group: list[GroupBlocks]
    prompt_digest: str = ""  # this request's prompt (identity), sent with PullStarted
    # The blocks are planned group by group (params.plans_per_group: vLLM's hybrid manager or a
    # sliding window), where vLLM's null block stands for dropped ones: the worker checks that no
    # block it pulls is that one, on either side (pull.byte_ranges.no_null_blocks).
    check_null_blocks: bool = False


class HoldRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    num_blocks: int
    block_ids: list[int] = []  # the only blocks a reader may read for this request
    ttl_s: float | None = None  # per-request hold timeout (never above the configured one)
    # The prompt the blocks were computed for (identity): a reader must name the same one.
    # None: not checked (holds made without a scheduler); "": no reader may read (unverifiable).
    prompt_digest: str | None = None


class MooncakeStep(msgspec.Struct, kw_only=True):
    pulls: list[PullRequest] = []
    holds: list[HoldRequest] = []  # prefill: finished requests whose blocks wait for readers
    frees: list[RemoteSource] = []  # decode: tell the prefill to free (nothing will be pulled)
    keepalives: list[RemoteSource] = []  # decode: accepted, not pulled yet: keep the hold alive
    idle: bool = False  # vLLM scheduled no token this step: the worker may wait for news (idle_step)

    def is_empty(self) -> bool:
        return not (self.pulls or self.holds or self.frees or self.keepalives)
