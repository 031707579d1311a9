"""The shared Backend contract against a real mooncake_master, plus Mooncake's failure modes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("mooncake.store")

from conftest import mooncake_options  # noqa: E402
from kv_common.backend import BackendError  # noqa: E402
from kv_common.testing.backend_contract import BackendContract  # noqa: E402
from kv_store.config import MooncakeOptions, resolve_mooncake  # noqa: E402
from kv_store.mooncake_backend import MooncakeBackend  # noqa: E402


@pytest.fixture
def backend(mooncake_master):
    b = MooncakeBackend(mooncake_options(mooncake_master.address))
    yield b
    b.close()


class TestMooncakeContract(BackendContract):
    pass


def test_master_killed_gives_misses_not_crashes(mooncake_master):
    b = MooncakeBackend(mooncake_options(mooncake_master.address))
    raw = bytearray(8192)
    b.register_buffer(memoryview(raw))
    view = memoryview(raw)
    assert b.batch_put(["k"], [view[:4096]]) == [True]
    mooncake_master.kill()
    assert b.batch_exists(["k", "x"]) == [False, False]
    assert b.batch_get_into(["k"], [view[4096:]]) == [-1]
    assert b.batch_put(["k2"], [view[:4096]]) == [False]
    b.close()


def test_setup_without_master_fails_fast():
    from kv_common.testing.ports import free_port

    with pytest.raises(BackendError, match="setup"):
        MooncakeBackend(mooncake_options(f"127.0.0.1:{free_port()}"), setup_retries=1, setup_timeout_s=30)


def test_mooncake_config_path_json_and_inline_override(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({
        "local_hostname": "10.0.0.1", "metadata_server": "P2PHANDSHAKE", "master_server_address": "10.0.0.2:50051",
        "global_segment_size": "64mb", "local_buffer_size": 1048576, "protocol": "tcp", "device_name": "",
    }))
    resolved = resolve_mooncake(MooncakeOptions(config_path=str(path), local_hostname="127.0.0.1"))
    assert resolved["master_server_address"] == "10.0.0.2:50051"
    assert resolved["local_hostname"] == "127.0.0.1"
    assert resolved["global_segment_size"] == 64 << 20
    env = {"MOONCAKE_CONFIG_PATH": str(path)}
    assert resolve_mooncake(MooncakeOptions(), environ=env)["local_buffer_size"] == 1 << 20
    with pytest.raises(ValueError, match="master"):
        resolve_mooncake(MooncakeOptions(), environ={})


def test_parts_roundtrip_zero_copy_and_size_mismatch(mooncake_master):
    b = MooncakeBackend(mooncake_options(mooncake_master.address))
    src, dst = bytearray(b"a" * 3000 + b"b" * 5000 + b"t" * 16), bytearray(8016)
    b.register_buffer(memoryview(src))
    b.register_buffer(memoryview(dst))
    s, d = memoryview(src), memoryview(dst)
    assert b.batch_put_parts(["k"], [[s[:3000], s[3000:8000], s[8000:]]]) == [True]
    assert b.batch_get_parts(["k", "missing"], [[d[:5000], d[5000:8016]], [d[:10]]]) == [8016, -1]
    assert bytes(dst) == bytes(src)
    # another size than stored: never a partial value
    assert b.batch_get_parts(["k"], [[d[:4000]]]) == [-1]
    # unregistered buffers: copied through the bytes API, same result
    plain = bytearray(8016)
    assert b.batch_get_parts(["k"], [[memoryview(plain)]]) == [8016]
    assert bytes(plain) == bytes(src)
    assert b.batch_put_parts(["k2"], [[memoryview(bytearray(b"xy"))]]) == [True]
    assert b.batch_get(["k2"]) == [b"xy"]
    b.close()


def test_embedded_store_backend_parts(tmp_path):
    from kv_store.embedded import EmbeddedStoreBackend

    b = EmbeddedStoreBackend(1 << 20, spill_dir=tmp_path, write_through=True)
    assert b.batch_put_parts(["k"], [[memoryview(b"abc"), memoryview(b"de")]]) == [True]
    out1, out2 = bytearray(1), bytearray(4)
    assert b.batch_get_parts(["k", "x"], [[memoryview(out1), memoryview(out2)], [memoryview(out1)]]) == [5, -1]
    assert bytes(out1 + out2) == b"abcde"
    assert b.batch_get_parts(["k"], [[memoryview(bytearray(4))]]) == [-1]
    fresh = EmbeddedStoreBackend(1 << 20, spill_dir=tmp_path)  # another process: through the file
    assert fresh.batch_get_parts(["k"], [[memoryview(out2), memoryview(out1)]]) == [5]
    assert bytes(out2 + out1) == b"abcde"


def test_the_store_client_advertises_this_machines_address_by_default(monkeypatch):
    """A client that tells a remote master 127.0.0.1 cannot be reached by the other clients: the default
    is this machine's address as vLLM finds it (VLLM_HOST_IP first); an explicit local_hostname wins."""
    monkeypatch.setenv("VLLM_HOST_IP", "10.9.8.7")
    env = {"MOONCAKE_MASTER": "10.0.0.2:50051"}
    assert resolve_mooncake(MooncakeOptions(), environ=env)["local_hostname"] == "10.9.8.7"
    assert resolve_mooncake(MooncakeOptions(local_hostname="10.0.0.1"), environ=env)["local_hostname"] == "10.0.0.1"


