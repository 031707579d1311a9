from __future__ import annotations

import logging
import threading
import time

import msgspec
import pytest
import zmq
from kv_common.testing.freeze import freeze
from kv_mooncake.errors import SideChannelError, SideChannelRefused, SideChannelTimeout
from kv_mooncake.wire import server as server_module
from kv_mooncake.wire.client import SideChannelClient, request
from kv_mooncake.wire.connection import open_socket_count
from kv_mooncake.wire.messages import PROTOCOL_VERSION, ErrorReply, MessageCodec, open_envelope
from kv_mooncake.wire.server import SideChannelServer
from raw_side_channel import RawConnection, RawServer, raw_exchange


class Ping(msgspec.Struct, tag=True):
    payload: str


class Blob(msgspec.Struct, tag=True):
    data: bytes


class Pong(msgspec.Struct, tag=True):
    payload: str


class Boom(msgspec.Struct, tag=True):
    pass


def handler(message: msgspec.Struct) -> msgspec.Struct | None:
    if isinstance(message, Ping):
        return Pong(message.payload.upper())
    if isinstance(message, Blob):
        return Pong(str(len(message.data)))
    raise ValueError("kaboom")


@pytest.fixture
def server():
    with SideChannelServer("127.0.0.1", 0, handler, (Ping, Blob, Boom), max_message_bytes=4096) as srv:
        yield srv
    assert not srv.is_running


def test_round_trip(server):
    assert server.port > 0
    reply = request(server.address, Ping("hello"), (Pong,), timeout_s=5)
    assert reply == Pong("HELLO")
    # A second call on a fresh socket works too, and nothing leaks.
    assert request(f"tcp://{server.address}", Ping("x"), (Pong,), timeout_s=5) == Pong("X")


def test_sockets_are_closed_after_each_call(server):
    before = open_socket_count()
    for _ in range(5):
        request(server.address, Ping("a"), (Pong,), timeout_s=5)
    assert open_socket_count() == before


def test_deadline_raises_timeout():
    # A listener that never answers: the connection is taken, the request delivered, no reply comes.
    before = open_socket_count()
    with RawServer() as silent:
        start = time.monotonic()
        with pytest.raises(SideChannelTimeout):
            request(silent.address, Ping("x"), (Pong,), timeout_s=0.3)
        elapsed = time.monotonic() - start
        assert 0.25 <= elapsed < 5, elapsed  # the deadline, not a hang (generous: CI stalls)
        assert open_socket_count() == before


def test_nobody_listening_times_out():
    with socket_port() as port:
        pass  # port now free: nobody listens
    start = time.monotonic()
    with pytest.raises(SideChannelTimeout):
        request(f"127.0.0.1:{port}", Ping("x"), (Pong,), timeout_s=0.2)
    assert time.monotonic() - start < 5  # the deadline, not a hang (generous: CI stalls)


class socket_port:
    """Find a free port by binding and releasing it."""

    def __enter__(self) -> int:
        self.server = RawServer()
        return self.server.port

    def __exit__(self, *exc: object) -> None:
        self.server.close()


def test_oversize_request_is_refused_by_name_and_server_keeps_serving(server, caplog):
    big = Blob(b"x" * 10_000)  # beyond the server's 4096-byte limit
    with caplog.at_level(logging.WARNING, logger="kv_mooncake.wire"), \
            pytest.raises(SideChannelError, match="message too large"):
        request(server.address, big, (Pong,), timeout_s=5, max_message_bytes=1 << 20)
    assert any("10" in r.getMessage() and "limit 4096" in r.getMessage() for r in caplog.records)
    assert server.is_running
    assert request(server.address, Ping("still"), (Pong,), timeout_s=5) == Pong("STILL")


def test_client_refuses_to_send_oversize():
    with pytest.raises(SideChannelError, match="exceeds the limit"):
        request("127.0.0.1:1", Blob(b"x" * 100), (Pong,), timeout_s=1, max_message_bytes=10)


def test_reply_too_large_becomes_error_reply():
    def big_handler(message):
        return Pong("y" * 10_000)

    srv = SideChannelServer("127.0.0.1", 0, big_handler, (Ping,), max_message_bytes=4096)
    with srv, pytest.raises(SideChannelError, match="reply too large"):
        request(srv.address, Ping("x"), (Pong,), timeout_s=5)


