"""Typed metadata that travels between instances: the ``kv_transfer_params`` of a request.

A msgspec Struct: validated on arrival, never pickled.
"""

from __future__ import annotations

import msgspec


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

