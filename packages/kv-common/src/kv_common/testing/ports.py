"""Free TCP ports for tests and benchmarks (one helper for the whole tree), and the address tests
give their engines."""

from __future__ import annotations

import os
import random
import socket

# Tests run every peer on this machine and reach it at 127.0.0.1: connectors advertise this machine's
# address as vLLM finds it (``kv_common.vllm_compat.host_ip``, VLLM_HOST_IP first), so tests pin it
# here, in one place. A test of several hosts gives each host's processes their own VLLM_HOST_IP.
LOOPBACK_HOST_ENV = {"VLLM_HOST_IP": "127.0.0.1"}


def use_loopback_host() -> None:
    """Make this process (and the children it starts) advertise 127.0.0.1 (test sessions call it)."""
    os.environ.update(LOOPBACK_HOST_ENV)


# Ports a test may use next to the one it was given (port + rank): not handed out again.
_SPAN = 8
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """Where the kernel's ephemeral range starts: every bind to port 0 and every outgoing connection
    of every process on the machine (vLLM's own ZMQ ports, the engines' clients) picks from there."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, below the ephemeral range: a port from the kernel's
    ephemeral range could be taken by another process (an engine starting beside the test) between
    this call and the bind that uses it. Racy by nature still: use it at once."""
    low = _ephemeral_low()
    rng = random.Random()
    if low - 2048 > 10_000:
        for _ in range(500):
            port = rng.randrange(10_000, low - _SPAN)
            if any(p in _handed_out for p in range(port, port + _SPAN)):
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed_out.update(range(port, port + _SPAN))
            return port
    with socket.socket() as s:  # an unusual ephemeral range: let the kernel choose
        s.bind((host, 0))
        return int(s.getsockname()[1])
