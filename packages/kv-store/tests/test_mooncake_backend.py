"""The shared Backend contract against a real mooncake_master, plus Mooncake's failure modes."""

from __future__ import annotations

import ctypes
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


def _address(buffer: bytearray, offset: int = 0) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer)) + offset


def test_parts_by_address_roundtrip_and_refusals(mooncake_master):
    """The store core hands a pass's parts as addresses; every part must lie inside one registered
    buffer, or the call reads / writes nothing."""
    b = MooncakeBackend(mooncake_options(mooncake_master.address))
    try:
        src, dst = bytearray(b"a" * 3000 + b"b" * 5000 + b"t" * 16), bytearray(8016)
        b.register_buffer(memoryview(src))
        b.register_buffer(memoryview(dst))
        sizes = [[3000, 5000, 16]]
        rows = [[_address(src), _address(src, 3000), _address(src, 8000)]]
        assert b.batch_put_parts_at(["k"], rows, sizes) == [True]
        split = [[_address(dst), _address(dst, 5000)]], [[5000, 3016]]
        assert b.batch_get_parts_at(["k"], *split) == [8016]
        assert bytes(dst) == bytes(src)
        assert b.batch_get_parts_at(["missing"], *split) == [-1]
        # another size than stored: never a partial value
        assert b.batch_get_parts_at(["k"], [[_address(dst)]], [[4000]]) == [-1]

        plain = bytearray(8016)  # not registered
        dst[:] = bytes(8016)
        refused = [
            ([[_address(plain)]], [[8016]]),  # outside every registration
            ([[_address(dst, 8000)]], [[32]]),  # runs past the end of one
            ([[_address(dst), _address(dst, 5000)]], [[5000, -1]]),  # a negative size
            ([[_address(dst)], [_address(dst), _address(dst, 5000)]], [[8016], [5000, 3016]]),  # ragged rows
            ([[_address(dst)]], [[8016], [8016]]),  # rows for another number of keys
        ]
        for addresses, part_sizes in refused:
            assert b.batch_get_parts_at(["k"] * len(part_sizes), addresses, part_sizes) == [-1] * len(part_sizes)
            assert b.batch_put_parts_at(["k3"] * len(part_sizes), addresses, part_sizes) == [False] * len(part_sizes)
        assert bytes(plain) == bytes(8016) and bytes(dst) == bytes(8016)  # nothing written
        assert b.batch_exists(["k3"]) == [False]  # nothing read and stored
    finally:
        b.close()


def test_a_subclass_overriding_a_parts_call_does_not_inherit_the_address_calls():
    class Gated(MooncakeBackend):
        def batch_get_parts(self, keys, parts):  # e.g. a test double that blocks loads
            return super().batch_get_parts(keys, parts)

    class Plain(MooncakeBackend):
        pass

    assert not Gated.capabilities.parts_at_address and Gated.capabilities.zero_copy_parts
    assert not Gated.__new__(Gated).capabilities.parts_at_address
    assert Plain.__new__(Plain).capabilities.parts_at_address


def test_the_worker_moves_values_by_address_and_they_read_back_through_staging(mooncake_master):
    """A worker over Mooncake saves and loads straight between the KV cache and the store by
    address; the values are the bytes the staging path writes and reads (same keys, same check)."""
    torch = pytest.importorskip("torch")
    from kv_store.config import StoreConnectorConfig
    from kv_store.metadata import BlockTransfer, StorePlan
    from kv_store.worker import StoreWorker

    b = MooncakeBackend(mooncake_options(mooncake_master.address))
    calls = {"put": 0, "get": 0}
    put_at, get_at = b.batch_put_parts_at, b.batch_get_parts_at

    def counting_put(*args):
        calls["put"] += 1
        return put_at(*args)

    def counting_get(*args):
        calls["get"] += 1
        return get_at(*args)

    b.batch_put_parts_at, b.batch_get_parts_at = counting_put, counting_get
    torch.manual_seed(3)
    caches = {f"layer{i}": torch.randn(12, 2, 4, 8) for i in range(3)}
    workers = []
    try:
        for zero_copy in (True, False):
            # no load deadline: this client's calls are not bounded within one (zero copy needs that)
            w = StoreWorker(backend=b, namespace="ns", rank_tag="r0", zero_copy=zero_copy,
                            config=StoreConnectorConfig(staging_bytes=1 << 14, load_timeout_s=0))
            w.register_kv_caches(caches)
            workers.append(w)
        by_address, staging = workers
        hs = [bytes([i]) * 8 for i in range(4)]
        by_address.submit_saves(StorePlan(saves=[BlockTransfer(request_id="s", block_hashes=hs, block_ids=[[0, 1, 2, 3]])]))
        by_address.wait_for_request_saves(["s"])
        assert calls["put"] >= 1
        for worker, ids in ((by_address, [4, 5, 6, 7]), (staging, [8, 9, 10, 11])):
            worker.load_sync(StorePlan(loads=[BlockTransfer(request_id=f"l{ids[0]}", block_hashes=hs, block_ids=[ids])]))
            assert not worker.ledger.take_block_ids_with_load_errors()
            for layer in caches.values():
                assert torch.equal(layer[ids], layer[[0, 1, 2, 3]])
        assert calls["get"] >= 1
    finally:
        for w in workers:
            w.close(5.0)
        b.close()
