"""Transfer path limits: a local memory copy and the raw Mooncake TransferEngine (loopback TCP).

Reusable by other benches (``bench_mooncake`` adds the connector rows on the same blocks)::

    from benchmarks.bench_transfer_raw import memcpy_gbps, raw_te_read_gbps, prompt_blocks, LAYOUT
    raw_te_read_gbps(256 << 10, 512)        # GB/s, median of reps; one TE peer process, kept warm
    memcpy_gbps(256 << 10, 512)
    prompt_blocks(4096)                     # (block_bytes, num_blocks) of a 4k-token prompt

Both move ``num_blocks`` blocks of ``block_bytes`` to scattered places (a random permutation of
block slots), the way a KV pull gathers a prompt's blocks: the memcpy with one ``index_select``,
the TransferEngine with ``batch_transfer_sync_read`` calls of at most ``BATCH`` blocks (the TCP
transport queues at most 1024 requests per peer). The peer is a second process.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from benchmarks.report import ROOT, Section, median, plot_path, progress, table

BATCH = 512
KIB, MIB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Layout:
    """A fixed model KV layout: vLLM's CPU layout keeps K and V of one (block, head) together."""

    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2  # fp16
    block_size: int = 128  # tokens per block (CPU default)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:  # one layer's block
        return self.block_size * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes


LAYOUT = Layout()


def prompt_blocks(num_tokens: int, layout: Layout = LAYOUT) -> tuple[int, int]:
    """(block_bytes, num_blocks): every layer's blocks of a prompt of ``num_tokens``."""
    return layout.block_bytes, layout.num_layers * math.ceil(num_tokens / layout.block_size)


def _perm(num_blocks: int, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).permutation(num_blocks)


