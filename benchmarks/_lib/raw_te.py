"""Raw Mooncake TransferEngine reads: the ceilings the P2P benchmarks measure the connector against.

* :data:`RAW_METHODS` and :func:`read_blocks`: reading blocks with the TransferEngine's Python API,
  synchronous calls or a window of asynchronous ones, spinning on Mooncake's status calls or
  sleeping until a call is due (``p2p/transfer_ceilings`` describes each);
* :func:`te_bench_gbps`: Mooncake's own C++ ``transfer_engine_bench`` from the wheel, GB/s,
  memoized per run.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20


@dataclass(frozen=True)
class RawMethod:
    """One way to read blocks with the TransferEngine's Python API."""

    per_call: int  # blocks per engine call
    window: int  # calls in flight; 0 = synchronous calls one at a time
    sleeps: bool = False  # sleep until a call is due before asking its status (no spinning wait)


RAW_METHODS: dict[str, RawMethod] = {
    "sync 512": RawMethod(512, 0),
    "async 8x128": RawMethod(128, 8),
    "async 4x256, sleep": RawMethod(256, 4, sleeps=True),
    "async 2x512, sleep": RawMethod(512, 2, sleeps=True),
}
# A sleeping reader sleeps this share of a call's expected time, then asks: an estimate that is a
# little short costs a short spin, one that is long would delay every read and, learnt from those
# delayed reads, drift ever longer.
SLEEP_SHARE = 0.9
_RATE_BYTES_PER_S: dict[tuple[str, str], float] = {}  # (peer, method) -> throughput seen so far


def read_blocks(te, peer: str, dst: list[int], src: list[int], lens: list[int], method: str) -> None:
    """Read ``src -> dst`` (one entry per block) with one of :data:`RAW_METHODS`; raises on failure."""
    how = RAW_METHODS[method]
    per_call, n = how.per_call, len(lens)
    if not how.window:
        for s in range(0, n, per_call):
            rc = te.batch_transfer_sync_read(peer, dst[s : s + per_call], src[s : s + per_call], lens[s : s + per_call])
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_read rc={rc}")
        return
    rate = _RATE_BYTES_PER_S.get((peer, method)) if how.sleeps else None
    started = time.perf_counter()
    inflight: deque[tuple[int, float]] = deque()  # (batch id, when its bytes are due)
    due = started

    def complete(bid: int, due_at: float) -> None:
        if rate is not None:
            wait = SLEEP_SHARE * (due_at - time.perf_counter())
            if wait > 0:
                time.sleep(wait)
        rc = te.get_batch_transfer_status([bid])
        if rc != 0:
            raise RuntimeError(f"get_batch_transfer_status rc={rc}")

    try:
        for s in range(0, n, per_call):
            if len(inflight) >= how.window:
                complete(*inflight.popleft())
            bid = te.batch_transfer_async_read(peer, dst[s : s + per_call], src[s : s + per_call], lens[s : s + per_call])
            if not bid:
                raise RuntimeError("batch_transfer_async_read returned batch id 0")
            due = max(due, time.perf_counter()) + (sum(lens[s : s + per_call]) / rate if rate else 0.0)
            inflight.append((bid, due))
        while inflight:
            complete(*inflight.popleft())
    finally:
        if inflight:  # an error: free the rest (each batch id is asked exactly once)
            te.get_batch_transfer_status([bid for bid, _ in inflight])
    if how.sleeps:  # what this read achieved becomes the next read's estimate (half old, half new)
        seen = sum(lens) / max(time.perf_counter() - started, 1e-9)
        _RATE_BYTES_PER_S[(peer, method)] = seen if rate is None else (rate + seen) / 2


# ---------------------------------------------------------------- Mooncake's own C++ benchmark
_TE_BENCH: dict[tuple[int, float], float] = {}


def te_bench_binary() -> Path | None:
    try:
        import mooncake
    except ImportError:
        return None
    path = Path(mooncake.__file__).parent / "transfer_engine_bench"
    return path if path.exists() else None


def te_bench_gbps(block_bytes: int, duration_s: float = 3.0, threads: int | None = None) -> float:
    """Read throughput of Mooncake's ``transfer_engine_bench`` (target + initiator processes, loopback
    TCP, P2P handshake, batches of 128 blocks), GB/s; memoized per block size for this run."""
    key = (block_bytes, duration_s)
    if key in _TE_BENCH:
        return _TE_BENCH[key]
    binary = te_bench_binary()
    if binary is None:
        raise FileNotFoundError("the Mooncake wheel has no transfer_engine_bench")
    threads = threads or os.cpu_count() or 1
    buf = str(max(128 * MIB, 128 * block_bytes * threads * 2))
    common = ["-protocol", "tcp", "-metadata_server", "P2PHANDSHAKE", "-local_server_name", "127.0.0.1",
              "-buffer_size", buf]
    env = {**os.environ, "MC_LOG_LEVEL": "INFO"}
    with tempfile.TemporaryFile("w+") as tlog:
        target = subprocess.Popen([str(binary), "-mode", "target", *common], stdout=tlog, stderr=tlog, env=env)
        try:
            peer, deadline = None, time.monotonic() + 30
            while peer is None and time.monotonic() < deadline and target.poll() is None:
                time.sleep(0.2)
                tlog.seek(0)
                m = re.search(r"listening on ([0-9.]+:[0-9]+)", tlog.read())
                peer = m.group(1) if m else None
            if peer is None:
                raise RuntimeError("transfer_engine_bench target did not start")
            out = subprocess.run(
                [str(binary), "-mode", "initiator", *common, "-segment_id", peer, "-operation", "read",
                 "-block_size", str(block_bytes), "-batch_size", "128", "-threads", str(threads),
                 "-duration", str(int(max(1, duration_s)))],
                capture_output=True, text=True, env=env, timeout=duration_s + 60,
            )
        finally:
            target.terminate()
            try:
                target.wait(10)
            except subprocess.TimeoutExpired:
                target.kill()
                target.wait(5)
    m = re.search(r"throughput ([0-9.]+) GB/s", out.stdout + out.stderr)
    if out.returncode != 0 or m is None:
        tail = (out.stdout + out.stderr).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"transfer_engine_bench rc={out.returncode}: {tail[0][:200]}")
    _TE_BENCH[key] = float(m.group(1))
    return _TE_BENCH[key]
