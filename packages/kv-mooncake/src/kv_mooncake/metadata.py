"""Scheduler -> worker plan for one step (a msgspec Struct; wrapped by the connector's metadata)."""

from __future__ import annotations

import msgspec

from kv_mooncake.pull_plan import GroupBlocks


class RemoteSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request's KV lives: copied from the prefill's ``kv_transfer_params``."""

    engine_id: str
    host: str
    port: int  # side-channel base port of the prefill instance (its DP rank included)
    request_id: str
    block_ids: list[int]  # the first (with one group: the only) KV-cache group's
    tp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    block_ids_by_group: list[list[int]] = []  # with several KV-cache groups (HMA): each group's
    pp_size: int = 1  # pipeline stages of the prefill (kv_mooncake.pipeline_stages)

    def group_block_ids(self) -> list[list[int]]:
        """The prefill's block ids of each KV-cache group."""
        return self.block_ids_by_group or [self.block_ids]


class PullRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str  # the decode's own request id (reported in finished_recving)
    source: RemoteSource
    local_block_ids: list[list[int]]  # all blocks of the request, one list per KV-cache group
    num_blocks: int  # logical blocks covering the prompt
    skip_blocks: int  # already computed locally (prefix-cache hit): not pulled
    prompt_digest: str = ""  # this request's prompt (prompt_identity), sent with PullStarted
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
    # The prompt the blocks were computed for (prompt_identity): a reader must name the same one.
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