def test_malformed_bytes_get_error_reply_and_one_warning(server, caplog):
    with caplog.at_level(logging.WARNING, logger="kv_mooncake.wire"):
        reply = raw_exchange(server.address, b"\xc1\xff not msgpack")
    decoded = msgspec.msgpack.decode(reply, type=ErrorReply)
    assert "undecodable" in decoded.message
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert server.is_running
    assert request(server.address, Ping("ok"), (Pong,), timeout_s=5) == Pong("OK")


def test_wrong_struct_type_is_rejected(server):
    # A well-formed envelope of a type the server does not accept: rejected, never constructed.
    reply = raw_exchange(server.address, MessageCodec.encode(Pong("sneaky")))
    assert "undecodable" in msgspec.msgpack.decode(reply, type=ErrorReply).message
    assert request(server.address, Ping("ok"), (Pong,), timeout_s=5) == Pong("OK")


@pytest.mark.parametrize("sent, theirs", [
    (msgspec.msgpack.encode(Ping("no envelope")), "no envelope (protocol 2 or older)"),
    (msgspec.msgpack.encode((PROTOCOL_VERSION + 1, Ping("newer"))), f"protocol {PROTOCOL_VERSION + 1}"),
])
def test_a_message_of_another_protocol_version_is_refused_by_name_before_its_body_is_read(server, sent, theirs):
    """The version is read first (the envelope), the body only when it is ours: another release's
    message is refused naming both versions, in a bare reply that release can read."""
    reply = msgspec.msgpack.decode(raw_exchange(server.address, sent), type=ErrorReply)
    assert f"this side channel speaks protocol {PROTOCOL_VERSION}, the message {theirs}" in reply.message
    assert request(server.address, Ping("ok"), (Pong,), timeout_s=5) == Pong("OK")


def test_a_reply_of_another_protocol_version_is_a_refusal_naming_it():
    """The client's side: a peer answering in another version's envelope is refused for good
    (SideChannelRefused, no retry), and a bare refusal of an older release is shown as it came."""
    peer = RawServer()
    client = SideChannelClient((Pong,))
    try:
        def answer(reply: bytes) -> None:
            conn = peer.accept()
            assert conn.read() is not None
            conn.send(reply)

        newer = msgspec.msgpack.encode((PROTOCOL_VERSION + 1, Pong("newer")))
        t = threading.Thread(target=answer, args=(newer,))
        t.start()
        with pytest.raises(SideChannelRefused, match=f"another side-channel protocol .*{PROTOCOL_VERSION + 1}"):
            client.request(peer.address, Ping("x"), timeout_s=10)
        t.join()
        client.forget(peer.address)
        older = msgspec.msgpack.encode(ErrorReply("undecodable request: Expected `object`, got `array`"))
        t = threading.Thread(target=answer, args=(older,))
        t.start()
        with pytest.raises(SideChannelError, match="Expected `object`, got `array`"):
            client.request(peer.address, Ping("x"), timeout_s=10)
        t.join()
    finally:
        client.close()
        peer.close()


def test_a_connection_that_is_not_a_side_channel_is_closed_with_one_warning(server, caplog):
    with caplog.at_level(logging.WARNING, logger="kv_mooncake.wire"):
        for _ in range(3):
            with RawConnection.to(server.address, greeting=b"GET / HTTP/1.1\r\n\r\n") as conn:
                assert conn.closed_by_peer(timeout_s=30)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "not a side channel" in lines[0], lines  # rate limited per peer
    assert request(server.address, Ping("ok"), (Pong,), timeout_s=5) == Pong("OK")


def test_peers_of_the_zeromq_side_channel_are_told_apart(server):
    """kv-mooncake before the TCP side channel spoke ZeroMQ: mixed versions fail by name, not by
    hanging until a deadline."""
    ctx = zmq.Context()
    old_client = ctx.socket(zmq.REQ)
    old_client.setsockopt(zmq.LINGER, 0)
    old_server = ctx.socket(zmq.ROUTER)
    old_server.setsockopt(zmq.LINGER, 0)
    try:
        old_client.connect(f"tcp://{server.address}")
        old_client.send(msgspec.msgpack.encode(Ping("old")))
        assert not old_client.poll(300)  # ours closes the connection: no reply
        port = old_server.bind_to_random_port("tcp://127.0.0.1")
        start = time.monotonic()
        with pytest.raises(SideChannelError, match="not a side channel of this version"):
            request(f"127.0.0.1:{port}", Ping("new"), (Pong,), timeout_s=30)
        assert time.monotonic() - start < 10  # refused by the greeting, not after the deadline
    finally:
        old_client.close(0)
        old_server.close(0)
        ctx.term()
    assert request(server.address, Ping("ok"), (Pong,), timeout_s=5) == Pong("OK")


