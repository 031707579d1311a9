"""Free TCP ports for tests and benchmarks (one helper for the whole tree), and the address tests
give their engines."""

from __future__ import annotations

import os
import socket

# Tests run every peer on this machine and reach it at 127.0.0.1: connectors advertise this machine's
# address as vLLM finds it (``kv_common.vllm_compat.host_ip``, VLLM_HOST_IP first), so tests pin it
# here, in one place. A test of several hosts gives each host's processes their own VLLM_HOST_IP.
LOOPBACK_HOST_ENV = {"VLLM_HOST_IP": "127.0.0.1"}


def use_loopback_host() -> None:
    """Make this process (and the children it starts) advertise 127.0.0.1 (test sessions call it)."""
    os.environ.update(LOOPBACK_HOST_ENV)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (racy by nature: use it at once)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
