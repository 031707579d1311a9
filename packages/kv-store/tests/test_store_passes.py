"""The store path at the backend's speed (issue 25): passes of the backend's size, puts without an
exists round trip, zero-copy loads under a deadline when the backend bounds its own calls, and the
check overlapped with the next call, all failing closed."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kv_common.backend import CACHE_PASS_BYTES  # noqa: E402
from kv_common.embedded_backend import EmbeddedBackend  # noqa: E402
from kv_store.config import StoreConnectorConfig  # noqa: E402
from kv_store.embedded import EmbeddedStoreBackend  # noqa: E402
from kv_store.metadata import BlockTransfer, StorePlan  # noqa: E402
from kv_store.passes import blocks_per_call, double_buffered, spans  # noqa: E402
from kv_store.worker import StoreWorker  # noqa: E402

BS = 4


class CountingStoreBackend(EmbeddedStoreBackend):
    """kv-store's embedded backend (nothing faked) counting its calls, with a settable pass size;
    ``slow_get_s`` delays every parts get after the first (a call still in flight while the
    first pass is checked)."""

    call_bound_s = EmbeddedStoreBackend.call_bound_s  # it copies memory as its base does

    def __init__(self, *a, pass_bytes=None, slow_get_s=0.0, **kw):
        super().__init__(*a, **kw)
        if pass_bytes is not None:
            self.pass_bytes = pass_bytes
        self.slow_get_s = slow_get_s
        self.calls = {"exists": 0, "put": 0, "put_parts": 0, "get_into": 0, "get_parts": 0}
        self.last_get_end = 0.0
        self._lock = threading.Lock()

    def _count(self, op):
        with self._lock:
            self.calls[op] += 1
            return self.calls[op]

    def batch_exists(self, keys):
        self._count("exists")
        return super().batch_exists(keys)

    def batch_put(self, keys, values):
        self._count("put")
        return super().batch_put(keys, values)

    def batch_put_parts(self, keys, parts):
        self._count("put_parts")
        return super().batch_put_parts(keys, parts)

    def batch_get_into(self, keys, buffers):
        self._count("get_into")
        return super().batch_get_into(keys, buffers)

    def batch_get_parts(self, keys, parts):
        if self._count("get_parts") > 1 and self.slow_get_s:
            time.sleep(self.slow_get_s)
        out = super().batch_get_parts(keys, parts)
        self.last_get_end = time.monotonic()
        return out


class UnboundedCountingBackend(CountingStoreBackend):
    """The same, but its bound (say, Mooncake's default timeouts) is longer than the deadline."""

    def call_bound_s(self, nbytes):
        return 3600.0


def make_worker(backend, seed=0, blocks=24, zero_copy=True, **cfg):
    torch.manual_seed(seed)
    caches = {f"layer{i}": torch.randn(blocks, 2, BS, 8) for i in range(3)}
    worker = StoreWorker(backend=backend, namespace="ns", rank_tag="r0",
                         config=StoreConnectorConfig(staging_bytes=1 << 14, **cfg), zero_copy=zero_copy)
    worker.register_kv_caches(caches)
    return worker, caches


def hashes(n):
    return [bytes([i + 1]) * 32 for i in range(n)]


def save(worker, hs, ids, req="s"):
    worker.submit_saves(StorePlan(saves=[BlockTransfer(request_id=req, block_hashes=hs, block_ids=[ids])]))
    worker.wait_for_request_saves([req])
    assert worker.get_finished({req}) == {req}


def load(worker, hs, ids, req="l"):
    worker.load_sync(StorePlan(loads=[BlockTransfer(request_id=req, block_hashes=hs, block_ids=[ids])]))
    return worker.ledger.take_block_ids_with_load_errors()


def corrupt(backend, key):
    raw = bytearray(backend.batch_get([key])[0])
    raw[3] ^= 0xFF
    backend.batch_remove([key])
    backend.batch_put([key], [bytes(raw)])


# ---- puts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("zero_copy", [True, False], ids=["parts", "staging"])
def test_a_save_asks_no_exists_and_a_stored_block_saves_as_ok(zero_copy):
    backend = CountingStoreBackend(64 << 20)
    worker, caches = make_worker(backend, zero_copy=zero_copy)
    hs = hashes(4)
    save(worker, hs, [1, 2, 3, 4])
    save(worker, hs, [5, 6, 7, 8], req="again")  # every block is stored already
    assert backend.calls["exists"] == 0, "a save asked the backend whether its blocks exist"
    counters = worker.stats.reduce()
    assert counters["blocks_saved"] == 8 and "blocks_save_failed" not in counters, counters
    assert load(worker, hs, [9, 10, 11, 12]) == set()
    for c in caches.values():
        assert torch.equal(c[9:13], c[1:5]), "the stored value was replaced by the second save"
    worker.close(1)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["parts", "staging"])
