"""Scheduler -> worker plan for one step (a msgspec Struct; wrapped by the connector's metadata)."""

from __future__ import annotations

import msgspec


class RemoteSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request's KV lives: copied from the prefill's ``kv_transfer_params``."""

    engine_id: str
    host: str
    port: int  # side-channel base port of the prefill instance (its DP rank included)
    request_id: str
    block_ids: list[int]
    tp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1  # pipeline stages of the prefill (kv_mooncake.pipeline_stages)


class PullRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str  # the decode's own request id (reported in finished_recving)
    source: RemoteSource
    local_block_ids: list[list[int]]  # all blocks of the request, one list per KV-cache group
    num_blocks: int  # logical blocks covering the prompt
    skip_blocks: int  # already computed locally (prefix-cache hit): not pulled
    prompt_digest: str = ""  # this request's prompt (prompt_identity), sent with PullStarted


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

    def is_empty(self) -> bool:
        return not (self.pulls or self.holds or self.frees or self.keepalives)