def test_a_connection_stalled_inside_a_message_is_closed(server, monkeypatch, caplog):
    monkeypatch.setattr(server_module, "STALLED_S", 0.2)  # read by the server thread's sweep
    with caplog.at_level(logging.WARNING, logger="kv_mooncake.wire"), \
            RawConnection.to(server.address) as conn:
        conn.sock.sendall(b"\x00\x00\x01\x00" + b"x" * 10)  # 256 bytes announced, 10 sent
        assert conn.closed_by_peer(timeout_s=30)
    assert any("stalled" in r.getMessage() for r in caplog.records)
    assert server.connection_count() == 0
    assert request(server.address, Ping("ok"), (Pong,), timeout_s=5) == Pong("OK")


def test_a_connection_that_never_greets_is_closed_and_a_kept_one_is_not(server, monkeypatch):
    """Silent connections would hold the server's slots (``MAX_CONNECTIONS``); a client's kept
    connection, idle between pulls, has greeted and stays."""
    monkeypatch.setattr(server_module, "STALLED_S", 0.2)  # read by the server thread's sweep
    client = SideChannelClient((Pong,))
    try:
        assert client.request(server.address, Ping("kept"), timeout_s=5) == Pong("KEPT")
        before = open_socket_count()
        with RawConnection.to(server.address, greeting=b"") as silent:
            assert silent.closed_by_peer(timeout_s=30)
        assert server.connection_count() == 1  # the kept one, idle for the whole wait
        assert client.request(server.address, Ping("again"), timeout_s=5) == Pong("AGAIN")
        assert open_socket_count() == before  # over the kept connection, not a new one
    finally:
        client.close()


def test_connections_beyond_the_limit_are_closed(monkeypatch, caplog):
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 2)
    with SideChannelServer("127.0.0.1", 0, handler, (Ping,)) as srv:
        held = [RawConnection.to(srv.address) for _ in range(2)]
        try:
            for conn in held:  # both are served (the server has accepted them)
                conn.send(MessageCodec.encode(Ping("in")))
                assert conn.read() is not None
            with RawConnection.to(srv.address) as third:
                assert third.closed_by_peer(timeout_s=30)
            assert srv.connection_count() == 2
        finally:
            for conn in held:
                conn.close()
        # Once they are gone, new connections are served again.
        assert request(srv.address, Ping("ok"), (Pong,), timeout_s=5) == Pong("OK")


def test_pipelined_requests_are_answered_in_order(server):
    with RawConnection.to(server.address) as conn:
        for i in range(50):
            conn.send(MessageCodec.encode(Ping(f"p{i}")))
        replies = [msgspec.msgpack.decode(open_envelope(conn.read() or b""), type=Pong) for _ in range(50)]
    assert [r.payload for r in replies] == [f"P{i}" for i in range(50)]


def test_handler_exception_becomes_side_channel_error(server, caplog):
    with pytest.raises(SideChannelError, match="kaboom"):
        request(server.address, Boom(), (Pong,), timeout_s=5)
    assert server.is_running


def test_handler_returning_none_is_an_error():
    srv = SideChannelServer("127.0.0.1", 0, lambda m: None, (Ping,))
    with srv, pytest.raises(SideChannelError, match="no reply"):
        request(srv.address, Ping("x"), (Pong,), timeout_s=5)


def test_undecodable_reply_is_an_error(server):
    class Other(msgspec.Struct, tag=True):
        z: int

    with pytest.raises(SideChannelError, match="undecodable reply"):
        request(server.address, Ping("x"), (Other,), timeout_s=5)


def test_concurrent_clients(server):
    results: list[msgspec.Struct] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        reply = request(server.address, Ping(f"c{i}"), (Pong,), timeout_s=5)
        with lock:
            results.append(reply)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.payload for r in results) == sorted(f"C{i}" for i in range(16))


def test_close_stops_thread_and_frees_socket():
    before_threads = set(threading.enumerate())
    before_sockets = open_socket_count()
    srv = SideChannelServer("127.0.0.1", 0, handler, (Ping,), name="close-test").start()
    assert srv.is_running
    assert open_socket_count() == before_sockets + 1
    start = time.monotonic()
    srv.close()
    assert time.monotonic() - start < 5  # below close()'s 5 s join: the thread stopped, no hang
    assert not srv.is_running
    assert set(threading.enumerate()) <= before_threads
    assert open_socket_count() == before_sockets
    # The port is free again: a new server can bind it (allowed a moment, as before under ZeroMQ).
    deadline = time.monotonic() + 3.0
    while True:
        try:
            again = SideChannelServer("127.0.0.1", srv.port, handler, (Ping,)).start()
            break
        except SideChannelError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with again:
        assert again.port == srv.port