def test_saves_and_loads_in_many_overlapped_passes_round_trip(zero_copy):
    """One block per backend call: each pass is sealed (gathered) while the previous put runs, in
    alternating halves of the rows, and checked while the next get runs."""
    probe = CountingStoreBackend(64 << 20)
    worker, _ = make_worker(probe)
    one_value = worker.value_size
    worker.close(1)
    backend = CountingStoreBackend(64 << 20, pass_bytes=one_value)
    worker, caches = make_worker(backend, zero_copy=zero_copy)
    hs = hashes(10)  # more blocks than staging rows (1 << 14 bytes): several rounds
    save(worker, hs, list(range(10)))
    assert backend.calls["put_parts" if zero_copy else "put"] == 10
    assert load(worker, hs, list(range(12, 22))) == set()
    for c in caches.values():
        assert torch.equal(c[12:22], c[0:10])
    worker.close(1)


# ---- loads under a deadline ------------------------------------------------------------------

def round_trip(backend, **cfg):
    """Save blocks 1-4, load them into 9-12 (intact); the backend's call counts."""
    worker, caches = make_worker(backend, **cfg)
    hs = hashes(4)
    save(worker, hs, [1, 2, 3, 4])
    assert load(worker, hs, [9, 10, 11, 12]) == set()
    for c in caches.values():
        assert torch.equal(c[9:13], c[1:5])
    worker.close(1)
    return backend.calls


def test_a_load_under_a_deadline_goes_straight_into_the_kv_cache():
    calls = round_trip(CountingStoreBackend(64 << 20), load_timeout_s=10.0)
    assert calls["get_into"] == 0 and calls["get_parts"] >= 1, calls


def test_a_backend_bounded_beyond_the_deadline_loads_through_staging():
    calls = round_trip(UnboundedCountingBackend(64 << 20), load_timeout_s=10.0)
    assert calls["get_parts"] == 0 and calls["get_into"] >= 1, calls


@pytest.mark.parametrize("bad", ["corrupt", "missing"])
def test_a_zero_copy_load_under_a_deadline_fails_closed(bad):
    """A bad block in the first pass while the next pass's get is still in flight: the bad block
    and every later one are load errors, the blocks before it are loaded, and the load returns
    only after the in-flight get ended (nothing lands in a block vLLM recomputes)."""
    probe = CountingStoreBackend(64 << 20)
    worker, _ = make_worker(probe)
    two_values = 2 * worker.value_size
    worker.close(1)
    backend = CountingStoreBackend(64 << 20, pass_bytes=two_values)
    worker, caches = make_worker(backend, load_timeout_s=10.0)
    hs = hashes(6)
    save(worker, hs, [1, 2, 3, 4, 5, 6])
    key = worker.keys([hs[1]])[0]
    if bad == "corrupt":
        corrupt(backend, key)
    else:
        backend.batch_remove([key])
    backend.slow_get_s = 0.3  # the second pass is still being fetched when the first is checked
    before = {name: c[12:18].clone() for name, c in caches.items()}
    failed = load(worker, hs, [12, 13, 14, 15, 16, 17])
    returned = time.monotonic()
    assert failed == {13, 14, 15, 16, 17}
    assert backend.calls["get_into"] == 0, "not the zero-copy path"
    assert backend.last_get_end <= returned, "the load returned while a get still wrote into the KV cache"
    for name, c in caches.items():
        assert torch.equal(c[12], c[1]), name  # the intact block before the bad one is loaded
        if bad == "missing":
            assert torch.equal(c[13], before[name][1]), "a missing value wrote into its block"
    assert worker.stats.failures.get("corrupt" if bad == "corrupt" else "miss") == 1
    worker.close(1)


