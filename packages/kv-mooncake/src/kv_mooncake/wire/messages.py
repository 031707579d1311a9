"""Side-channel messages between a decode worker (client) and a prefill worker (server).

msgpack-encoded msgspec Structs (tagged unions, size-limited by kv_mooncake.wire.client); never pickle.

Flow for one request and one (decode rank, prefill rank) pair::

    Handshake  -> HandshakeReply | Refused      (cached per peer rank until its boot id changes)
    PullStarted-> Ack | Refused                  (takes a lease: blocks cannot be freed under the read;
                                                  sent with the read, its answer awaited once the
                                                  first batch landed: ``pull.lease``)
    LeaseRenew -> Ack | Refused                  (long pulls)
    PullDone   -> PullDoneReply                  (always sent, also after a failed read; says whether
                                                  the lease held throughout: else the read is void)
    FreeNow    -> Ack                            (ranks nobody reads from; aborted decode requests)
    HoldKeepAlive -> Ack | Refused               (decode accepted the request, no pull yet: keep the hold)
"""

from __future__ import annotations

from typing import Union

import msgspec

from kv_mooncake.errors import ProtocolMismatch

# Bump when a message changes meaning or shape in a way the other side cannot ignore: the handshake
# then refuses a peer of another version by name instead of misreading it.
# 2: PullDoneReply, PullStarted.prompt_digest, boot ids (issue 23).
# 3: every message in the envelope [version, message] (``MessageCodec``), read version first.
PROTOCOL_VERSION = 3
# What a peer that sends no version speaks: the releases before the version was sent spoke 1.
UNVERSIONED = 1


class Compatibility(msgspec.Struct, frozen=True, kw_only=True):
    """What two instances must agree on before blocks move between them: every setting that changes
    which bytes a block id names or how they decode. Compared field by field at the handshake."""

    model: str
    dtype: str  # the KV tensor's element type (torch name)
    block_size: int  # logical (scheduler) tokens per block on one rank: what block ids count
    head_size: int
    num_layers: int
    total_kv_heads: int
    use_mla: bool
    layout: str = "cpu:[blocks,heads,block_size,2*head_size]"  # KV layout and stride order
    revision: str = ""
    # Digest of the weights (kv_common.model_identity): the same path may hold another checkpoint.
    # "" from a peer of an earlier release: it differs from any digest, so such a pull is refused.
    model_weights: str = ""
    quantization: str = ""
    model_dtype: str = ""
    cache_dtype: str = ""  # by name: fp8_e4m3 and fp8_e5m2 are both uint8 tensors
    kernel_block_size: int = 0  # tokens per block in the tensor (vLLM may split a logical block)
    pipeline_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 0  # as this instance lays out context-parallel tokens
    # The side-channel protocol this instance speaks (vLLM's NIXL folds its connector version into
    # its compatibility hash likewise). Missing on the wire: a release from before versioning.
    protocol_version: int = UNVERSIONED
    # vLLM's KV-cache groups (fingerprint.group_layouts): () for one full-attention group.
    kv_groups: tuple[str, ...] = ()

    def differences(self, other: Compatibility, mine: str = "decode", theirs: str = "prefill") -> list[str]:
        """One line per differing setting, naming it and both values. Peers of two protocol versions
        get that line alone: the other fields may not mean the same to both."""
        if self.protocol_version != other.protocol_version:
            return [f"{theirs} speaks kv-mooncake protocol {other.protocol_version}, "
                    f"this {mine} {self.protocol_version}"]
        return [
            f"{name}: {mine} {getattr(self, name)!r}, {theirs} {getattr(other, name)!r}"
            for name in self.__struct_fields__
            if name != "kv_groups" and getattr(self, name) != getattr(other, name)
        ] + group_differences(self.kv_groups, other.kv_groups, mine, theirs)


def group_differences(mine_groups: tuple[str, ...], their_groups: tuple[str, ...], mine: str,
                      theirs: str) -> list[str]:
    """The KV-cache groups that differ, one line each, naming the group and both layouts."""
    if len(mine_groups) != len(their_groups):
        return [f"kv_groups: {mine} {len(mine_groups) or 1} KV-cache groups {list(mine_groups) or '(one, full attention)'}, "
                f"{theirs} {len(their_groups) or 1} {list(their_groups) or '(one, full attention)'}"]
    return [f"kv_groups: group {i}: {mine} {a}, {theirs} {b}"
            for i, (a, b) in enumerate(zip(mine_groups, their_groups)) if a != b]


