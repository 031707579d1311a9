"""Free TCP ports for tests and benchmarks (one helper for the whole tree)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (racy by nature: use it at once)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
