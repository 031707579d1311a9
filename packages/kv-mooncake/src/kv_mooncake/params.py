"""``kv_transfer_params`` of MooncakeConnectorV1: the one model of what vLLM carries between the legs.

1. The client (or ``kv-mooncake-proxy``) sends the prefill ``{"do_remote_decode": true}``, and may
   shorten the hold with ``hold_timeout_s``.
2. The prefill scheduler's ``request_finished`` answers with ``TransferParams.to_dict()``: where the
   blocks are held and a digest of the prompt they were computed for.
3. The client passes that dict to the decode; the decode scheduler reads it once
   (``read_transfer_params``, then ``pull_problem`` against the request's prompt) and its workers
   pull from ``source()``. The proxy frees a hold nobody will pull through ``prefill_addresses()``.

The wire keys are vllm-ascend's (``remote_host``, ``remote_tp_size`` ...): clients, proxies and
configs use them, so they never change here.

Whoever reaches a decode's OpenAI API writes these params, so they are parsed once, at this edge,
into bounded values: sizes within ``MAX_PARALLEL_SIZE`` and ``MAX_PREFILL_RANKS`` (each rank costs
a FreeNow / keep-alive message), ports 1..65535 for every rank, bounded strings, block ids
0..``MAX_BLOCK_ID`` and never more than the prompt can need. A value that does not fit is refused
naming its key (the request is then computed locally; the prefill is still told to free when the
address keys themselves are valid). Keys this model does not name (vLLM adds
``remote_prefill_cached_tokens``, clients and other connectors add their own) are ignored, with a
debug line; a ``null`` counts as an absent key (vLLM's connectors and the proxy send ``null`` for
the keys they do not set).
"""

from __future__ import annotations

import logging
import reprlib
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, NamedTuple

import msgspec
from kv_common.kv_cache_groups import NULL_BLOCK_ID, KVGroup
from kv_common.logging_utils import get_logger

from kv_mooncake.group_blocks import group_blocks_to_pull, plans_per_group
from kv_mooncake.wire.connection import rank_address

logger = get_logger(__name__)

MAX_PARALLEL_SIZE = 256  # remote_tp_size / remote_pcp_size / remote_dcp_size / remote_pp_size
# remote_tp_size * remote_pcp_size * remote_pp_size: one side-channel port and message per rank
MAX_PREFILL_RANKS = 256
MAX_ID_CHARS = 4096  # remote_engine_id, remote_request_id (a request id carries the client's X-Request-Id)
MAX_HOST_CHARS = 255
MAX_BLOCK_ID = 2**31 - 1
MAX_BLOCK_IDS = 1 << 20  # before the prompt is known; then at most what the prompt needs (pull_problem)
MAX_KV_GROUPS = 64  # remote_block_ids as one list per KV-cache group (vLLM's hybrid manager)
SPARE_BLOCKS = 1  # a prefill's list may cover one block past the prompt (the slot of its one output token)

