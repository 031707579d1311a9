"""Scheduler -> worker plan for one step (a msgspec Struct; wrapped by the connector's metadata)."""

from __future__ import annotations

import msgspec

from kv_mooncake.params import GroupBlocks, RemoteSource


class PullRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str  # the decode's own request id (reported in finished_recving)
    source: RemoteSource
    local_block_ids: list[list[int]]  # all blocks of the request, one list per KV-cache group
    num_blocks: int  # logical blocks covering the prompt
    skip_blocks: int  # already computed locally (prefix-cache hit): not pulled
    prompt_digest: str = ""  # this request's prompt (identity), sent with PullStarted
    # With several KV-cache groups: each group's logical blocks to pull, [first, end) (a sliding
    # window's group starts where its window does). Empty: one group, [skip_blocks, num_blocks).
    group_blocks: list[tuple[int, int]] = []

    def blocks_by_group(self) -> list[GroupBlocks]:
        if self.group_blocks:
            return [GroupBlocks(first, end) for first, end in self.group_blocks]
        return [GroupBlocks(max(0, self.skip_blocks), self.num_blocks)]


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
