"""The floor under a side-channel message: one request / reply between two processes on loopback,
over kv-mooncake's side channel (TCP since it left ZeroMQ), over ZeroMQ (REQ to ROUTER, what the
side channel used before) and over a bare TCP socket, in the same run.

A ZeroMQ message passes through an I/O thread on each side (the sender's thread hands it to its
context's I/O thread, which writes the socket; the receiver's I/O thread reads it and wakes the
receiving thread): on a small machine each hand-off is a thread wake-up. A blocking TCP socket wakes
the receiving thread directly. Each exchange starts after a pause (``GAP_S``), as a pull's DONE does
after its read: both sides' threads are asleep, as they are in a pull.

* ``python -m benchmarks._lib.round_trip side|zmq|tcp PORT``: the echo peer (JSON-lines ready line, then
  echoes until stdin closes).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable

import msgspec

GAP_S = 0.002  # between exchanges: the threads on both sides go to sleep, as during a read
_QUIT = b"q"


class _Echo(msgspec.Struct, tag=True):
    data: bytes


def _serve_side(port: int) -> None:
    from kv_mooncake.wire.server import SideChannelServer

    SideChannelServer("127.0.0.1", port, lambda message: message, (_Echo,), name="echo").start()
    print(json.dumps({"ready": True}), flush=True)


def _serve_zmq(port: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    print(json.dumps({"ready": True}), flush=True)
    while True:
        frames = sock.recv_multipart()
        sock.send_multipart(frames)
        if frames[-1] == _QUIT:
            return


def _serve_tcp(port: int) -> None:
    listener = socket.create_server(("127.0.0.1", port))
    print(json.dumps({"ready": True}), flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (data := conn.recv(64)) and data != _QUIT:
        conn.sendall(data)


def _timed(n: int, exchange: Callable[[], None]) -> list[float]:
    """Seconds of each of ``n`` calls of ``exchange()`` (one request / reply), each after ``GAP_S``."""
    out = []
    for _ in range(n):
        time.sleep(GAP_S)
        t0 = time.perf_counter()
        exchange()
        out.append(time.perf_counter() - t0)
    return out


def _exchanges_side(port: int, n: int) -> list[float]:
    from kv_mooncake.wire.client import SideChannelClient

    client = SideChannelClient((_Echo,))
    try:
        return _timed(n + 1, lambda: client.request(f"127.0.0.1:{port}", _Echo(b"x"), 5.0))[1:]  # the first connects
    finally:
        client.close()


def _exchanges_zmq(port: int, n: int) -> list[float]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.connect(f"tcp://127.0.0.1:{port}")

    def exchange() -> None:
        sock.send(b"x")
        if not sock.poll(5000):
            raise RuntimeError("no ZeroMQ echo within 5 s")
        sock.recv()

    try:
        out = _timed(n + 1, exchange)[1:]  # the first one connects
        sock.send(_QUIT)
        sock.poll(5000)
    finally:
        sock.close(linger=0)
        ctx.term()
    return out


def _exchanges_tcp(port: int, n: int) -> list[float]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def exchange() -> None:
            conn.sendall(b"x")
            if not conn.recv(64):
                raise RuntimeError("the TCP echo peer closed")

        out = _timed(n, exchange)
        conn.sendall(_QUIT)
    return out


def round_trips(n: int = 300) -> dict[str, list[float]]:
    """Seconds of each of ``n`` exchanges per transport, ``{"side": [...], "zmq": [...], "tcp": [...]}``."""
    from kv_common.testing.ports import free_port

    from benchmarks._lib.peers import PeerProcess

    out: dict[str, list[float]] = {}
    for kind, exchanges in (("side", _exchanges_side), ("zmq", _exchanges_zmq), ("tcp", _exchanges_tcp)):
        port = free_port()
        peer = PeerProcess("benchmarks._lib.round_trip", kind, str(port), what=f"{kind} echo peer")
        try:
            out[kind] = exchanges(port, n)
        finally:
            peer.close(5.0)
    return out


if __name__ == "__main__":
    serve = {"side": _serve_side, "zmq": _serve_zmq, "tcp": _serve_tcp}[sys.argv[1]]
    threading.Thread(target=serve, args=(int(sys.argv[2]),), daemon=True).start()
    sys.stdin.read()  # serve until the parent closes stdin
