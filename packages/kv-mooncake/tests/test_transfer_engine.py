"""The real Mooncake TransferEngine over TCP on loopback, between two processes, via our wrapper."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import threading
import time

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("mooncake.engine")

from kv_common.testing.freeze import freeze  # noqa: E402
from kv_mooncake.engine.peer_budgets import PeerBudget
from kv_mooncake.engine.transfer_engine import _ATTEMPT_TIMEOUT_ENV, MooncakeTransferEngine
from kv_mooncake.errors import TransferError
from wrapped_engine import WrappedEngine  # noqa: E402

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
BLOCK = 4096
NUM_BLOCKS = 1500  # more than max_inflight: the wrapper must chunk


def _target(conn) -> None:
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    data = np.random.default_rng(7).integers(0, 256, NUM_BLOCKS * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    te.register([(data.ctypes.data, data.nbytes)])
    conn.send((te.rpc_address, data.ctypes.data, [hashlib.sha256(data[i * BLOCK:(i + 1) * BLOCK]).hexdigest()
                                                   for i in range(NUM_BLOCKS)]))
    conn.recv()  # stay alive until told
    te.close()


@pytest.fixture
def target():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(60)
    address, base, digests = parent.recv()
    yield proc, parent, address, base, digests
    if proc.is_alive():
        parent.send("stop")
        proc.join(10)
    if proc.is_alive():
        proc.kill()


def test_chunked_read_between_processes_verified(target):
    _, _, address, base, digests = target
    local = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    te.register([(local.ctypes.data, local.nbytes)])
    order = list(range(NUM_BLOCKS))
    random.Random(3).shuffle(order)  # local block i <- remote block order[i]
    chunks = []
    n = te.read_blocks(address, [local.ctypes.data + i * BLOCK for i in range(NUM_BLOCKS)],
                       [base + j * BLOCK for j in order], [BLOCK] * NUM_BLOCKS,
                       deadline=time.monotonic() + 30, on_chunk=lambda: chunks.append(1))
    assert n == NUM_BLOCKS * BLOCK
    assert len(chunks) == 3  # 1500 requests in chunks of at most 512
    for i, j in enumerate(order):
        assert hashlib.sha256(local[i * BLOCK:(i + 1) * BLOCK]).hexdigest() == digests[j]
    te.close()


def test_errors_are_transfer_errors_and_dead_peer_does_not_hang(target):
    proc, _, address, base, _ = target
    local = np.zeros(4 * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    te.register([(local.ctypes.data, local.nbytes)])
    with pytest.raises(TransferError, match="batch_transfer_sync_read failed"):
        te.read_blocks(address, [local.ctypes.data], [base + NUM_BLOCKS * BLOCK * 4], [BLOCK])  # outside
    with pytest.raises(TransferError, match="deadline"):
        te.read_blocks(address, [local.ctypes.data], [base], [BLOCK], deadline=time.monotonic() - 1)
    proc.kill()
    proc.join(5)
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        te.read_blocks(address, [local.ctypes.data + i * BLOCK for i in range(4)], [base + i * BLOCK for i in range(4)],
                       [BLOCK] * 4, deadline=time.monotonic() + 10)
    assert time.monotonic() - t0 < 5  # a refusing peer ends the read after a few fast failures
    te.close()


def _freeze(pid: int, timeout_s: float = 30.0) -> None:
    # kill() returns before every thread is stopped; meanwhile the peer's TE threads would serve a
    # read meant to stall (the flake: a read from a 'frozen' peer done in 0.026 s)
    freeze(pid, timeout_s)


@pytest.mark.parametrize("method", ["read_blocks", "read_batches"])
def test_read_from_a_frozen_peer_is_retried_until_it_resumes(target, monkeypatch, method):
    """The failure seen on shared CI machines: the peer process (or its vCPU) stops for longer than
    one transfer may take. Each stalled attempt fails after the attempt timeout and is read again;
    the read completes, with the right bytes, once the peer runs again, within the deadline."""
    for name in _ATTEMPT_TIMEOUT_ENV:
        monkeypatch.delenv(name, raising=False)
    proc, _, address, base, digests = target
    local = np.zeros(8 * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512, attempt_timeout_s=2)
    assert os.environ["MC_TRANSFER_TIMEOUT"] == "2"
    te.register([(local.ctypes.data, local.nbytes)])
    args = ([local.ctypes.data + i * BLOCK for i in range(8)], [base + i * BLOCK for i in range(8)], [BLOCK] * 8)
    te.read_blocks(address, *args)  # connection and segment are set up before the freeze
    local[:] = 0
    retries: list[str] = []
    _freeze(proc.pid)
    threading.Timer(5.0, os.kill, (proc.pid, signal.SIGCONT)).start()
    t0 = time.monotonic()
    try:
        if method == "read_blocks":
            n = te.read_blocks(address, *args, deadline=time.monotonic() + 30, on_retry=retries.append)
        else:
            batches = [([args[0][i]], [args[1][i]], [args[2][i]]) for i in range(8)]  # one block each
            n = te.read_batches(address, batches, deadline=time.monotonic() + 30, on_retry=retries.append)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    elapsed = time.monotonic() - t0
    assert n == 8 * BLOCK
    assert 4.5 < elapsed < 15, elapsed
    assert retries and all("failed after" in r for r in retries), retries
    for i in range(8):
        assert hashlib.sha256(local[i * BLOCK:(i + 1) * BLOCK]).hexdigest() == digests[i]
    te.close()


@pytest.mark.parametrize("method", ["read_blocks", "read_batches"])
def test_a_peer_frozen_before_the_first_read_fails_reads_at_their_deadlines(target, method):
    """The CI flake of 2026-11-28: a prefill answered the side channel's handshake, then froze before
    the decode's first read. Mooncake opens a peer's segment inside the first read's submit, with a
    fixed 60 s wait for the peer's answer (not bound by its transfer timeouts), and opens one at a
    time: the pulls from that prefill failed after 60 s and 121 s against a 45 s deadline. Each read
    must end at its own deadline, no byte landing in our memory, and read normally once the peer runs."""
    proc, _, address, base, digests = target
    n_threads = 2
    local = np.zeros(n_threads * 4 * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    te.register([(local.ctypes.data, local.nbytes)])

    def args(t: int):
        return ([local.ctypes.data + (4 * t + i) * BLOCK for i in range(4)], [base + i * BLOCK for i in range(4)],
                [BLOCK] * 4)

    def read(t: int, deadline: float) -> int:
        if method == "read_blocks":
            return te.read_blocks(address, *args(t), deadline=deadline)
        return te.read_batches(address, [args(t)], deadline=deadline)

    _freeze(proc.pid)
    took: dict[int, float] = {}
    errors: dict[int, BaseException] = {}

    def frozen_read(t: int) -> None:
        t0 = time.monotonic()
        try:
            read(t, t0 + 3.0)
        except TransferError as exc:
            errors[t] = exc
        took[t] = time.monotonic() - t0

    threads = [threading.Thread(target=frozen_read, args=(t,), daemon=True) for t in range(n_threads)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(90)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert sorted(errors) == list(range(n_threads)), (errors, took)
    assert all(t < 5.0 for t in took.values()), took
    assert not local.any(), "bytes landed in our memory after the read failed"
    assert read(0, time.monotonic() + 30) == 4 * BLOCK  # the peer runs again: read as usual
    for i in range(4):
        assert hashlib.sha256(local[i * BLOCK:(i + 1) * BLOCK]).hexdigest() == digests[i]
    te.close()


def test_an_engine_without_the_probe_reads_as_before(target):
    """A Mooncake build without ``send_probe`` (before 0.3.11): no probe, the read goes as it did."""
    _, _, address, base, digests = target

    class NoProbe(WrappedEngine):
        def __getattr__(self, name):
            if name == "send_probe":
                raise AttributeError(name)
            return super().__getattr__(name)

    local = np.zeros(4 * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    te.register([(local.ctypes.data, local.nbytes)])
    te._engine = NoProbe(te._engine)
    args = ([local.ctypes.data + i * BLOCK for i in range(4)], [base + i * BLOCK for i in range(4)], [BLOCK] * 4)
    assert te.read_batches(address, [args], deadline=time.monotonic() + 30) == 4 * BLOCK
    for i in range(4):
        assert hashlib.sha256(local[i * BLOCK:(i + 1) * BLOCK]).hexdigest() == digests[i]
    te.close()


class _CountingAsync(WrappedEngine):
    """The real engine, its asynchronous calls counted: how many are in flight at most, how many
    transfers, and whether every one submitted was waited for."""

    def __init__(self, engine):
        super().__init__(engine)
        self.outstanding: dict[int, int] = {}
        self.max_calls = self.max_transfers = self.submitted = 0

    def batch_transfer_async_read(self, peer, local, remote, lengths):
        bid = self._engine.batch_transfer_async_read(peer, local, remote, lengths)
        if 0 < bid < 1 << 63:
            self.submitted += 1
            self.outstanding[bid] = len(lengths)
            self.max_calls = max(self.max_calls, len(self.outstanding))
            self.max_transfers = max(self.max_transfers, sum(self.outstanding.values()))
        return bid

    def get_batch_transfer_status(self, bids):
        rc = self._engine.get_batch_transfer_status(bids)
        for b in bids:
            del self.outstanding[b]  # KeyError: waited twice, or never submitted
        return rc


def _batches(local_base: int, remote_base: int, order: list[int], per: int):
    for s in range(0, len(order), per):
        idx = range(s, min(len(order), s + per))
        yield ([local_base + i * BLOCK for i in idx], [remote_base + order[i] * BLOCK for i in idx], [BLOCK] * len(idx))


def test_read_batches_pipelines_calls_in_order_and_verified(target):
    """1500 scattered blocks in batches of 64: several engine calls in flight, never more than
    max_inflight transfers, every batch reported in order once its bytes landed."""
    _, _, address, base, digests = target
    local = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 256)
    te.register([(local.ctypes.data, local.nbytes)])
    counting = te._engine = _CountingAsync(te._engine)
    order = list(range(NUM_BLOCKS))
    random.Random(4).shuffle(order)
    landed: list[int] = []

    def on_batch(i: int) -> None:
        for j in range(i * 64, min(NUM_BLOCKS, (i + 1) * 64)):  # this batch's bytes are there now
            assert hashlib.sha256(local[j * BLOCK:(j + 1) * BLOCK]).hexdigest() == digests[order[j]]
        landed.append(i)

    n = te.read_batches(address, _batches(local.ctypes.data, base, order, 64), time.monotonic() + 60, on_batch)
    assert n == NUM_BLOCKS * BLOCK
    assert landed == list(range(24))  # ceil(1500 / 64), in order
    assert counting.max_calls > 1, "one engine call at a time: nothing was pipelined"
    assert counting.max_transfers <= 256
    assert not counting.outstanding and counting.submitted == 24
    # A batch bigger than max_inflight goes in several calls; on_batch runs once, after the last.
    local[:] = 0
    landed.clear()
    assert te.read_batches(address, _batches(local.ctypes.data, base, order, 600), None, landed.append) == n
    assert landed == [0, 1, 2]
    assert counting.max_transfers <= 256 and not counting.outstanding
    for j in range(NUM_BLOCKS):
        assert hashlib.sha256(local[j * BLOCK:(j + 1) * BLOCK]).hexdigest() == digests[order[j]]
    te.close()


@pytest.mark.parametrize("with_deadline", [False, True])
def test_read_batches_bad_batch_fails_with_the_prefix_read(target, with_deadline):
    """Batch 3 of 6 reads memory the peer never registered: the read fails naming 3 batches done,
    batches 0-2 landed and were reported, and no engine call is left in flight."""
    _, _, address, base, digests = target
    local = np.zeros(6 * 8 * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    te.register([(local.ctypes.data, local.nbytes)])
    counting = te._engine = _CountingAsync(te._engine)
    batches = list(_batches(local.ctypes.data, base, list(range(48)), 8))
    batches[3][1][5] = base + NUM_BLOCKS * BLOCK * 4  # outside the peer's registered memory
    landed: list[int] = []
    t0 = time.monotonic()
    with pytest.raises(TransferError) as info:
        te.read_batches(address, batches, time.monotonic() + 20 if with_deadline else None, landed.append)
    assert time.monotonic() - t0 < 10  # refused reads fail fast, not at the deadline
    assert info.value.batches_done == 3 and landed == [0, 1, 2]
    assert not counting.outstanding
    for j in range(24):
        assert hashlib.sha256(local[j * BLOCK:(j + 1) * BLOCK]).hexdigest() == digests[j]
    te.close()


def test_read_batches_callback_error_waits_for_calls_in_flight(target):
    _, _, address, base, _ = target
    local = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    te.register([(local.ctypes.data, local.nbytes)])
    counting = te._engine = _CountingAsync(te._engine)

    def on_batch(i: int) -> None:
        if i == 1:
            raise RuntimeError("digest mismatch")

    with pytest.raises(RuntimeError, match="digest mismatch"):
        te.read_batches(address, _batches(local.ctypes.data, base, list(range(NUM_BLOCKS)), 64), None, on_batch)
    assert counting.max_calls > 2 and not counting.outstanding  # in flight when it raised, all waited for
    assert te._peer(address).budget.in_flight == 0
    te.close()


def test_read_batches_from_a_dead_peer_does_not_hang(target):
    proc, _, address, base, _ = target
    local = np.zeros(4 * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    te.register([(local.ctypes.data, local.nbytes)])
    te.read_batches(address, _batches(local.ctypes.data, base, [0, 1, 2, 3], 2))
    proc.kill()
    proc.join(5)
    t0 = time.monotonic()
    with pytest.raises(TransferError) as info:
        te.read_batches(address, _batches(local.ctypes.data, base, [0, 1, 2, 3], 2), time.monotonic() + 60)
    # Mooncake notices the dead peer in ~2 s; a hang would wait out the 60 s deadline. The bound is
    # far from both: a loaded CI machine took 7.1 s here against a bound of 5.
    assert time.monotonic() - t0 < 30 and info.value.batches_done == 0
    assert te._peer(address).budget.in_flight == 0
    te.close()


def test_concurrent_reads_to_one_peer_are_batched_and_a_bad_one_fails_alone():
    """16 pulls reading one prefill at once: served by a few big engine calls, not 16 turns behind
    a per-peer lock; a read of unregistered memory fails, the others land byte for byte."""
    src_te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    dst_te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    n_threads, per = 16, 8
    src = np.random.default_rng(5).integers(0, 256, n_threads * per * BLOCK, dtype=np.uint8)
    dst = np.zeros_like(src)
    src_te.register([(src.ctypes.data, src.nbytes)])
    dst_te.register([(dst.ctypes.data, dst.nbytes)])
    calls = []

    class CountingEngine(WrappedEngine):  # its reads counted and slowed down
        def batch_transfer_async_read(self, peer, local, remote, lengths):  # what read_blocks submits
            calls.append(len(lengths))
            time.sleep(0.05)  # a slow engine call: reads that arrive meanwhile join the next batch
            return self._engine.batch_transfer_async_read(peer, local, remote, lengths)

    dst_te._engine = CountingEngine(dst_te._engine)
    start = threading.Barrier(n_threads)
    results: dict[int, object] = {}

    def read(t: int) -> None:
        blocks = range(t * per, (t + 1) * per)
        remote = [src.ctypes.data + b * BLOCK for b in blocks]
        if t == 5:
            remote[3] = src.ctypes.data + src.nbytes + 64 * BLOCK  # not registered on the peer
        start.wait()
        try:
            results[t] = dst_te.read_blocks(src_te.rpc_address, [dst.ctypes.data + b * BLOCK for b in blocks],
                                            remote, [BLOCK] * per, time.monotonic() + 20)
        except TransferError as exc:
            results[t] = exc

    threads = [threading.Thread(target=read, args=(t,)) for t in range(n_threads)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert isinstance(results[5], TransferError)
        for t in range(n_threads):
            if t != 5:
                assert results[t] == per * BLOCK, (t, results[t])
                lo, hi = t * per * BLOCK, (t + 1) * per * BLOCK
                assert np.array_equal(dst[lo:hi], src[lo:hi]), t
        assert len([c for c in calls if c > per]) >= 1, f"every read took its own engine call: {calls}"
    finally:
        dst_te.close()
        src_te.close()


def test_peer_budget_bounds_transfers_and_lets_a_waiting_reader_in():
    """The per-peer budget: never more than its limit in flight; while a reader waits for slots a
    pipeline cannot take freed slots first (it completes its own oldest call instead)."""

    budget = PeerBudget(128)
    assert budget.try_acquire(64) and budget.try_acquire(64)
    assert not budget.try_acquire(1)  # full
    assert not budget.acquire(64, time.monotonic() + 0.05)  # waits until its give-up time, then False
    got = threading.Event()
    waiter = threading.Thread(target=lambda: budget.acquire(64, time.monotonic() + 10) and got.set())
    waiter.start()
    while budget._waiting == 0:
        time.sleep(0.001)
    budget.release(64)
    assert not budget.try_acquire(64) or got.is_set()  # the waiting reader goes first
    waiter.join(10)
    assert got.is_set() and budget.in_flight == 128
    budget.release(64)
    budget.release(64)
    assert budget.in_flight == 0 and budget.try_acquire(500) and budget.in_flight == 128  # a big call: the limit


def test_read_batches_a_batch_that_cannot_be_built_ends_the_read_after_the_ones_before(target):
    """The caller's address arithmetic fails for batch 2 (a block id outside its cache) while batches
    0 and 1 are in flight: they land and are reported first, then the caller's error is raised."""
    _, _, address, base, digests = target
    local = np.zeros(3 * 400 * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    te.register([(local.ctypes.data, local.nbytes)])
    counting = te._engine = _CountingAsync(te._engine)
    landed: list[int] = []

    def batches():
        for i, b in enumerate(_batches(local.ctypes.data, base, list(range(1200)), 400)):
            if i == 2:
                raise LookupError("block id 100/24 outside the KV cache")
            yield b

    with pytest.raises(LookupError, match="outside the KV cache"):
        te.read_batches(address, batches(), time.monotonic() + 20, landed.append)
    assert landed == [0, 1] and not counting.outstanding
    for j in range(800):
        assert hashlib.sha256(local[j * BLOCK:(j + 1) * BLOCK]).hexdigest() == digests[j]
    te.close()


def test_threads_reading_one_peer_ask_its_status_one_at_a_time(target, monkeypatch):
    """Mooncake's status call spins on its core until the batch is done: pull threads reading the
    same peer at once must not all spin (measured on 2 cores, 16 pulls in flight from 4 threads:
    277-443 pulls/s spinning together, 588-611 asking one at a time). Every byte still lands."""
    import kv_mooncake.engine.transfer_engine as engine_module
    monkeypatch.setattr(engine_module, "ASK_TURN_WAIT_S", 60.0)  # turns only (their bound: the next test)
    _, _, address, base, digests = target
    n_threads, per = 6, 200
    local = np.zeros(n_threads * per * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    te.register([(local.ctypes.data, local.nbytes)])
    lock = threading.Lock()
    asking = [0, 0]  # now, most at once

    class SlowStatus(WrappedEngine):  # its status calls counted and made to last
        def get_batch_transfer_status(self, bids):
            with lock:
                asking[0] += 1
                asking[1] = max(asking[1], asking[0])
            try:
                time.sleep(0.02)  # a long spin: the others' status calls would overlap it
                return self._engine.get_batch_transfer_status(bids)
            finally:
                with lock:
                    asking[0] -= 1

    te._engine = SlowStatus(te._engine)
    start = threading.Barrier(n_threads)
    results: dict[int, object] = {}

    def read(t: int) -> None:
        order = list(range(t * per, (t + 1) * per))
        start.wait()
        try:
            results[t] = te.read_batches(address, _batches(local.ctypes.data + t * per * BLOCK,
                                                  base, order, 50), time.monotonic() + 30)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results[t] = exc

    threads = [threading.Thread(target=read, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    te.close()
    assert all(results[t] == per * BLOCK for t in range(n_threads)), results
    assert asking[1] == 1, f"{asking[1]} status calls to one peer at once"
    for j in range(n_threads * per):
        assert hashlib.sha256(local[j * BLOCK:(j + 1) * BLOCK]).hexdigest() == digests[j]


def test_a_status_call_stuck_on_a_stalled_read_holds_the_others_up_only_briefly(target):
    """One thread's status call hangs (its read stalled: a frozen peer answers only at Mooncake's
    transfer timeout); another thread's read to the same peer is done: it waits for its turn to ask
    only ``ASK_TURN_WAIT_S``, then asks anyway (spinning beside the stuck one, as without turns)."""
    from kv_mooncake.engine.pacing import ASK_TURN_WAIT_S

    _, _, address, base, digests = target
    local = np.zeros(2 * 16 * BLOCK, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp", "", 512)
    te.register([(local.ctypes.data, local.nbytes)])
    stuck = threading.Event()

    class OneStuckStatus(WrappedEngine):  # its first status call stuck
        def get_batch_transfer_status(self, bids):
            if not stuck.is_set():
                stuck.set()
                time.sleep(2.0)  # the stalled read's status call
            return self._engine.get_batch_transfer_status(bids)

    te._engine = OneStuckStatus(te._engine)
    took: dict[int, float] = {}

    def read(t: int) -> None:
        if t:
            stuck.wait(10)
        t0 = time.monotonic()
        took[t] = -1.0
        te.read_batches(address, _batches(local.ctypes.data + t * 16 * BLOCK, base + t * 16 * BLOCK,
                                          list(range(16)), 16), time.monotonic() + 30)
        took[t] = time.monotonic() - t0

    threads = [threading.Thread(target=read, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    te.close()
    assert took[0] >= 2.0
    assert 0 < took[1] < ASK_TURN_WAIT_S + 1.0, took
    for j in range(32):
        assert hashlib.sha256(local[j * BLOCK:(j + 1) * BLOCK]).hexdigest() == digests[j]


def test_the_attempt_timeout_is_the_earliest_of_mooncakes_transfer_timeouts(monkeypatch):
    """Whichever of Mooncake's timeouts ends a stalled transfer first is the attempt's length. kv-store
    sets a shorter TCP progress timeout for its Mooncake store client in the same process: a stalled
    attempt then ends after that, and must still read as a timeout (retried), not a refusal."""
    from kv_mooncake.engine.transfer_engine import _attempt_timeout_s

    for name in _ATTEMPT_TIMEOUT_ENV:
        monkeypatch.delenv(name, raising=False)
    assert _attempt_timeout_s() == 30.0  # Mooncake's defaults
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "10")
    assert _attempt_timeout_s() == 10.0
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "5")
    assert _attempt_timeout_s() == 5.0
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "soon")  # unreadable: Mooncake's own default
    assert _attempt_timeout_s() == 5.0