def test_binds_only_the_configured_host(server):
    psutil = pytest.importorskip("psutil")
    listening = [
        c.laddr
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port
    ]
    assert [addr.ip for addr in listening] == ["127.0.0.1"]


def test_busy_port_raises():
    first = SideChannelServer("127.0.0.1", 0, handler, (Ping,))
    with first, pytest.raises(SideChannelError, match="cannot bind"):
        SideChannelServer("127.0.0.1", first.port, handler, (Ping,)).start()


def test_untagged_structs_are_refused():
    class Untagged(msgspec.Struct):
        a: int

    with pytest.raises(TypeError, match="tag=True"):
        SideChannelServer("127.0.0.1", 0, handler, (Untagged, Ping))
    with pytest.raises(TypeError, match="tag=True"):
        request("127.0.0.1:1", Ping("x"), (Untagged,), timeout_s=0.1)


def test_bad_address():
    with pytest.raises(ValueError, match="host:port"):
        request("no-port", Ping("x"), (Pong,), timeout_s=0.1)


def test_client_keeps_one_connection_per_peer_and_closes_it(server):
    before = open_socket_count()
    client = SideChannelClient((Pong,))
    for i in range(20):
        assert client.request(server.address, Ping(f"m{i}"), timeout_s=5) == Pong(f"M{i}")
    assert client.idle_socket_count() == 1  # 20 requests, one connection
    assert open_socket_count() == before + 1
    client.close()
    assert open_socket_count() == before
    with pytest.raises(SideChannelError, match="closed"):
        client.request(server.address, Ping("late"), timeout_s=1)


def test_client_drops_a_timed_out_socket_so_a_late_reply_is_never_misread():
    # A peer that answers the first request only after the client gave up on it: the late reply
    # must not become the answer to the second request.
    slow = RawServer()
    client = SideChannelClient((Pong,))
    before = open_socket_count()
    try:
        with pytest.raises(SideChannelTimeout):
            client.request(slow.address, Ping("first"), timeout_s=0.3)
        assert open_socket_count() == before  # the stuck socket was closed, not kept
        first = slow.accept()
        assert first.read() is not None
        try:
            first.send(MessageCodec.encode(Pong("LATE FIRST")))
        except OSError:
            pass  # the client closed it already: nobody reads the late reply, as it should be
        answers: list[object] = []

        def answer_second() -> None:
            second = slow.accept()
            assert second.read() is not None
            second.send(MessageCodec.encode(Pong("SECOND")))
            answers.append(second)

        t = threading.Thread(target=answer_second)
        t.start()
        assert client.request(slow.address, Ping("second"), timeout_s=5) == Pong("SECOND")
        t.join(5)
        first.close()
        for conn in answers:
            conn.close()  # type: ignore[attr-defined]
    finally:
        client.close()
        slow.close()
    assert open_socket_count() == before


def test_client_is_safe_across_threads_and_bounded(server):
    client = SideChannelClient((Pong,), max_idle_per_peer=3)
    results: list[str] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        for j in range(10):
            reply = client.request(server.address, Ping(f"t{i}-{j}"), timeout_s=5)
            with lock:
                results.append(reply.payload)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == sorted(f"T{i}-{j}" for i in range(8) for j in range(10))
    assert client.idle_socket_count() <= 3
    client.close()
    assert client.idle_socket_count() == 0


def test_client_error_reply_keeps_the_connection_usable(server):
    client = SideChannelClient((Pong,))
    try:
        with pytest.raises(SideChannelError, match="kaboom"):
            client.request(server.address, Boom(), timeout_s=5)
        assert client.request(server.address, Ping("after"), timeout_s=5) == Pong("AFTER")
        assert client.idle_socket_count() == 1
    finally:
        client.close()


# ---- the kept-open client against a real peer process: restart, freeze, close -------------------
_PEER = """
import sys, time, msgspec
from kv_mooncake.wire.server import SideChannelServer

class Ping(msgspec.Struct, tag=True):
    payload: str

class Pong(msgspec.Struct, tag=True):
    payload: str

srv = SideChannelServer("127.0.0.1", int(sys.argv[1]), lambda m: Pong(sys.argv[2] + m.payload), (Ping,)).start()
print(srv.port, flush=True)
sys.stdin.read()  # until the test closes our stdin
srv.close()
"""


