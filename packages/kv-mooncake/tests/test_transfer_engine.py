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

from kv_mooncake.transfer_engine import _ATTEMPT_TIMEOUT_ENV, MooncakeTransferEngine, TransferError  # noqa: E402

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


def test_read_from_a_frozen_peer_is_retried_until_it_resumes(target, monkeypatch):
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
    os.kill(proc.pid, signal.SIGSTOP)
    threading.Timer(5.0, os.kill, (proc.pid, signal.SIGCONT)).start()
    t0 = time.monotonic()
    try:
        n = te.read_blocks(address, *args, deadline=time.monotonic() + 30, on_retry=retries.append)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    elapsed = time.monotonic() - t0
    assert n == 8 * BLOCK
    assert 4.5 < elapsed < 15, elapsed
    assert retries and all("failed after" in r for r in retries), retries
    for i in range(8):
        assert hashlib.sha256(local[i * BLOCK:(i + 1) * BLOCK]).hexdigest() == digests[i]
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

    class CountingEngine:  # the real engine, its reads counted and slowed down
        def __init__(self, engine):
            self._engine = engine

        def __getattr__(self, name):
            return getattr(self._engine, name)

        def batch_transfer_sync_read(self, peer, local, remote, lengths):
            calls.append(len(lengths))
            time.sleep(0.05)  # a slow engine call: reads that arrive meanwhile join the next batch
            return self._engine.batch_transfer_sync_read(peer, local, remote, lengths)

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