# ---- issue 25: puts without an exists round trip, and how long a call can take ----------------

def test_a_put_of_a_stored_key_is_a_success_by_its_code():
    from kv_store.mooncake_backend import OBJECT_ALREADY_EXISTS, OBJECT_NOT_FOUND, put_succeeded

    assert put_succeeded(0) and put_succeeded(OBJECT_ALREADY_EXISTS)
    for code in (-1, -200, OBJECT_NOT_FOUND, -800, -900):
        assert not put_succeeded(code), code


def test_mooncake_moves_the_whole_request_in_one_call_bounded_by_its_setup_timeouts(mooncake_master, monkeypatch):
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "2000")
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "3")
    b = MooncakeBackend(mooncake_options(mooncake_master.address))
    assert b.pass_bytes is None
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "300")  # not what this client was set up with
    assert b.call_bound_s(0) == pytest.approx(5.0)
    b.close()


def test_the_call_bound_comes_from_mooncakes_own_timeouts(monkeypatch):
    from kv_store.mooncake_backend import mooncake_call_bound_s

    monkeypatch.delenv("MC_RPC_TIMEOUT_MS", raising=False)
    monkeypatch.delenv("MC_TCP_PROGRESS_TIMEOUT_SEC", raising=False)
    assert mooncake_call_bound_s("tcp", 0) == pytest.approx(60.0)  # 30 s RPC + 30 s transfer
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "2000")
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "3")
    assert mooncake_call_bound_s("tcp", 10**9) == pytest.approx(6.0)
    assert mooncake_call_bound_s("rdma", 0) is None  # not measured: unbounded, staging under a deadline
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "soon")
    assert mooncake_call_bound_s("tcp", 0) is None


def test_a_default_store_config_bounds_mooncake_within_the_load_deadline(mooncake_master, monkeypatch):
    """kv-store's defaults: Mooncake's calls end within load_timeout_s, so loads go straight into the
    KV cache (no staging copy). An operator's own Mooncake timeouts win."""
    from kv_store.backends import make_mooncake_backend
    from kv_store.config import StoreConfig

    monkeypatch.delenv("MC_RPC_TIMEOUT_MS", raising=False)
    monkeypatch.delenv("MC_TCP_PROGRESS_TIMEOUT_SEC", raising=False)
    config = StoreConfig(backend="mooncake", mooncake=MooncakeOptions(
        master_server_address=mooncake_master.address, metadata_server="P2PHANDSHAKE", protocol="tcp",
        local_hostname="127.0.0.1", device_name="", global_segment_size=64 << 20, local_buffer_size=16 << 20))
    b = make_mooncake_backend(config)
    try:
        bound = b.call_bound_s(256 << 20)
        assert bound is not None and bound < config.load_timeout_s
    finally:
        b.close()
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "30000")
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "30")
    b = make_mooncake_backend(config)
    try:
        assert b.call_bound_s(0) == pytest.approx(60.0)  # the operator's: staging under the deadline
    finally:
        b.close()


@pytest.mark.parametrize("load_timeout_s", [0.5, 1.0, 2.0, 4.0, 10.0, 30.0, 600.0])
def test_the_timeouts_kv_store_sets_fit_every_load_deadline(load_timeout_s):
    from kv_store.mooncake_backend import call_timeouts_within, mooncake_call_bound_s

    settings = call_timeouts_within(load_timeout_s)
    bound = mooncake_call_bound_s("tcp", 256 << 20, settings)
    assert bound is not None
    if load_timeout_s >= 4.0:
        assert bound < load_timeout_s
    assert all(float(v) >= 1 for v in (float(settings[k]) / 1000 if k.endswith("_MS") else settings[k]
                                       for k in settings))  # never under a second each
    assert bound <= 8.3  # never longer than kv-store's defaults (3 s RPC, 5 s without progress)
    assert call_timeouts_within(0) == {}  # no deadline: Mooncake's own defaults stay


def test_a_frozen_segment_holder_ends_a_get_within_the_call_bound(mooncake_master, monkeypatch):
    """The bound is what lets a load under a deadline go straight into the KV cache: a get from a
    holder that stopped answering must end by itself within it."""
    import os
    import signal
    import time

    from kv_common.testing.freeze import freeze
    from kv_store.testing import MooncakeClient

    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "1000")
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "2")
    with MooncakeClient(mooncake_master.address, segment="64MB") as holder:
        b = MooncakeBackend(mooncake_options(mooncake_master.address, segment=0))
        raw = bytearray(2 << 20)
        view = memoryview(raw)
        b.register_buffer(view)
        assert b.batch_put(["k"], [view[: 1 << 20]]) == [True]
        assert holder.proc is not None
        freeze(holder.proc.pid)
        try:
            t0 = time.monotonic()
            assert b.batch_get_into(["k"], [view[1 << 20 :]]) == [-1]
            took = time.monotonic() - t0
        finally:
            os.kill(holder.proc.pid, signal.SIGCONT)
        bound = b.call_bound_s(1 << 20)
        assert bound is not None and took <= bound + 1.0, (took, bound)  # 1 s: a descheduled test thread
        b.close()
