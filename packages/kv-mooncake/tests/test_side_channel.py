from __future__ import annotations

import logging
import threading
import time

import msgspec
import pytest
import zmq
from kv_common.testing.freeze import freeze
from kv_mooncake.side_channel import (
    ErrorReply,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
    SideChannelTimeout,
    open_socket_count,
    request,
)


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
    # A bound ROUTER that never answers: the request is delivered but no reply comes.
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    before = open_socket_count()
    try:
        start = time.monotonic()
        with pytest.raises(SideChannelTimeout):
            request(f"127.0.0.1:{port}", Ping("x"), (Pong,), timeout_s=0.3)
        elapsed = time.monotonic() - start
        assert 0.25 <= elapsed < 5, elapsed  # the deadline, not a hang (generous: CI stalls)
        assert open_socket_count() == before
    finally:
        silent.close(0)
        ctx.term()


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
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        return self.sock.bind_to_random_port("tcp://127.0.0.1")

    def __exit__(self, *exc: object) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_oversize_request_is_dropped_and_server_keeps_serving(server, caplog):
    big = Blob(b"x" * 10_000)  # beyond the server's 4096-byte limit
    with pytest.raises(SideChannelTimeout):  # zmq drops the frame and the peer: no reply
        request(server.address, big, (Pong,), timeout_s=0.5, max_message_bytes=1 << 20)
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


def _raw_dealer_exchange(port: int, frames: list[bytes], timeout_ms: int = 2000) -> list[bytes] | None:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart(frames)
        if dealer.poll(timeout_ms):
            return dealer.recv_multipart()
        return None
    finally:
        dealer.close(0)
        ctx.term()


def test_malformed_bytes_get_error_reply_and_one_warning(server, caplog):
    with caplog.at_level(logging.WARNING, logger="kv_mooncake.side_channel"):
        reply = _raw_dealer_exchange(server.port, [b"\xc1\xff not msgpack"])
    assert reply is not None
    decoded = msgspec.msgpack.decode(reply[-1], type=ErrorReply)
    assert "undecodable" in decoded.message
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert server.is_running
    assert request(server.address, Ping("ok"), (Pong,), timeout_s=5) == Pong("OK")


def test_wrong_struct_type_is_rejected(server):
    # Valid msgpack of a type the server does not accept: rejected, never constructed.
    reply = _raw_dealer_exchange(server.port, [msgspec.msgpack.encode(Pong("sneaky"))])
    assert reply is not None
    assert "undecodable" in msgspec.msgpack.decode(reply[-1], type=ErrorReply).message
    assert request(server.address, Ping("ok"), (Pong,), timeout_s=5) == Pong("OK")


def test_bad_envelope_is_dropped(server):
    assert _raw_dealer_exchange(server.port, [b"a", b"b", b"c"], timeout_ms=300) is None
    assert request(server.address, Ping("ok"), (Pong,), timeout_s=5) == Pong("OK")


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
    # The port is free again: a new server can bind it (zmq releases the listener from its I/O
    # thread just after close, so allow it a moment).
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
    # A ROUTER that answers the first request only after the client gave up on it: the late reply
    # must not become the answer to the second request.
    ctx = zmq.Context()
    slow = ctx.socket(zmq.ROUTER)
    port = slow.bind_to_random_port("tcp://127.0.0.1")
    client = SideChannelClient((Pong,))
    before = open_socket_count()
    try:
        with pytest.raises(SideChannelTimeout):
            client.request(f"127.0.0.1:{port}", Ping("first"), timeout_s=0.3)
        assert open_socket_count() == before  # the stuck socket was closed, not kept
        frames = slow.recv_multipart()
        slow.send_multipart(frames[:-1] + [msgspec.msgpack.encode(Pong("LATE FIRST"))])

        def answer_second() -> None:
            frames = slow.recv_multipart()
            slow.send_multipart(frames[:-1] + [msgspec.msgpack.encode(Pong("SECOND"))])

        t = threading.Thread(target=answer_second)
        t.start()
        assert client.request(f"127.0.0.1:{port}", Ping("second"), timeout_s=5) == Pong("SECOND")
        t.join(5)
    finally:
        client.close()
        slow.close(0)
        ctx.term()
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
from kv_mooncake.side_channel import SideChannelServer

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


def test_client_restarted_peer_while_idle_needs_no_new_socket():
    peer = _Peer(tag="first:")
    client = SideChannelClient((Pong,))
    before = open_socket_count()
    try:
        assert client.request(peer.address, Ping("x"), timeout_s=10) == Pong("first:x")
        port = peer.port
        peer.stop()
        peer = _Peer(port, tag="second:")
        # The idle socket reconnects by itself (zmq's reconnect): the request needs no retry.
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
    baseline.assert_clean(timeout_s=10)  # zmq closes TCP connections on its I/O thread: give it time
    for p in peers:
        p.stop()
