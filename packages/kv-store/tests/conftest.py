"""A real ``mooncake_master`` on a free loopback port (``kv_store.testing.MooncakeMaster``), stopped
at teardown; tests that need one are skipped where Mooncake is not installed."""

from __future__ import annotations

import os

import pytest
from kv_common.testing.ports import use_loopback_host
from kv_store.testing import MooncakeMaster

use_loopback_host()  # the master and every client of these tests run on this machine


@pytest.fixture
def mooncake_master():
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if MooncakeMaster.executable() is None:
        pytest.skip("mooncake_master not installed (pip install kv-store[cpu])")
    with MooncakeMaster() as master:
        try:
            yield master
        finally:
            master.kill()  # SIGKILL: a graceful stop only adds seconds per test


def mooncake_options(address: str, segment: int = 64 << 20) -> dict:
    return {
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
        "device_name": "", "master_server_address": address,
        "global_segment_size": segment, "local_buffer_size": 16 << 20,
    }