# ---------------------------------------------------------------- local memory copy
def memcpy_seconds(block_bytes: int, num_blocks: int, reps: int = 3) -> list[float]:
    import torch

    src = torch.ones((num_blocks, block_bytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    idx = torch.from_numpy(_perm(num_blocks)).long()
    # One thread: OpenMP threads spin-wait badly when other processes share the cores, and one
    # copy stream is the fair comparison for one TCP stream anyway.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.index_select(src, 0, idx, out=dst)  # warm-up, first touch
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.index_select(src, 0, idx, out=dst)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return times


def memcpy_gbps(block_bytes: int, num_blocks: int, reps: int = 3) -> float:
    return block_bytes * num_blocks / median(memcpy_seconds(block_bytes, num_blocks, reps)) / 1e9


# ---------------------------------------------------------------- raw TransferEngine
class _Peer:
    """The target process: one registered buffer of ``nbytes``."""

    def __init__(self, nbytes: int) -> None:
        env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._te_peer", str(nbytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        info = json.loads(line or b'{"error": "peer exited"}')
        if "error" in info:
            self.close()
            raise RuntimeError(f"TransferEngine peer: {info['error']}")
        self.name, self.addr, self.nbytes = info["peer"], int(info["addr"]), int(info["bytes"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)


class _Initiator:
    """This process's TransferEngine and a peer big enough for the largest request so far."""

    def __init__(self) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        rc = self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"TransferEngine.initialize rc={rc}")
        self.peer: _Peer | None = None

    def peer_for(self, nbytes: int) -> _Peer:
        if self.peer is None or self.peer.nbytes < nbytes:
            if self.peer is not None:
                self.peer.close()
            self.peer = _Peer(max(nbytes, 64 * MIB))
        return self.peer

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None


_INIT: _Initiator | None = None


def _initiator() -> _Initiator:
    global _INIT
    if _INIT is None:
        _INIT = _Initiator()
        atexit.register(close_peers)
    return _INIT


def close_peers() -> None:
    """Stop the TransferEngine peer process (the next call starts a new one)."""
    if _INIT is not None:
        _INIT.close()


def raw_te_read_seconds(block_bytes: int, num_blocks: int, reps: int = 3) -> list[float]:
    """Seconds to pull ``num_blocks`` remote blocks into scattered local slots, per rep."""
    import numpy as np

    init = _initiator()
    total = block_bytes * num_blocks
    peer = init.peer_for(total)
    local = np.zeros(total, dtype=np.uint8)
    local[::4096] = 1  # touch every page before timing
    base = int(local.ctypes.data)
    rc = init.te.register_memory(base, total)
    if rc != 0:
        raise RuntimeError(f"register_memory rc={rc}")
    perm = _perm(num_blocks)
    dst = [base + int(i) * block_bytes for i in range(num_blocks)]
    src = [peer.addr + int(p) * block_bytes for p in perm]
    lens = [block_bytes] * num_blocks

    def once() -> float:
        t0 = time.perf_counter()
        for s in range(0, num_blocks, BATCH):
            rc = init.te.batch_transfer_sync_read(
                peer.name, dst[s : s + BATCH], src[s : s + BATCH], lens[s : s + BATCH]
            )
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_read rc={rc}")
        return time.perf_counter() - t0

    try:
        once()  # warm-up: handshake, first touch on the peer side
        return [once() for _ in range(reps)]
    finally:
        init.te.unregister_memory(base)


def raw_te_read_gbps(block_bytes: int, num_blocks: int, reps: int = 3) -> float:
    return block_bytes * num_blocks / median(raw_te_read_seconds(block_bytes, num_blocks, reps)) / 1e9


# ---------------------------------------------------------------- the section
def _loglog_slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / den if den else float("nan")


def _plot(block_sizes, bs_rows, lengths, len_rows) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, key, style in (("local memcpy", "memcpy", "k-o"), ("raw TransferEngine (TCP)", "te", "-s")):
        xs = [b for b in block_sizes if bs_rows.get((b, key))]
        a1.plot([x / KIB for x in xs], [bs_rows[(x, key)] for x in xs], style, label=name, markersize=4)
        xs = [n for n in lengths if len_rows.get((n, key))]
        a2.plot(
            [prompt_bytes(n) / MIB for n in xs],
            [len_rows[(n, key)] * 1e3 for n in xs],
            style,
            label=name,
            markersize=4,
        )
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("block size (KiB)")
    a1.set_ylabel("GB/s (median)")
    a1.set_title("Throughput by block size")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("bytes moved (MiB)")
    a2.set_ylabel("time (ms, median)")
    a2.set_title(f"Whole prompt ({LAYOUT.bytes_per_token // KIB} KiB/token), log-log")
    if lengths:
        ref = [prompt_bytes(n) / MIB for n in lengths]
        for key in ("memcpy", "te"):
            if len_rows.get((lengths[0], key)):
                t0 = len_rows[(lengths[0], key)] * 1e3
                a2.plot(ref, [t0 * r / ref[0] for r in ref], ":", color="grey", linewidth=0.8)
    for ax in (a1, a2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot_path("transfer_raw.png"), dpi=110)
    plt.close(fig)
    return "benchmarks/plots/transfer_raw.png"


def prompt_bytes(num_tokens: int) -> int:
    bb, nb = prompt_blocks(num_tokens)
    return bb * nb


def run(quick: bool) -> Section:
    block_sizes = [16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 2 * MIB]
    total = (64 if quick else 256) * MIB
    lengths = [1024, 2048, 4096, 8192] if quick else [1024, 2048, 4096, 8192, 16384]
    reps = 3 if quick else 5
    notes: list[str] = []
    bs_rows: dict[tuple[int, str], float] = {}
    len_rows: dict[tuple[int, str], float] = {}  # seconds
    te_error = None
    try:
        for b in progress(block_sizes, desc="raw transfer by block size"):
            n = total // b
            bs_rows[(b, "memcpy")] = memcpy_gbps(b, n, reps)
            if te_error is None:
                try:
                    bs_rows[(b, "te")] = raw_te_read_gbps(b, n, reps)
                except Exception as exc:  # noqa: BLE001
                    te_error = f"{type(exc).__name__}: {exc}"
        for n_tok in progress(lengths, desc="raw transfer by prompt length"):
            bb, nb = prompt_blocks(n_tok)
            len_rows[(n_tok, "memcpy")] = median(memcpy_seconds(bb, nb, reps))
            if te_error is None:
                try:
                    len_rows[(n_tok, "te")] = median(raw_te_read_seconds(bb, nb, reps))
                except Exception as exc:  # noqa: BLE001
                    te_error = f"{type(exc).__name__}: {exc}"
    finally:
        close_peers()
    if te_error:
        notes.append(f"raw TransferEngine rows incomplete: {te_error}")

    t1 = table(
        ["block size", "blocks", "memcpy GB/s", "raw TE GB/s", "TE / memcpy"],
        [
            [
                f"{b // KIB} KiB",
                total // b,
                bs_rows.get((b, "memcpy"), float("nan")),
                bs_rows.get((b, "te"), float("nan")),
                bs_rows.get((b, "te"), float("nan")) / bs_rows[(b, "memcpy")],
            ]
            for b in block_sizes
        ],
    )
    rows2 = []
    for n_tok in lengths:
        nbytes = prompt_bytes(n_tok)
        mc, te = len_rows.get((n_tok, "memcpy")), len_rows.get((n_tok, "te"))
        rows2.append(
            [
                f"{n_tok // 1024}k",
                f"{nbytes / MIB:,.0f}",
                f"{mc * 1e3:.3g}" if mc else "–",
                nbytes / mc / 1e9 if mc else "–",
                f"{te * 1e3:.3g}" if te else "–",
                nbytes / te / 1e9 if te else "–",
                te / mc if te and mc else "–",
            ]
        )
    t2 = table(
        ["prompt", "MiB", "memcpy ms", "memcpy GB/s", "raw TE ms", "raw TE GB/s", "TE / memcpy time"], rows2
    )
    for key, label in (("memcpy", "memcpy"), ("te", "raw TE")):
        xs = [n for n in lengths if len_rows.get((n, key))]
        if len(xs) >= 2:
            slope = _loglog_slope([prompt_bytes(n) for n in xs], [len_rows[(n, key)] for n in xs])
            notes.append(f"{label}: log-log slope of time vs bytes = {slope:.2f} (1.00 = linear)")
    notes.append(
        f"layout: {LAYOUT.num_layers} layers x {LAYOUT.num_kv_heads} kv heads x {LAYOUT.head_dim} head_dim x fp16 = "
        f"{LAYOUT.bytes_per_token // KIB} KiB/token; one block = {LAYOUT.block_size} tokens of one layer = "
        f"{LAYOUT.block_bytes // KIB} KiB; a prompt moves layers x ceil(tokens/128) blocks"
    )
    notes.append(
        f"block-size sweep: {total // MIB} MiB per measurement, blocks to/from random slots; memcpy: torch index_select, 1 thread; "
        f"TE: batch_transfer_sync_read in batches of {BATCH}, peer = second process, loopback TCP; "
        f"median of {reps}"
    )
    return Section(
        title="Transfer path: raw limits",
        summary=(
            "The ceiling for any KV transfer on this machine: a local gather copy (torch index_select) and "
            "Mooncake's TransferEngine pulling the same blocks from a second process over loopback TCP, "
            "by block size and by prompt length of a fixed 32-layer fp16 layout. Linear scaling shows as a "
            "slope of 1 in the log-log plot (dotted lines)."
        ),
        tables=[t1, t2],
        plots=[_plot(block_sizes, bs_rows, lengths, len_rows)],
        notes=notes,
    )