def poll_finished(worker, aborted=frozenset(), limit_s=10.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done = worker.take_finished_loads(set(aborted))
        if done:
            return done, time.monotonic()
        time.sleep(0.01)
    raise AssertionError(f"nothing reported within {limit_s}s")


def test_an_async_load_under_a_deadline_goes_straight_into_the_kv_cache():
    backend = CountingStoreBackend(64 << 20)
    worker, caches = make_worker(backend, load_mode="async", load_timeout_s=10.0)
    hs = hashes(4)
    save(worker, hs, [1, 2, 3, 4])
    worker.start_async(StorePlan(loads=[BlockTransfer(request_id="x", block_hashes=hs, block_ids=[[9, 10, 11, 12]])]))
    assert poll_finished(worker)[0] == {"x"}
    assert worker.ledger.take_block_ids_with_load_errors() == set()
    assert backend.calls["get_into"] == 0 and backend.calls["get_parts"] >= 1, backend.calls
    for c in caches.values():
        assert torch.equal(c[9:13], c[1:5])
    worker.close(1)


def test_an_async_zero_copy_load_aborted_mid_call_is_reported_only_once_no_call_runs():
    """vLLM frees an aborted request's blocks once it is reported: with the backend writing into
    them, that must wait for the call in flight."""
    probe = CountingStoreBackend(64 << 20)
    worker, _ = make_worker(probe)
    two_values = 2 * worker.value_size
    worker.close(1)
    backend = CountingStoreBackend(64 << 20, pass_bytes=two_values)
    worker, caches = make_worker(backend, load_mode="async", load_timeout_s=10.0)
    hs = hashes(6)
    save(worker, hs, [1, 2, 3, 4, 5, 6])
    backend.slow_get_s = 0.4
    worker.start_async(StorePlan(loads=[BlockTransfer(request_id="x", block_hashes=hs,
                                                      block_ids=[[12, 13, 14, 15, 16, 17]])]))
    deadline = time.monotonic() + 10
    while backend.calls["get_parts"] < 2:  # the second call is in flight
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert worker.take_finished_loads({"x"}) == set(), "reported while a get still writes into its blocks"
    done, reported = poll_finished(worker, aborted=frozenset({"x"}))
    assert done == {"x"}
    assert backend.last_get_end <= reported
    assert worker.ledger.take_block_ids_with_load_errors() == set()  # aborted: nobody recomputes it
    assert worker.leak_report()["pending_loads"] == 0
    worker.close(1)


# ---- pass plans ------------------------------------------------------------------------------

@given(n=st.integers(0, 300), value_size=st.integers(1, 1 << 22), pass_bytes=st.one_of(st.none(), st.integers(1, 1 << 26)),
       slots=st.integers(1, 64))
def test_double_buffered_passes_cover_the_blocks_in_rows_that_never_overlap(n, value_size, pass_bytes, slots):
    passes, offset = double_buffered(n, value_size, pass_bytes, slots)
    assert [i for lo, hi in passes for i in range(lo, hi)] == list(range(n))
    for k, (lo, hi) in enumerate(passes):
        first_row = (k % 2) * offset
        assert first_row + (hi - lo) <= slots  # fits the rows
        if offset and k:
            prev_lo, prev_hi = passes[k - 1]
            prev_first = ((k - 1) % 2) * offset
            # neighbours (one prepared while the other is in flight) use disjoint rows
            assert first_row + (hi - lo) <= prev_first or prev_first + (prev_hi - prev_lo) <= first_row
    if len(passes) > 1 and slots >= 2:
        assert offset > 0  # rows enough to alternate: they do


@pytest.mark.parametrize(
    ("value_size", "limit", "blocks"),
    [(1 << 20, 100, 4), (1 << 20, 3, 3), (5 << 20, 10, 1), (0, 10, 10), (1, 10, 10), ((4 << 20) - 1, 10, 1),
     ((2 << 20), 10, 2), (1, 1 << 30, 4 << 20)],
)
def test_cache_sized_calls_fill_4_mib(value_size, limit, blocks):
    assert blocks_per_call(value_size, CACHE_PASS_BYTES, limit) == blocks


def test_a_whole_request_call_is_capped_by_the_rows_only():
    assert blocks_per_call(1 << 20, None, 300) == 300
    assert blocks_per_call(1 << 20, None, 0) == 1


def test_spans():
    assert spans(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert spans(0, 3) == []


def test_the_embedded_backend_bounds_its_calls_and_moves_cache_sized_passes():
    backend = EmbeddedStoreBackend(1 << 20)
    assert backend.call_bound_s(1 << 20) is not None
    assert backend.pass_bytes == EmbeddedBackend.pass_bytes


def test_a_pass_prepared_while_the_previous_put_hung_is_not_put_once_the_save_is_given_up():
    from test_store_stall import BlockingPartsBackend, wait_until

    class OneValuePerPut(BlockingPartsBackend):
        pass

    backend = OneValuePerPut(16 << 20)
    try:
        worker, caches = make_worker(backend, save_timeout_s=0.3)
        backend.pass_bytes = worker.value_size
        hs = hashes(3)
        backend.hold("put")
        worker.submit_saves(StorePlan(saves=[BlockTransfer(request_id="s", block_hashes=hs, block_ids=[[1, 2, 3]])]))
        wait_until(lambda: backend.entered["put"] >= 1)  # pass 0 hangs; pass 1 is prepared meanwhile
        deadline = time.monotonic() + 10
        while "s" not in worker.get_finished({"s"}):  # given up after save_timeout_s
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for c in caches.values():
            c[1:4] = 7.0  # vLLM reuses the released blocks
        backend.release("put")
        worker.saver._executor.submit(lambda: None).result(10)  # the save thread is past "s"
        assert backend.batch_exists(worker.keys(hs[1:])) == [False, False], "a pass of a given-up save was put"
        worker.close(1)
    finally:
        backend.release_all()


def test_a_load_of_many_passes_under_the_default_deadline_goes_straight_into_the_kv_cache():
    """A request of many backend calls (here one block per call, as 2 MiB values in 4 MiB passes
    are) stays zero-copy under the default 10 s deadline: the embedded bound per call is what a
    memory copy or a local file read can take, not a second per call (24 calls summed to 24 s, so
    every load of more than 9 passes went through staging and a second copy)."""
    backend = CountingStoreBackend(64 << 20, pass_bytes=1)
    worker, caches = make_worker(backend)
    assert worker.config.load_timeout_s == 10.0  # the default
    hs = hashes(20)
    save(worker, hs, list(range(20)))
    assert load(worker, hs, list(range(4, 24))) == set()
    assert backend.calls["get_into"] == 0 and backend.calls["get_parts"] == 20, backend.calls
    worker.close(1)


def test_the_embedded_bound_allows_for_a_slow_disk_only_where_it_spills(tmp_path):
    memory = EmbeddedStoreBackend(1 << 20)
    spilling = EmbeddedStoreBackend(1 << 20, spill_dir=tmp_path)
    assert memory.call_bound_s(4 << 20) < spilling.call_bound_s(4 << 20)
    assert spilling.call_bound_s(50 << 20) >= 1.0  # 50 MiB read from a disk at 50 MB/s


class _ThreadRecordingBackend(CountingStoreBackend):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.threads = set()

    def batch_put_parts(self, keys, parts):
        self.threads.add(threading.current_thread().name)
        return super().batch_put_parts(keys, parts)

    def batch_get_parts(self, keys, parts):
        self.threads.add(threading.current_thread().name)
        return super().batch_get_parts(keys, parts)


class _OverlappingBackend(_ThreadRecordingBackend):
    calls_release_gil = True  # say, Mooncake: its calls run in C++ without the GIL


@pytest.mark.parametrize("backend_cls", [_ThreadRecordingBackend, _OverlappingBackend], ids=["embedded", "releases-gil"])
def test_calls_that_hold_the_gil_run_on_the_callers_thread(backend_cls):
    """A second thread pays only when the call leaves the GIL: the embedded store's copies hold
    it, so a thread beside the check only adds hand-offs (measured ~10 % slower at 128 KiB);
    a backend whose calls leave the GIL gets its own I/O thread and overlaps the check."""
    backend = backend_cls(64 << 20, pass_bytes=1)
    worker, caches = make_worker(backend)
    hs = hashes(6)
    save(worker, hs, list(range(6)))
    assert load(worker, hs, list(range(8, 14))) == set()
    for c in caches.values():
        assert torch.equal(c[8:14], c[0:6])
    io_threads = {t for t in backend.threads if t.startswith(("store-put", "store-get"))}
    assert bool(io_threads) == backend_cls.calls_release_gil, backend.threads
    worker.close(1)
