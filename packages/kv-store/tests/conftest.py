"""A real ``mooncake_master`` on a free loopback port, killed at teardown."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> str | None:
    found = shutil.which("mooncake_master")
    if found:
        return found
    candidate = Path(sys.executable).parent / "mooncake_master"
    return str(candidate) if candidate.exists() else None


class Master:
    def __init__(self, extra_flags: list[str] | None = None, port: int | None = None) -> None:
        binary = master_binary()
        if binary is None:
            pytest.skip("mooncake_master not installed (pip install kv-store[mooncake])")
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        cmd = [
            binary, f"-rpc_port={self.port}", "-rpc_address=127.0.0.1",
            "-metrics_host=127.0.0.1", f"-metrics_port={free_port()}", *(extra_flags or []),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError("mooncake_master did not listen within 10 s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def mooncake_master():
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    master = Master()
    try:
        yield master
    finally:
        master.kill()


def mooncake_options(address: str, segment: int = 64 << 20) -> dict:
    return {
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
        "device_name": "", "master_server_address": address,
        "global_segment_size": segment, "local_buffer_size": 16 << 20,
    }
