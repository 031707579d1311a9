"""Typed metadata shared by the connectors: what travels between instances and between roles.

All are msgspec Structs: encoded with msgpack on the wire, never pickled.
"""

from __future__ import annotations

import hashlib

import msgspec


class ParallelRank(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's place in the parallel layout (TP, prefill CP, decode CP, DP)."""

    tp_rank: int = 0
    tp_size: int = 1
    pcp_rank: int = 0
    pcp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pcp", "dcp", "dp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name} rank {rank} outside size {size}")


class BlockLayout(msgspec.Struct, frozen=True, kw_only=True):
    """How one worker's paged KV cache is laid out: enough to move whole blocks and check peers."""

    num_layers: int
    block_size: int  # tokens per block
    bytes_per_block_per_layer: int
    num_kv_heads: int  # heads held by this rank
    head_size: int
    dtype: str
    use_mla: bool = False
    rank: ParallelRank = ParallelRank()

    def compatibility_key(self, model: str) -> str:
        """Hash of everything two instances must agree on before blocks move between them."""
        parts = [model, self.dtype, self.block_size, self.head_size, self.use_mla, self.num_layers]
        # The per-rank head count differs legitimately across TP sizes; the total does not.
        parts.append(self.num_kv_heads * (1 if self.use_mla else self.rank.tp_size))
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``kv_transfer_params``: returned by a producer's request, passed by the client to the consumer.

    Travels as a plain dict inside vLLM's request output; ``from_dict`` validates it on arrival.
    """

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: list[int] = []
    remote_request_id: str | None = None
    remote_tp_size: int = 1
    remote_pcp_size: int = 1
    remote_dcp_size: int = 1
    remote_num_tokens: int = 0

    @classmethod
    def from_dict(cls, data: dict | None) -> KVTransferParams | None:
        if not data:
            return None
        return msgspec.convert(data, type=cls, strict=False)

    def to_dict(self) -> dict:
        return msgspec.to_builtins(self)


class RequestBlocks(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request work a scheduler hands its workers for one step."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]  # one tuple per KV-cache group
    num_tokens: int = 0
    block_hashes: tuple[bytes, ...] = ()
    transfer: KVTransferParams | None = None


class StepMetadata(msgspec.Struct, kw_only=True):
    """Scheduler -> worker, once per step (wrapped by each connector's ``KVConnectorMetadata``)."""

    loads: list[RequestBlocks] = []
    saves: list[RequestBlocks] = []
    frees: list[str] = []
    aborts: list[str] = []