class _Peer:
    """A side-channel server in its own process (a prefill rank): it can be restarted on the same
    port, or frozen with SIGSTOP."""

    def __init__(self, port: int = 0, tag: str = "a:"):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-c", _PEER, str(port), tag], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip().isdigit(), f"peer did not start: {line!r}"
        self.port = int(line)
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(10)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait(5)


def test_client_reconnects_to_a_restarted_peer():
    """The prefill restarts on the same port: the kept connection is not stuck on the dead one."""
    peer = _Peer(tag="first:")
    client = SideChannelClient((Pong,))
    try:
        assert client.request(peer.address, Ping("x"), timeout_s=10) == Pong("first:x")
        port = peer.port
        peer.stop()
        with pytest.raises(SideChannelTimeout):  # down: the deadline holds, nothing hangs
            client.request(f"127.0.0.1:{port}", Ping("y"), timeout_s=0.3)
        peer = _Peer(port, tag="second:")
        assert client.request(peer.address, Ping("z"), timeout_s=10) == Pong("second:z")
        assert client.idle_socket_count() == 1
    finally:
        client.close()
        peer.stop()


def test_client_replaces_a_kept_connection_the_restarted_peer_closed():
    peer = _Peer(tag="first:")
    client = SideChannelClient((Pong,))
    before = open_socket_count()
    try:
        assert client.request(peer.address, Ping("x"), timeout_s=10) == Pong("first:x")
        port = peer.port
        peer.stop()
        peer = _Peer(port, tag="second:")
        # The kept connection was closed by the old peer: noticed before use, replaced, no error.
        assert client.request(peer.address, Ping("z"), timeout_s=10) == Pong("second:z")
        assert open_socket_count() == before + 1
    finally:
        client.close()
        peer.stop()
    assert open_socket_count() == before


def test_client_deadline_holds_on_a_frozen_peer_and_others_are_not_held_up():
    """A SIGSTOPped prefill: its request fails at its deadline, its socket is dropped (a late reply
    must never be read as the next answer), a healthy peer on the same client answers meanwhile,
    and the frozen one answers again once it runs."""
    import os
    import signal

    frozen, healthy = _Peer(tag="f:"), _Peer(tag="h:")
    client = SideChannelClient((Pong,))
    before = open_socket_count()
    try:
        assert client.request(frozen.address, Ping("0"), timeout_s=10) == Pong("f:0")
        freeze(frozen.proc.pid)
        answers: list[object] = []
        t = threading.Thread(target=lambda: answers.append(client.request(healthy.address, Ping("1"), timeout_s=10)))
        start = time.monotonic()
        t.start()
        with pytest.raises(SideChannelTimeout):
            client.request(frozen.address, Ping("2"), timeout_s=0.5)
        elapsed = time.monotonic() - start
        t.join(10)
        assert answers == [Pong("h:1")]
        assert 0.45 <= elapsed < 5, elapsed
        assert open_socket_count() == before + 1  # the frozen peer's socket was closed, not kept
        os.kill(frozen.proc.pid, signal.SIGCONT)
        assert client.request(frozen.address, Ping("3"), timeout_s=10) == Pong("f:3")
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
        client.close()
        frozen.stop()
        healthy.stop()
    assert open_socket_count() == before


def test_client_close_leaves_no_socket_connection_or_fd():
    from kv_common.testing.leaks import LeakBaseline

    peers = [_Peer(tag=f"{i}:") for i in range(3)]
    request(peers[0].address, Ping("warm"), (Pong,), timeout_s=10)  # zmq's context and its fds exist
    baseline = LeakBaseline.capture()
    before = open_socket_count()
    client = SideChannelClient((Pong,), max_idle_per_peer=2)
    try:
        def work(i: int) -> None:
            for j in range(20):
                p = peers[(i + j) % 3]
                assert client.request(p.address, Ping(f"{i}-{j}"), timeout_s=10).payload.endswith(f"{i}-{j}")

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert 3 <= client.idle_socket_count() <= 6
        assert baseline.new_connections()  # the kept connections are open now
    finally:
        client.close()
    assert open_socket_count() == before
    baseline.assert_clean(timeout_s=10)
    for p in peers:
        p.stop()


def test_a_host_name_reaches_a_server_on_its_ipv4_address(server):
    # "localhost" may resolve to ::1 first; the servers listen on IPv4 addresses (as under ZeroMQ).
    assert request(f"localhost:{server.port}", Ping("name"), (Pong,), timeout_s=5) == Pong("NAME")
