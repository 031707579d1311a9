"""The side channel with a shared secret (issue 23 §9): strangers learn nothing and change nothing.

A prefill rank's real side channel (ZMQ over loopback) with ``KV_SECRET`` set; the stranger is a
plain client of the same side channel without the secret (or with another one). The pulls at the end
move real bytes between two real TransferEngines.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import pytest
from conftest import FakeTransferEngine
from kv_common.kv_byte_settings import KVByteSettings
from kv_common.testing.ports import free_port
from kv_mooncake.config import MooncakeConfig
from kv_mooncake.errors import SideChannelError
from kv_mooncake.step import HoldRequest, MooncakeStep
from kv_mooncake.wire import client as side_channel
from kv_mooncake.wire import messages as P
from kv_mooncake.wire.messages import ErrorReply
from kv_mooncake.worker import LocalCache, MooncakeWorker, RankContext, query_leaks
from raw_side_channel import RawConnection, RawServer, raw_exchange

SHAPE = {"block_size": 16, "head_size": 8, "num_layers": 2}
SECRET = "correct horse battery staple, twice"
OTHER_SECRET = "a different secret of enough length"
BASES = [4096, 8192]


def _compat(**changes) -> P.Compatibility:
    base = dict(model="m", dtype="float32", block_size=16, head_size=8, num_layers=2, total_kv_heads=4, use_mla=False,
                layout="raw:[blocks,heads,bytes]", kernel_block_size=16, protocol_version=P.PROTOCOL_VERSION)
    base.update(changes)
    return P.Compatibility(**base)


def _prefill(cfg: MooncakeConfig | None = None) -> MooncakeWorker:
    context = RankContext(engine_id="P-secret-engine", is_producer=True, is_consumer=False,
                          side_channel_port=free_port(), total_kv_heads=4, kv_byte_settings=KVByteSettings(model="m"))
    w = MooncakeWorker(cfg or MooncakeConfig(hold_timeout_s=30.0), context, engine_factory=FakeTransferEngine)
    w.register_cache(LocalCache(["l0", "l1"], BASES, [1024, 1024], 4, 4), SHAPE, "float32")
    return w


@pytest.fixture
def prefill(monkeypatch):
    monkeypatch.setenv("KV_SECRET", SECRET)
    w = _prefill()
    w.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=2, block_ids=[0, 1])]))
    yield w
    w.close()


def _auth(secret: str, **kwargs):
    from kv_mooncake.wire.seal import SideChannelAuth

    return SideChannelAuth(secret.encode(), **kwargs)


def _stranger(address: str, message: msgspec.Struct) -> str:
    """What a peer without the secret gets back: the error text (it must get no reply at all)."""
    with pytest.raises(SideChannelError) as info:
        side_channel.request(address, message, P.REPLY_TYPES, 2.0)
    return str(info.value).split(" answered with an error: ", 1)[-1]  # what came from the peer


def _assert_reveals_nothing(text: str, worker: MooncakeWorker) -> None:
    for secret_thing in ("P-secret-engine", FakeTransferEngine.rpc_address, *map(str, BASES), "block_size",
                         SECRET, OTHER_SECRET):
        assert secret_thing not in text, f"{secret_thing!r} revealed to a stranger: {text!r}"


def test_a_stranger_without_the_secret_gets_no_addresses(prefill):
    addr = prefill.server.address
    for message in (P.Handshake(engine_id="P-secret-engine", compatibility=_compat(), reader_id="x"),
                    P.Handshake(engine_id="guess", compatibility=_compat(), reader_id="x"),
                    P.Handshake(engine_id="P-secret-engine", compatibility=_compat(block_size=128), reader_id="x")):
        text = _stranger(addr, message)
        assert "not authenticated" in text
        _assert_reveals_nothing(text, prefill)


def test_a_stranger_cannot_free_a_held_request(prefill):
    addr = prefill.server.address
    for message in (P.FreeNow(request_id="r"), P.PullDone(request_id="r", reader_id="x", ok=True),
                    P.PullStarted(request_id="r", reader_id="x", expected_readers=1, block_ids=[0]),
                    P.HoldKeepAlive(request_id="r")):
        _stranger(addr, message)
    # Another secret is no secret at all.
    wrong = side_channel.SideChannelClient(P.REPLY_TYPES, auth=_auth(OTHER_SECRET))
    try:
        with pytest.raises(SideChannelError, match="not authenticated"):
            wrong.request(addr, P.FreeNow(request_id="r"), 2.0)
    finally:
        wrong.close()
    assert prefill.get_finished()[0] is None
    assert prefill.leak_report()["held_requests"] == 1  # the hold survived
    assert prefill.leak_report()["active_reads"] == 0


def test_a_peer_with_the_secret_is_answered_and_frees(prefill):
    client = side_channel.SideChannelClient(P.REPLY_TYPES, auth=_auth(SECRET))
    try:
        reply = client.request(prefill.server.address,
                               P.Handshake(engine_id="P-secret-engine", compatibility=_compat(), reader_id="d"), 2.0)
        assert isinstance(reply, P.HandshakeReply) and reply.base_addresses == BASES
        assert isinstance(client.request(prefill.server.address, P.FreeNow(request_id="r"), 2.0), P.Ack)
    finally:
        client.close()
    assert prefill.get_finished()[0] == {"r"}


def test_a_replayed_authenticated_message_is_refused(prefill):
    from kv_mooncake.wire.seal import open_reply

    auth = _auth(SECRET)
    wire, nonce = auth.seal_request(P.MessageCodec.encode(P.HoldKeepAlive(request_id="r")))
    first = open_reply(auth, raw_exchange(prefill.server.address, wire), nonce)  # captured on the wire ...
    assert isinstance(msgspec.msgpack.decode(P.open_envelope(first), type=P.Ack | P.Refused), P.Ack)
    again = msgspec.msgpack.decode(raw_exchange(prefill.server.address, wire), type=ErrorReply)
    assert again.message.startswith("not authenticated")  # ... and sent again: refused
    # The same for a FreeNow replayed after the first one was answered (the hold is kept by a new one).
    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="r2", num_blocks=1, block_ids=[2])]))
    wire, _ = auth.seal_request(P.MessageCodec.encode(P.FreeNow(request_id="r2")))
    raw_exchange(prefill.server.address, wire)
    assert prefill.get_finished()[0] == {"r2"}
    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="r2", num_blocks=1, block_ids=[2])]))
    raw_exchange(prefill.server.address, wire)
    assert prefill.get_finished()[0] is None


def test_a_stale_or_future_message_is_refused(prefill):
    for skew in (-45.0, 45.0):
        late = side_channel.SideChannelClient(P.REPLY_TYPES, auth=_auth(SECRET, clock=lambda s=skew: time.time() + s))
        try:
            with pytest.raises(SideChannelError, match="not authenticated"):
                late.request(prefill.server.address, P.FreeNow(request_id="r"), 2.0)
        finally:
            late.close()
    assert prefill.leak_report()["held_requests"] == 1
    # Within the window a skewed clock is fine.
    near = side_channel.SideChannelClient(P.REPLY_TYPES, auth=_auth(SECRET, clock=lambda: time.time() - 10))
    try:
        assert isinstance(near.request(prefill.server.address, P.HoldKeepAlive(request_id="r"), 2.0), P.Ack)
    finally:
        near.close()


def _side_channel_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.endswith("side_channel")]


@pytest.mark.parametrize("with_secret", [False, True])
def test_two_thousand_bad_messages_log_a_bounded_number_of_lines(with_secret, monkeypatch, caplog):
    if with_secret:
        monkeypatch.setenv("KV_SECRET", SECRET)
    else:
        monkeypatch.delenv("KV_SECRET", raising=False)
    w = _prefill()
    conn = RawConnection.to(w.server.address)
    try:
        with caplog.at_level(logging.WARNING):
            for i in range(2000):
                conn.send(b"\xc1 not msgpack %d" % i)
            replies = 0
            while replies < 2000 and conn.read() is not None:
                replies += 1
        assert replies == 2000  # each one answered (an error), none hung the server
        lines = _side_channel_warnings(caplog)
        assert len(lines) <= 3, f"{len(lines)} warning lines for 2,000 bad messages"
        assert w.server.is_running
    finally:
        conn.close()
        w.close()


def test_leak_queries_answer_only_loopback_or_authenticated_peers(monkeypatch):
    psutil = pytest.importorskip("psutil")
    import socket

    outside = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
               if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not outside:
        pytest.skip("no non-loopback IPv4 address on this machine")
    host = outside[0]
    monkeypatch.delenv("KV_SECRET", raising=False)
    w = _prefill(MooncakeConfig(side_channel_host=host))
    try:
        with pytest.raises(SideChannelError, match="loopback"):
            query_leaks(w.server.address)  # from this host's outside address: not loopback
        # The pull protocol itself still answers everyone without a secret (as before).
        reply = side_channel.request(w.server.address, P.HoldKeepAlive(request_id="x"), P.REPLY_TYPES, 2.0)
        assert isinstance(reply, P.Refused)
    finally:
        w.close()
    monkeypatch.setenv("KV_SECRET", SECRET)
    w = _prefill(MooncakeConfig(side_channel_host=host))
    try:
        assert query_leaks(w.server.address)["held_blocks"] == 0  # query_leaks takes KV_SECRET too
    finally:
        w.close()


def test_secret_env_named_in_the_config_must_be_set_and_long_enough(monkeypatch):
    from kv_mooncake.wire.seal import auth_from_env

    monkeypatch.delenv("KV_TEST_SECRET", raising=False)
    monkeypatch.delenv("KV_SECRET", raising=False)
    assert auth_from_env(None) is None  # no KV_SECRET: no secret, as before
    with pytest.raises(ValueError, match="side_channel_secret_env names KV_TEST_SECRET, which is not set"):
        _prefill(MooncakeConfig(side_channel_secret_env="KV_TEST_SECRET"))
    monkeypatch.setenv("KV_TEST_SECRET", "short")
    with pytest.raises(ValueError, match="KV_TEST_SECRET holds 5 characters") as info:
        auth_from_env("KV_TEST_SECRET")
    assert "short" not in str(info.value).replace("5 characters", "")
    monkeypatch.setenv("KV_TEST_SECRET", SECRET)
    assert auth_from_env("KV_TEST_SECRET") is not None


def test_the_config_never_holds_the_secret_itself():
    # The key names an environment variable; configs are logged.
    assert "side_channel_secret_env" in MooncakeConfig.__struct_fields__
    assert not any("secret" in f and not f.endswith("_env") for f in MooncakeConfig.__struct_fields__)


def test_warning_limiter_keeps_one_line_per_peer_per_period():
    from kv_mooncake.wire.server import WarningLimiter

    now = [0.0]
    limiter = WarningLimiter(period_s=10.0, clock=lambda: now[0])
    assert limiter.allow("a") == 0
    assert [limiter.allow("a") for _ in range(5)] == [None] * 5
    assert limiter.allow("b") == 0  # another peer has its own line
    now[0] = 10.5
    assert limiter.allow("a") == 5  # the next line says how many were suppressed
    for i in range(10_000):  # many peers: memory stays bounded
        limiter.allow(f"peer-{i}")
    assert limiter.tracked_peers() <= 1024


def test_forgotten_nonces_never_let_a_replay_through():
    from kv_mooncake.wire.seal import ReplayGuard

    guard = ReplayGuard(window_s=30.0, max_nonces=3)
    assert all(guard.first_time(bytes([i]) * 16, stamped=float(i), now=5.0) for i in range(1, 5))
    assert len(guard) == 3  # bounded: the oldest (stamped 1) was forgotten ...
    assert not guard.first_time(bytes([1]) * 16, stamped=1.0, now=5.0)  # ... and its replay still refused
    assert not guard.first_time(b"n" * 16, stamped=1.0, now=5.0)  # as is anything no newer
    assert guard.first_time(b"n" * 16, stamped=4.5, now=5.0)
    assert not guard.first_time(bytes([4]) * 16, stamped=4.0, now=5.0)  # remembered: a replay
    assert guard.first_time(b"m" * 16, stamped=100.0, now=100.0) and len(guard) == 1  # the stale went


def test_a_reply_to_another_request_or_a_plain_reply_is_not_read():
    """Someone on the path answers for the prefill: an old sealed reply (another request's), or a
    plain one. The client reads neither as the answer."""
    auth = _auth(SECRET)
    peer = RawServer()
    client = side_channel.SideChannelClient(P.REPLY_TYPES, auth=auth)
    ack = msgspec.msgpack.encode(P.Ack())
    forgeries = [(auth.seal_reply(ack, b"x" * 16), "failed authentication"), (ack, "unauthenticated reply")]
    served: list[RawConnection] = []

    def answer() -> None:  # each request on the client's kept connection, or on a new one
        for forged, _ in forgeries:
            while not served or (request := served[-1].read()) is None:
                served.append(peer.accept())
            assert request
            served[-1].send(forged)

    t = threading.Thread(target=answer)
    t.start()
    try:
        for _, expected in forgeries:
            with pytest.raises(SideChannelError, match=expected):
                client.request(peer.address, P.FreeNow(request_id="r"), 30.0)
        t.join(30)
    finally:
        client.close()
        for conn in served:
            conn.close()
        peer.close()


def test_the_proxy_frees_a_hold_only_with_the_secret(prefill, monkeypatch):
    """kv-mooncake-proxy's FreeNow (client gone between the legs) is sealed with KV_SECRET from its
    environment; without it the prefill refuses, and the hold waits for its expiry."""
    from kv_mooncake.proxy.release import release_prefill_blocks

    params = {"do_remote_prefill": True, "remote_engine_id": "P-secret-engine", "remote_host": "127.0.0.1",
              "remote_port": prefill.context.side_channel_port, "remote_block_ids": [0, 1], "remote_request_id": "r",
              "remote_tp_size": 1}
    monkeypatch.delenv("KV_SECRET")
    assert release_prefill_blocks(params, timeout_s=2.0) == 0
    assert prefill.leak_report()["held_requests"] == 1
    monkeypatch.setenv("KV_SECRET", SECRET)
    assert release_prefill_blocks(params, timeout_s=2.0) == 1
    assert prefill.get_finished()[0] == {"r"}


# ---- real pulls between two workers (TransferEngine over TCP) ------------------------------------
def _instances(prefill_cfg: MooncakeConfig, decode_cfg: MooncakeConfig):
    pytest.importorskip("numpy")
    pytest.importorskip("mooncake.engine")
    from test_pull_isolation import Instance

    return Instance(prefill_cfg, producer=True, seed=11), Instance(decode_cfg, producer=False, seed=12)


def _pull_and_wait(decode, prefill, request_id: str, remote: list[int], local: list[int]) -> set[int]:
    from test_pull_isolation import _pull

    port = prefill.worker.context.side_channel_port
    decode.worker.start_step(MooncakeStep(pulls=[_pull(request_id, port, remote, local)]))
    deadline = time.monotonic() + 20
    while request_id not in (decode.worker.get_finished()[1] or ()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return decode.worker.ledger.take_block_ids_with_load_errors()


def test_a_pull_between_two_workers_with_the_same_secret(monkeypatch):
    monkeypatch.setenv("KV_SECRET", SECRET)
    prefill, decode = _instances(MooncakeConfig(pull_timeout_s=10.0), MooncakeConfig(pull_timeout_s=10.0))
    try:
        prefill.worker.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=3, block_ids=[1, 2, 3])]))
        assert _pull_and_wait(decode, prefill, "r", [1, 2, 3], [7, 8, 9]) == set()
        for layer in range(2):
            for src, dst in zip([1, 2, 3], [7, 8, 9]):
                assert decode.block(layer, dst) == prefill.block(layer, src)
        deadline = time.monotonic() + 10  # the DONE (authenticated too) frees the prefill's hold
        while prefill.worker.leak_report()["held_requests"] and time.monotonic() < deadline:
            prefill.worker.get_finished()
            time.sleep(0.02)
        assert prefill.worker.leak_report()["held_requests"] == 0
    finally:
        decode.worker.close()
        prefill.worker.close()


def _one_side_with_a_secret(secret_on: str, lease_s: float, monkeypatch):
    """A prefill and a decode, the secret on ``secret_on`` only; the prefill holds request r."""
    monkeypatch.delenv("KV_SECRET", raising=False)
    monkeypatch.setenv("KV_TEST_SECRET", SECRET)
    # pull_timeout_s far above the bounds the tests check: a refusal must end the pull, not the deadline.
    with_secret = MooncakeConfig(pull_timeout_s=30.0, lease_s=lease_s, side_channel_secret_env="KV_TEST_SECRET")
    without = MooncakeConfig(pull_timeout_s=30.0, lease_s=lease_s)
    prefill, decode = _instances(with_secret if secret_on == "prefill" else without,
                                 with_secret if secret_on == "decode" else without)
    prefill.worker.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=2, block_ids=[1, 2])]))
    return prefill, decode


@pytest.mark.parametrize("secret_on", ["prefill", "decode"])
def test_a_secret_on_one_side_only_fails_that_pull_alone_with_a_clear_message(secret_on, monkeypatch, caplog):
    prefill, decode = _one_side_with_a_secret(secret_on, 0.5, monkeypatch)
    try:
        with caplog.at_level(logging.WARNING):
            t0 = time.monotonic()
            assert _pull_and_wait(decode, prefill, "r", [1, 2], [5, 6]) == {5, 6}  # a load error, not a hang
            assert time.monotonic() - t0 < 10.0  # refused at once, not at pull_timeout_s (30 s)
        text = "\n".join(r.getMessage() for r in caplog.records)
        # Both sides say what is wrong, and neither log holds the secret.
        assert "secret" in text and SECRET not in text
        if secret_on == "prefill":
            assert "not authenticated" in text
        else:
            assert "has no side-channel secret" in text
        # Both engines stay up: the prefill still holds its request and answers its own operators.
        assert prefill.worker.server.is_running
        assert prefill.worker.leak_report()["held_requests"] == 1
    finally:
        decode.worker.close()
        prefill.worker.close()


# ---- python -m kv_common doctor ------------------------------------------------------------------
def _doctor(host: str, **extra):
    import json

    from kv_common import doctor

    ktc = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": free_port(),
           "kv_connector_extra_config": {"side_channel_host": host, **extra}}
    return doctor.run(json.dumps(ktc))


def test_doctor_warns_of_a_side_channel_beyond_loopback_without_a_secret(monkeypatch):
    from kv_common.doctor import WARN

    monkeypatch.delenv("KV_SECRET", raising=False)
    def beyond_loopback(report):
        # Other warnings (the advertised address) are the address checks' business.
        return [c.detail for c in report.checks if c.status == WARN and "beyond loopback" in c.detail]

    report = _doctor("0.0.0.0")
    warned = beyond_loopback(report)
    assert len(warned) == 1 and "side channel of worker rank 0" in warned[0] and "beyond loopback" in warned[0]
    assert report.ok
    assert not beyond_loopback(_doctor("127.0.0.1"))
    monkeypatch.setenv("KV_SECRET", SECRET)
    report = _doctor("0.0.0.0")
    assert not beyond_loopback(report)
    assert any("sealed with the secret from KV_SECRET" in c.detail for c in report.checks)
    assert not any(SECRET in c.detail for c in report.checks)
    # A named variable that is not set is a problem: the engine would refuse to start.
    report = _doctor("0.0.0.0", side_channel_secret_env="KV_TEST_UNSET_SECRET")
    assert not report.ok
    assert any("KV_TEST_UNSET_SECRET, which is not set" in c.detail for c in report.checks)


@pytest.mark.parametrize("secret_on", ["prefill", "decode"])
def test_a_refusal_for_the_secret_is_not_retried(secret_on, monkeypatch, caplog):
    """Secrets that differ never start to match: the decode's DONE / FreeNow to that prefill gives
    up at the first refusal instead of retrying for ``lease_s`` (a notifier thread tied up for a
    lease per message delays every other request's DONE)."""
    prefill, decode = _one_side_with_a_secret(secret_on, 40.0, monkeypatch)
    try:
        with caplog.at_level(logging.WARNING):
            t0 = time.monotonic()
            assert _pull_and_wait(decode, prefill, "r", [1, 2], [5, 6]) == {5, 6}
            deadline = time.monotonic() + 20.0
            while time.monotonic() < deadline and not any("not delivered" in r.getMessage() for r in caplog.records):
                time.sleep(0.05)
            delivered_after = time.monotonic() - t0
        assert any("not delivered" in r.getMessage() for r in caplog.records), "the DONE was retried past 20 s"
        assert delivered_after < 15.0  # retried until lease_s: 40 s
    finally:
        decode.worker.close()
        prefill.worker.close()
