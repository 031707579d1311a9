"""UcmBackend logic against a test double of UcmStore (FakeUcmStore: no UCM, runs on Python 3.11).

The same backend over the real UCM Posix store is in test_ucm_backend_posix.py (Python 3.12).
"""

from __future__ import annotations

import pytest
from kv_ucm.block_ids import ucm_key_id
from kv_ucm.ucm_backend import UcmBackend
from kv_ucm.ucm_store import CODE_NOT_FOUND, UcmError


class FakeUcmStore:
    """Test double with UcmStore's per-block interface (a dict of id -> bytes)."""

    def __init__(self, blocks, config, *, tensor_size=None, tensors_per_block=1, connector_name=None,
                 lookup_only=False):
        self.blocks = blocks
        self.config = config
        self.tensor_size = tensor_size
        self.lookup_only = lookup_only
        self.connector_name = connector_name
        self.closed = False
        self.fail_dump: Exception | None = None
        self.fail_load: Exception | None = None
        self.dumped: list[bytes] = []

    def lookup(self, ids):
        return [i in self.blocks for i in ids]

    def lookup_on_prefix(self, ids):
        n = 0
        for i in ids:
            if i not in self.blocks:
                break
            n += 1
        return n

    def dump(self, ids, bufs):
        assert not self.lookup_only
        if self.fail_dump:
            raise self.fail_dump
        for i, b in zip(ids, bufs, strict=True):
            assert memoryview(b).nbytes == self.tensor_size
            self.blocks[i] = bytes(b)
            self.dumped.append(i)
        return [True] * len(ids)

    def load(self, ids, bufs):
        if self.fail_load:
            raise self.fail_load
        out = []
        for i, b in zip(ids, bufs, strict=True):
            data = self.blocks.get(i)
            if data is None or len(data) < self.tensor_size:
                out.append(False)
                continue
            memoryview(b)[:] = data[: self.tensor_size]
            out.append(True)
        return out

    def close(self):
        self.closed = True


class Factory:
    def __init__(self):
        self.blocks = {}
        self.opened: list[FakeUcmStore] = []

    def __call__(self, config, **kwargs):
        store = FakeUcmStore(self.blocks, config, **kwargs)
        self.opened.append(store)
        return store


ENTRY = {"ucm_connector_name": "UcmPipelineStore",
         "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": "/kv"}}


def make(**kwargs):
    factory = Factory()
    return UcmBackend(ENTRY, store_factory=factory, **kwargs), factory


def test_store_opens_lazily_with_the_first_value_size():
    backend, factory = make()
    assert factory.opened == []
    assert backend.batch_exists(["k"]) == [False]  # lookups need no size
    assert factory.opened[0].tensor_size is None
    assert backend.batch_put(["k"], [b"\x01" * 64]) == [True]
    # the lookup-only store is replaced by one sized for 64-byte values, one tensor per block
    assert [s.tensor_size for s in factory.opened] == [None, 64]
    assert factory.opened[0].closed
    assert backend.value_size == 64
    assert factory.blocks == {ucm_key_id("k"): b"\x01" * 64}
    assert factory.opened[1].connector_name == "UcmPipelineStore"
    assert factory.opened[1].config == ENTRY["ucm_connector_config"]


def test_value_size_given_up_front_and_scheduler_lookup_only():
    backend, factory = make(value_size=4096, lookup_only=True)
    assert len(factory.opened) == 1
    store = factory.opened[0]
    assert store.tensor_size == 4096 and store.lookup_only
    assert backend.batch_exists(["a"]) == [False]
    assert len(factory.opened) == 1


def test_bare_connector_config_is_accepted():
    factory = Factory()
    backend = UcmBackend({"store_pipeline": "Posix", "storage_backends": "/kv"}, store_factory=factory, value_size=8)
    assert factory.opened[0].config == {"store_pipeline": "Posix", "storage_backends": "/kv"}
    assert factory.opened[0].connector_name is None  # UcmStore's default (UcmPipelineStore)
    backend.close()


def test_roundtrip_prefix_and_per_key_results():
    backend, _ = make()
    assert backend.batch_put(["a", "b"], [b"A" * 16, b"B" * 16]) == [True, True]
    assert backend.batch_exists(["a", "x", "b"]) == [True, False, True]
    assert backend.lookup_prefix(["a", "b", "x", "a"]) == 2
    assert backend.lookup_prefix([]) == 0
    bufs = [bytearray(16) for _ in range(3)]
    assert backend.batch_get_into(["a", "x", "b"], [memoryview(b) for b in bufs]) == [16, -1, 16]
    assert bufs[0] == b"A" * 16 and bufs[1] == bytes(16) and bufs[2] == b"B" * 16
    assert backend.counters["get_ok"] == 2 and backend.counters["get_missed"] == 1


