"""Two releases that speak the side-channel protocol differently refuse each other at the handshake,
naming both versions, on the prefill and on the decode."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

torch = pytest.importorskip("torch")

from kv_common.kv_byte_settings import KVByteSettings
from kv_mooncake.config import MooncakeConfig  # noqa: E402
from kv_mooncake.wire import messages as P
from kv_mooncake.worker import MooncakeWorker, RankContext

HEADS, HEAD = 4, 8


def _worker(engine_id: str) -> MooncakeWorker:
    engine = SimpleNamespace(rpc_address="127.0.0.1:1", register=lambda regions: None, close=lambda: None)
    w = MooncakeWorker(MooncakeConfig(), RankContext(engine_id=engine_id, is_producer=False, is_consumer=False,
                                                     side_channel_port=1, total_kv_heads=HEADS,
                                                     kv_byte_settings=KVByteSettings(model="m", block_size=16),
                                                     kv_shape=(HEADS, HEAD)), engine_factory=lambda: engine)
    w.register_kv_caches({f"l{i}": torch.zeros(4, HEADS, 16, 2 * HEAD, dtype=torch.uint8) for i in range(2)})
    return w


def _speaking(compatibility: P.Compatibility, version: int) -> P.Compatibility:
    return msgspec.structs.replace(compatibility, protocol_version=version)


def _over_the_wire(message: msgspec.Struct, drop_version: bool = False) -> msgspec.Struct:
    """As the peer decodes it; ``drop_version``: as a release from before the version was sent."""
    data = msgspec.to_builtins(message)
    if drop_version:
        del data["compatibility"]["protocol_version"]
    return msgspec.msgpack.decode(msgspec.msgpack.encode(data), type=P.Handshake | P.HandshakeReply)


def test_this_release_sends_its_protocol_version():
    decode = _worker("D")
    assert decode.compatibility.protocol_version == P.PROTOCOL_VERSION
    hello = _over_the_wire(P.Handshake(engine_id="P", compatibility=decode.compatibility, reader_id="d"))
    assert hello.compatibility.protocol_version == P.PROTOCOL_VERSION


def test_the_prefill_refuses_a_decode_of_another_protocol_by_name():
    prefill, decode = _worker("P"), _worker("D")
    newer = P.PROTOCOL_VERSION + 1
    hello = _over_the_wire(P.Handshake(engine_id="P", compatibility=_speaking(decode.compatibility, newer),
                                       reader_id="d"))
    reply = prefill.handle(hello)
    assert isinstance(reply, P.Refused)
    assert f"prefill speaks kv-mooncake protocol {P.PROTOCOL_VERSION}, this decode {newer}" in reply.reason
    # Only that line: the other fields may mean something else in another protocol.
    assert reply.reason.count(";") == 0


def test_the_decode_refuses_a_prefill_of_another_protocol_by_name():
    prefill, decode = _worker("P"), _worker("D")
    reply = prefill.handle(P.Handshake(engine_id="P", compatibility=decode.compatibility, reader_id="d"))
    assert isinstance(reply, P.HandshakeReply)
    older = msgspec.structs.replace(reply, compatibility=_speaking(reply.compatibility, P.PROTOCOL_VERSION + 1))
    # The check the decode runs on every handshake reply (kv_mooncake.pull.messenger).
    assert decode.compatibility.differences(_over_the_wire(older).compatibility) == [
        f"prefill speaks kv-mooncake protocol {P.PROTOCOL_VERSION + 1}, this decode {P.PROTOCOL_VERSION}"]


def test_a_peer_that_sends_no_version_speaks_the_first_protocol():
    prefill, decode = _worker("P"), _worker("D")
    old = _over_the_wire(P.Handshake(engine_id="P", compatibility=decode.compatibility, reader_id="d"),
                         drop_version=True)
    assert old.compatibility.protocol_version == P.UNVERSIONED == 1
    reply = prefill.handle(old)
    if P.PROTOCOL_VERSION == P.UNVERSIONED:
        assert isinstance(reply, P.HandshakeReply)  # today's protocol is the one those releases spoke
    else:
        assert isinstance(reply, P.Refused) and f"this decode {P.UNVERSIONED}" in reply.reason
