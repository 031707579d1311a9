"""free_port hands out ports no other process is about to take."""

from __future__ import annotations

import socket

from kv_common.testing.ports import _ephemeral_low, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_never_handed_out_twice():
    ports = [free_port() for _ in range(200)]
    low = _ephemeral_low()
    assert all(p < low for p in ports), (low, [p for p in ports if p >= low])
    # Nor a neighbour of one handed out (tests use port + rank).
    assert all(abs(a - b) >= 8 for i, a in enumerate(ports) for b in ports[i + 1:])
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free when handed out
