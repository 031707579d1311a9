"""``kv_transfer_params`` of MooncakeConnectorV1: the one model of what vLLM carries between the legs.

1. The client (or ``kv-mooncake-proxy``) sends the prefill ``{"do_remote_decode": true}``, and may
   shorten the hold with ``hold_timeout_s``.
2. The prefill scheduler's ``request_finished`` answers with ``TransferParams.to_dict()``: where the
   blocks are held and a digest of the prompt they were computed for.
3. The client passes that dict to the decode; the decode scheduler parses it once
   (``parse_transfer_params``) and its workers pull from ``source()``. The proxy frees a hold nobody
   will pull through ``prefill_addresses()``.

The wire keys are vllm-ascend's (``remote_host``, ``remote_tp_size`` ...): clients, proxies and
configs use them, so they never change here. Keys this model does not name (vLLM adds
``remote_prefill_cached_tokens``, clients add their own) are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from kv_common.logging_utils import get_logger

from kv_mooncake.metadata import RemoteSource

logger = get_logger(__name__)


class TransferParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    do_remote_prefill: bool = False  # to the decode: pull this request's KV from the prefill below
    do_remote_decode: bool = False  # to the prefill: keep the blocks for a decode to pull
    engine_id: str | None = msgspec.field(default=None, name="remote_engine_id")
    host: str | None = msgspec.field(default=None, name="remote_host")
    port: int | None = msgspec.field(default=None, name="remote_port")  # side-channel base port (DP rank included)
    block_ids: list[int] = msgspec.field(default_factory=list, name="remote_block_ids")
    request_id: str | None = msgspec.field(default=None, name="remote_request_id")  # the prefill's own id
    tp_size: int = msgspec.field(default=1, name="remote_tp_size")
    pcp_size: int = msgspec.field(default=1, name="remote_pcp_size")
    dcp_size: int = msgspec.field(default=1, name="remote_dcp_size")
    prompt_digest: str | None = None  # kv_mooncake.prompt_identity: the prompt the KV was computed for
    hold_timeout_s: float | None = None  # client -> prefill: shorten (never extend) the hold

    def to_dict(self) -> dict[str, Any]:
        """The dict vLLM returns to the client. ``do_remote_decode`` is always present (False on the
        prefill's answer): clients written for vllm-ascend read it."""
        return {**msgspec.to_builtins(self), "do_remote_decode": self.do_remote_decode}

    def source(self) -> RemoteSource | None:
        """Where the decode pulls from; None when the params do not name a complete prefill."""
        if not (self.engine_id and self.host and self.port and self.request_id):
            return None
        return RemoteSource(engine_id=self.engine_id, host=self.host, port=self.port, request_id=self.request_id,
                            block_ids=list(self.block_ids), tp_size=self.tp_size, pcp_size=self.pcp_size,
                            dcp_size=self.dcp_size)

    def prefill_addresses(self) -> list[str] | None:
        """Side-channel address of every rank of the prefill instance; None when the params name no
        prefill request (e.g. another connector's). Rank (tp, pcp) listens on base + pcp * tp_size + tp
        (``PrefillRank.index``): the ranks cover base .. base + tp_size * pcp_size - 1."""
        if not (self.host and self.port and self.port > 0 and self.request_id):
            return None
        return [f"{self.host}:{self.port + offset}" for offset in range(max(self.tp_size, 1) * max(self.pcp_size, 1))]


def parse_transfer_params(raw: Any) -> TransferParams | None:
    """``kv_transfer_params`` as vLLM hands them over (a dict from the client's JSON); None when there
    are none. Values are converted leniently (``"2"`` is 2). A value that does not convert is logged
    and, as before this model, only the two flags count: the request names no usable prefill, so
    nothing is pulled from or freed on one."""
    if not raw:
        return None
    if not isinstance(raw, Mapping):
        logger.warning("MooncakeConnectorV1: ignoring kv_transfer_params that are not a mapping: %r", raw)
        return None
    flags = TransferParams(do_remote_prefill=flag(raw, "do_remote_prefill"),
                           do_remote_decode=flag(raw, "do_remote_decode"))
    try:
        return msgspec.convert({**raw, "do_remote_prefill": flags.do_remote_prefill,
                                "do_remote_decode": flags.do_remote_decode}, TransferParams, strict=False)
    except (msgspec.ValidationError, TypeError) as exc:
        logger.warning("MooncakeConnectorV1: invalid kv_transfer_params (%s): %s", exc, raw)
        return flags


def flag(raw: Any, name: str) -> bool:
    """``do_remote_prefill`` / ``do_remote_decode`` of the raw dict, by truthiness as vLLM's own
    connectors read them. The decode scheduler sets ``do_remote_prefill`` False in vLLM's dict once a
    request is decided (that dict is the request's state), so it reads this flag there, not a copy."""
    return isinstance(raw, Mapping) and bool(raw.get(name))