class Handshake(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    engine_id: str  # the engine the decode believes it talks to
    compatibility: Compatibility
    reader_id: str


class PartInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One KV tensor of a layer (``kv_common.kv_layout.KVPart``): where it is and how its bytes are laid out."""

    base: int
    shape: list[int]
    strides: list[int]  # elements
    element_size: int
    roles: list[str]


class HandshakeReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    engine_id: str
    te_address: str  # "host:rpc_port" of the prefill rank's TransferEngine
    layer_names: list[str]
    base_addresses: list[int]  # per layer, same order as layer_names
    block_bytes: list[int]  # bytes of one block, per layer
    num_blocks: int
    heads_on_rank: int
    compatibility: Compatibility
    # The prefill instance's own parallel sizes: the decode plans from kv_transfer_params and
    # refuses to pull when they differ (a stale or forged params would read the wrong ranks).
    tp_size: int = 0
    pcp_size: int = 0
    dcp_size: int = 0
    # Its pipeline stage: the decode pulls from it exactly the layers the stage's range gives it, and
    # checks ``layer_names`` against them (kv_mooncake.pipeline_stages). 0: a peer from before PP (1 stage).
    pp_size: int = 0
    pp_rank: int = 0
    kernel_blocks_per_block: int = 1
    parts: list[list[PartInfo]] = []  # per layer (same order as layer_names): its KV tensors
    # New at every start of the prefill worker, echoed by its Ack to PullStarted: a reader whose
    # cached handshake names another boot (a restart with a pinned engine_id) handshakes again.
    boot_id: str = ""


class PullStarted(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    request_id: str
    reader_id: str
    expected_readers: int  # decode ranks that will pull from this prefill rank (same for all)
    # Remote block ids this reader will read; the prefill refuses ids it does not hold for the
    # request (a stale or malicious reader must not be handed other requests' blocks).
    block_ids: list[int] = []
    # The reader's digest of its prompt (kv_mooncake.identity): the prefill refuses a reader
    # of another prompt (forged kv_transfer_params pass the decode's own check).
    prompt_digest: str = ""


class LeaseRenew(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    request_id: str
    reader_id: str


class PullDone(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    request_id: str
    reader_id: str
    ok: bool
    expected_readers: int = 1


class FreeNow(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    request_id: str
    reader_id: str = ""


class HoldKeepAlive(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The decode accepted this request and will pull it (it waits for blocks or a pull thread)."""

    request_id: str
    reader_id: str = ""


class LeakQuery(msgspec.Struct, tag=True, frozen=True):
    """Tests and operators: what does this worker still hold?"""


class Ack(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    # verify_kv, reply to PullStarted: xxh3-64 per (requested block id in order, head of this rank)
    digests: list[int] = []
    boot_id: str = ""  # reply to PullStarted: the prefill worker's boot (HandshakeReply.boot_id)
    # Reply to PullStarted: how long this rank has held these very blocks for the request (-1:
    # unknown, a peer of an earlier release). A reader that read before its lease was granted counts
    # that read only if the blocks were held since before it began (``pull.lease``).
    held_for_s: float = -1.0


class PullDoneReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Whether the reader's lease on the request's blocks held from its PullStarted to this DONE. If
    not, the blocks may have been freed and reused under the read: what was read is not the request's."""

    held_throughout: bool = False


class Refused(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    reason: str
    retry: bool = False  # the request is not held *yet*: ask again shortly


class LeakReport(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    held_blocks: int
    held_requests: int
    pending_pulls: int
    active_reads: int = 0  # prefill: readers holding a current lease


REQUEST_TYPES = (Handshake, PullStarted, LeaseRenew, PullDone, FreeNow, HoldKeepAlive, LeakQuery)
REPLY_TYPES = (HandshakeReply, Ack, PullDoneReply, Refused, LeakReport)


class ErrorReply(msgspec.Struct, tag=True, frozen=True):
    """What the server answers when it cannot (or would not) handle a request."""

    message: str


# The text of the refusal a peer of another protocol version gets (bare, so that any version reads it).
PROTOCOL_MISMATCH = "kv-mooncake side-channel protocol mismatch"


def _decoder(types: tuple[type, ...], *, with_error: bool) -> msgspec.msgpack.Decoder:
    all_types = (*types, ErrorReply) if with_error else tuple(types)
    if not all_types or not all(isinstance(t, type) and issubclass(t, msgspec.Struct) for t in all_types):
        raise TypeError(f"side channel messages must be msgspec Structs, got {types!r}")
    if len(all_types) > 1:
        untagged = [t.__name__ for t in all_types if t.__struct_config__.tag is None]  # type: ignore[attr-defined]
        if untagged:
            raise TypeError(f"side channel Structs must be declared with tag=True: {', '.join(untagged)}")
    return msgspec.msgpack.Decoder(Union[all_types] if len(all_types) > 1 else all_types[0])


_ENVELOPE = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])
_ENCODER = msgspec.msgpack.Encoder()
_BARE_ERROR = msgspec.msgpack.Decoder(ErrorReply)


class MessageCodec:
    """Every message on the side channel is the envelope ``[protocol version, message]``, read in two
    steps as vLLM's NIXL reads its handshake: the version first, the message only when the version
    is ours. A peer of another version is then refused by name, never decoded as something it is not
    (a field that changed meaning would otherwise decode without a murmur)."""

    def __init__(self, types: tuple[type, ...], *, with_error: bool):
        self._body = _decoder(types, with_error=with_error)

    @staticmethod
    def encode(message: msgspec.Struct) -> bytes:
        return _ENCODER.encode((PROTOCOL_VERSION, message))

    def decode(self, payload: bytes) -> msgspec.Struct:
        """The message; ``ProtocolMismatch`` when the envelope is another version's or missing;
        msgspec's errors when the bytes are not msgpack or the body not one of the expected messages."""
        return self._body.decode(open_envelope(payload))


def open_envelope(payload: bytes) -> msgspec.Raw:
    """The message inside ``payload`` once its version is ours."""
    try:
        version, body = _ENVELOPE.decode(payload)
    except msgspec.ValidationError:  # msgpack, not an envelope: a release from before it
        raise ProtocolMismatch(None) from None
    if version != PROTOCOL_VERSION:
        raise ProtocolMismatch(version)
    return body


def bare_error(message: str) -> bytes:
    """A refusal outside the envelope, what a peer of any version can read: the answer to every
    message the server could not read (undecodable, another version, unauthenticated, too large).
    Only a peer that spoke the envelope is answered in it."""
    return _ENCODER.encode(ErrorReply(message))


def read_bare_error(payload: bytes) -> ErrorReply | None:
    try:
        return _BARE_ERROR.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def mismatch_text(peer_version: int | None) -> str:
    theirs = "no envelope (protocol 2 or older)" if peer_version is None else f"protocol {peer_version}"
    return f"undecodable request: {PROTOCOL_MISMATCH}: this side channel speaks protocol {PROTOCOL_VERSION}, the message {theirs}"