def test_existing_key_keeps_its_value():
    backend, factory = make()
    assert backend.batch_put(["a"], [b"1" * 8]) == [True]
    assert backend.batch_put(["a", "b"], [b"2" * 8, b"3" * 8]) == [True, True]
    assert factory.blocks[ucm_key_id("a")] == b"1" * 8
    assert factory.opened[-1].dumped == [ucm_key_id("a"), ucm_key_id("b")]


def test_other_sizes_are_per_key_failures_not_overruns():
    backend, _ = make(value_size=32)
    assert backend.batch_put(["a", "b"], [b"x" * 32, b"y" * 31]) == [True, False]
    guard = bytearray(64)
    small = memoryview(guard)[:16]
    assert backend.batch_get_into(["a"], [small]) == [-1]
    assert guard == bytes(64)
    # a first buffer of another size fails the whole batch cleanly
    assert backend.batch_put(["c"], [b"z" * 8]) == [False]
    assert backend.counters["size_mismatch"] == 3


def test_failed_dump_is_counted_and_logged_never_raised(caplog):
    backend, factory = make(value_size=8)
    factory.opened[0].fail_dump = UcmError("dump", -50011, "unhealthy")
    assert backend.batch_put(["a", "b"], [b"1" * 8, b"2" * 8]) == [False, False]
    assert backend.counters["put_failed"] == 2 and backend.counters["put_errors"] == 1
    assert "UCM dump" in caplog.text
    factory.opened[0].fail_dump = None
    assert backend.batch_put(["a"], [b"1" * 8]) == [True]


def test_failed_load_is_a_miss_not_an_exception():
    backend, factory = make(value_size=8)
    backend.batch_put(["a"], [b"1" * 8])
    factory.opened[0].fail_load = UcmError("load", CODE_NOT_FOUND, "gone")
    assert backend.batch_get_into(["a"], [memoryview(bytearray(8))]) == [-1]
    assert backend.counters["get_errors"] == 1


def test_lookup_failure_raises_backend_error():
    """The scheduler counts a raising lookup as a miss; the backend reports it as BackendError."""
    from kv_common.backend import BackendError

    backend, factory = make(value_size=8)

    def broken(ids):
        raise UcmError("lookup", -50011, "unhealthy")

    factory.opened[0].lookup = broken
    with pytest.raises(BackendError):
        backend.batch_exists(["a"])


def test_close_closes_the_store_and_refuses_reopening():
    backend, factory = make(value_size=8)
    backend.close()
    assert factory.opened[0].closed
    with pytest.raises(UcmError, match="closed"):
        backend.batch_exists(["a"])
    assert backend.batch_put(["a"], [b"1" * 8]) == [False]  # still not an exception
    assert backend.counters["put_errors"] == 1 and backend.counters["size_mismatch"] == 0


def test_argument_checks():
    backend, _ = make()
    with pytest.raises(ValueError):
        backend.batch_put(["a"], [])
    with pytest.raises(ValueError):
        backend.batch_get_into(["a"], [])
    assert backend.batch_put([], []) == [] and backend.batch_get_into([], []) == [] and backend.batch_exists([]) == []


def test_ucm_values_are_announced_as_storage_in_kv_events():
    """kv-store's BlockStored / BlockRemoved name the tier in vLLM's medium values: UCM's Posix store
    is disk (local or NFS), so a router can rank it below a copy in host memory."""
    from kv_common.backend import MEDIUM_STORAGE
    from kv_ucm.ucm_backend import UcmBackend

    assert UcmBackend.kv_event_medium == MEDIUM_STORAGE == "STORAGE"


def test_buffer_addresses_are_the_bytes_ucm_reads_and_writes():
    """The address handed to UCM for each buffer kind (writable ones through ctypes, read-only ones
    through numpy) is the first byte of that buffer; a read-only buffer is refused for a load."""
    import ctypes

    import numpy as np
    from kv_ucm.ucm_store import _address_and_size

    backing = bytearray(range(256)) * 4
    keep: list = []
    whole = memoryview(backing)
    for buf in (whole[100:164], whole.cast("I")[8:24], bytes(backing[:64]), np.arange(16, dtype=np.float32)):
        writable = not memoryview(buf).readonly
        addr, size = _address_and_size(buf, writable, keep)
        assert size == memoryview(buf).nbytes
        assert ctypes.string_at(addr, size) == memoryview(buf).tobytes()
    with pytest.raises(ValueError, match="writable"):
        _address_and_size(b"read only", True, keep)
    with pytest.raises(ValueError, match="contiguous"):
        _address_and_size(whole[::2], False, keep)