_Size = Annotated[int, msgspec.Meta(ge=1, le=MAX_PARALLEL_SIZE)]
_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
# Names and addresses only: no whitespace or control characters reach a log line or a socket.
_Host = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOST_CHARS, pattern=r"^[A-Za-z0-9._:%\[\]-]+$")]
_BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
_BlockIds = Annotated[list[_BlockId], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
# remote_block_ids: one list (one KV-cache group, vllm-ascend's form) or one list per group.
_BlockIdsOrGroups = Annotated[list[_BlockId | _BlockIds], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
_Digest = Annotated[str, msgspec.Meta(max_length=128)]

_ADDRESS_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id")
# Without any of these the prefill's ranks are unknown: nobody is told to free (the hold expires).
_RANKS_KEYS = (*_ADDRESS_KEYS, "remote_tp_size", "remote_pcp_size", "remote_pp_size")
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 40
_SHORT.maxlist = _SHORT.maxdict = 4
_SHORT.maxlevel = 2


class TransferParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    do_remote_prefill: bool = False  # to the decode: pull this request's KV from the prefill below
    do_remote_decode: bool = False  # to the prefill: keep the blocks for a decode to pull
    engine_id: _Id | None = msgspec.field(default=None, name="remote_engine_id")
    host: _Host | None = msgspec.field(default=None, name="remote_host")
    port: _Port | None = msgspec.field(default=None, name="remote_port")  # side-channel base port (DP rank included)
    block_ids: _BlockIdsOrGroups = msgspec.field(default_factory=list, name="remote_block_ids")
    request_id: _Id | None = msgspec.field(default=None, name="remote_request_id")  # the prefill's own id
    tp_size: _Size = msgspec.field(default=1, name="remote_tp_size")
    pcp_size: _Size = msgspec.field(default=1, name="remote_pcp_size")
    dcp_size: _Size = msgspec.field(default=1, name="remote_dcp_size")
    pp_size: _Size = msgspec.field(default=1, name="remote_pp_size")  # pipeline stages (pipeline_stages)
    prompt_digest: _Digest | None = None  # kv_mooncake.identity: the prompt the KV was computed for
    hold_timeout_s: float | None = None  # client -> prefill: shorten (never extend) the hold

    def __post_init__(self) -> None:
        """What one key cannot say alone. Runs on every parse (msgspec reports it as a
        ValidationError) and on the prefill's own answer."""
        ranks = self.tp_size * self.pcp_size * self.pp_size
        if ranks > MAX_PREFILL_RANKS:
            raise ValueError(f"remote_tp_size {self.tp_size} x remote_pcp_size {self.pcp_size} x remote_pp_size "
                             f"{self.pp_size} = {ranks} prefill ranks, at most {MAX_PREFILL_RANKS}")
        if self.port is not None and self.port + ranks - 1 > 65535:
            raise ValueError(f"remote_port {self.port} + {ranks} prefill ranks runs past port 65535")
        if self.dcp_size > self.tp_size:
            raise ValueError(f"remote_dcp_size {self.dcp_size} above remote_tp_size {self.tp_size} "
                             "(DCP reuses the TP ranks)")
        nested = sum(isinstance(ids, list) for ids in self.block_ids)
        if nested and nested != len(self.block_ids):
            raise ValueError("remote_block_ids mixes block ids and per-group lists")
        if nested > MAX_KV_GROUPS:
            raise ValueError(f"remote_block_ids has {nested} KV-cache groups, at most {MAX_KV_GROUPS}")
        total = sum(len(ids) for ids in self.block_ids if isinstance(ids, list))
        if total > MAX_BLOCK_IDS:
            raise ValueError(f"remote_block_ids has {total} block ids in all, at most {MAX_BLOCK_IDS}")

    def group_block_ids(self) -> list[list[int]]:
        """The prefill's block ids per KV-cache group (one list when it sent one): where the wire's two
        forms of ``remote_block_ids`` become the one the decode uses (``RemoteSource.block_ids_by_group``)."""
        if self.block_ids and isinstance(self.block_ids[0], list):
            return [list(ids) for ids in self.block_ids if isinstance(ids, list)]
        return [[b for b in self.block_ids if isinstance(b, int)]]

    def to_dict(self) -> dict[str, Any]:
        """The dict vLLM returns to the client. ``do_remote_decode`` is always present (False on the
        prefill's answer): clients written for vllm-ascend read it."""
        return {**msgspec.to_builtins(self), "do_remote_decode": self.do_remote_decode}

    def source(self) -> RemoteSource | None:
        """Where the decode pulls from; None when the params do not name a complete prefill."""
        if not (self.engine_id and self.host and self.port and self.request_id):
            return None
        return RemoteSource(engine_id=self.engine_id, host=self.host, port=self.port, request_id=self.request_id,
                            block_ids_by_group=self.group_block_ids(), tp_size=self.tp_size,
                            pcp_size=self.pcp_size, dcp_size=self.dcp_size, pp_size=self.pp_size)

    def prefill_addresses(self) -> list[str] | None:
        """Side-channel address of every rank of the prefill instance; None when the params name no
        prefill request (e.g. another connector's). Rank (tp, pcp, pp) listens on
        base + (pp * pcp_size + pcp) * tp_size + tp (``PrefillRank.index``): the ranks cover
        base .. base + tp_size * pcp_size * pp_size - 1."""
        if not (self.host and self.port and self.port > 0 and self.request_id):
            return None
        ranks = max(self.tp_size, 1) * max(self.pcp_size, 1) * max(self.pp_size, 1)
        return [rank_address(self.host, self.port, offset) for offset in range(ranks)]


class ReadParams(NamedTuple):
    params: TransferParams  # every valid value (the flags always): enough to tell a prefill to free
    problem: str | None  # the first value refused, naming its key; None when every value is valid


_WIRE_KEYS = frozenset(f.encode_name for f in msgspec.structs.fields(TransferParams))


def read_transfer_params(raw: Any) -> ReadParams | None:
    """``kv_transfer_params`` as vLLM hands them over (a dict from the client's JSON); None when there
    are none. Values are converted leniently (``"2"`` is 2) within the bounds above. A value that does
    not convert is the ``problem``; the other valid values are kept."""
    if not raw:
        return None
    if not isinstance(raw, Mapping):
        logger.warning("MooncakeConnectorV1: ignoring kv_transfer_params that are not a mapping (%s)",
                       type(raw).__name__)
        return None
    flags = {"do_remote_prefill": flag(raw, "do_remote_prefill"), "do_remote_decode": flag(raw, "do_remote_decode")}
    given = {k: v for k, v in raw.items() if k in _WIRE_KEYS and k not in flags and v is not None}
    if logger.isEnabledFor(logging.DEBUG):
        unknown = [k for k in raw if k not in _WIRE_KEYS]
        if unknown:
            logger.debug("MooncakeConnectorV1: ignoring %d kv_transfer_params keys it does not read: %s",
                         len(unknown), _SHORT.repr(unknown))
    try:
        return ReadParams(msgspec.convert({**given, **flags}, TransferParams, strict=False), None)
    except msgspec.ValidationError as exc:
        problem = str(exc)  # keys valid one by one but not together (__post_init__), unless one is refused
    valid: dict[str, Any] = {}
    refused: dict[str, str] = {}
    for key, value in given.items():
        try:
            msgspec.convert({key: value}, TransferParams, strict=False)
            valid[key] = value
        except msgspec.ValidationError as exc:
            refused[key] = f"{key}={_SHORT.repr(value)}: {exc}"
    if refused:
        first = next(iter(refused.values()))
        problem = first + (f" (and {len(refused) - 1} more keys)" if len(refused) > 1 else "")
    # The other values still name the prefill's ranks, which are then told to free the hold.
    unnamed = {k: v for k, v in valid.items() if k not in _ADDRESS_KEYS}
    for kept in ((unnamed,) if refused.keys() & set(_RANKS_KEYS) else (valid, unnamed)):
        try:
            return ReadParams(msgspec.convert({**kept, **flags}, TransferParams, strict=False), problem)
        except msgspec.ValidationError:  # valid one by one, not together: try without the address
            continue
    return ReadParams(TransferParams(do_remote_prefill=flags["do_remote_prefill"],
                                     do_remote_decode=flags["do_remote_decode"]), problem)


def parse_transfer_params(raw: Any) -> TransferParams | None:
    """The valid part of ``raw`` (see ``read_transfer_params``): what the prefill and the proxy read."""
    read = read_transfer_params(raw)
    return read.params if read is not None else None


def pull_problem(params: TransferParams, *, prompt_len: int, block_size: int,
                 groups: Sequence[KVGroup] = ()) -> str | None:
    """Why the decode must not pull for a prompt of ``prompt_len`` tokens from ``params`` (None: it may).
    A prefill's block list covers the prompt: position ``b // dcp`` holds logical block ``b``
    (``pull.plan``), so a list longer than that (plus a spare) or empty names blocks no pull reads.
    With this decode's KV-cache ``groups`` (several: vLLM's hybrid manager) the prefill sends one list
    per group, and a sliding window's list must hold real blocks (not vLLM's null block) wherever
    the window still needs them."""
    missing = [key for key, value in zip(_ADDRESS_KEYS, (params.engine_id, params.host, params.port,
                                                         params.request_id)) if not value]
    if missing:
        return f"{', '.join(missing)} missing: no prefill to pull from"
    blocks = -(-prompt_len // block_size)
    needed = -(-blocks // params.dcp_size)  # positions of the prefill's list a pull reads
    remote = params.group_block_ids()
    if len(remote) != max(1, len(groups)):
        return (f"remote_block_ids has {len(remote)} KV-cache groups, this decode has {max(1, len(groups))} "
                "(is one instance running without vLLM's hybrid KV cache manager?)")
    for g, ids in enumerate(remote):
        name = "remote_block_ids" + (f" group {g}" if len(remote) > 1 else "")
        if not ids and needed:
            return f"{name} missing or empty"
        if len(ids) > needed + SPARE_BLOCKS:
            return (f"{name} has {len(ids)} blocks, a prompt of {prompt_len} tokens in blocks "
                    f"of {block_size} (remote_dcp_size {params.dcp_size}) needs {needed}")
    if plans_per_group(groups) and params.dcp_size > 1:
        return f"remote_dcp_size {params.dcp_size} with hybrid KV-cache groups (supported: DCP 1)"
    if plans_per_group(groups):
        for g, pulled in enumerate(group_blocks_to_pull(groups, num_tokens=prompt_len, num_computed_tokens=0)):
            ids = remote[g]
            if len(ids) < pulled.end or NULL_BLOCK_ID in ids[pulled.first:pulled.end]:
                return (f"remote_block_ids group {g} ({groups[g].kind}) lacks blocks {pulled.first}..{pulled.end - 1} "
                        f"of a prompt of {prompt_len} tokens (missing, or vLLM's null block)")
    return None


def flag(raw: Any, name: str) -> bool:
    """``do_remote_prefill`` / ``do_remote_decode`` of the raw dict, by truthiness as vLLM's own
    connectors read them. The decode scheduler sets ``do_remote_prefill`` False in vLLM's dict once a
    request is decided (that dict is the request's state), so it reads this flag there, not a copy."""
    return isinstance(raw, Mapping) and bool(raw.get(name))



class RemoteSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request's KV lives: copied from the prefill's ``kv_transfer_params``. Scheduler ->
    worker only (inside ``step.MooncakeStep``); peers see ``TransferParams``' wire form, never this."""

    engine_id: str
    host: str
    port: int  # side-channel base port of the prefill instance (its DP rank included)
    request_id: str
    # The prefill's block ids of each KV-cache group, as parsed (``TransferParams.group_block_ids``):
    # one list with one group, one per group with vLLM's hybrid manager.
    block_ids_by_group: list[list[int]]
    tp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1  # pipeline stages of the prefill (kv_mooncake.pipeline_stages)
