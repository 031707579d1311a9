"""Transfer path ceilings: local memory copies and the best raw Mooncake TransferEngine use (loopback TCP).

The raw methods and Mooncake's C++ benchmark live in :mod:`benchmarks._lib.raw_te`, where the P2P
pull sections (``p2p/pull``, ``p2p/pull_concurrency``) take them from::

    from benchmarks._lib.raw_te import RAW_METHODS, read_blocks, te_bench_gbps
    te_bench_gbps(256 << 10)     # Mooncake's own transfer_engine_bench (C++), GB/s, memoized per run
    raw_te_read_seconds(256 << 10, 512, method="async 4x256, sleep")   # here: seconds per rep, bytes verified
    memcpy_gbps(256 << 10, 512, threads=os.cpu_count())                # here

Every Python-API method moves ``num_blocks`` blocks of ``block_bytes`` from a second process into
scattered local slots (a random permutation), the way a KV pull gathers a prompt's blocks:

* ``sync 512`` — ``batch_transfer_sync_read`` of 512 blocks per call, one call at a time (what
  MooncakeConnectorV1 did until it pipelined asynchronous reads with ``read_batches``). Spins:
  Mooncake's synchronous call releases the GIL and polls the status with no yield;
* ``async 8x128`` — ``batch_transfer_async_read`` with 8 calls in flight, a sliding window
  completed with ``get_batch_transfer_status`` (which spins the same way); at most 1024 requests in
  flight (the TCP transport's per-peer queue limit);
* ``async 4x256, sleep`` / ``async 2x512, sleep`` — the same window, but before asking a call's
  status the reader sleeps until the call is due (its bytes at the throughput this method measured
  so far, :data:`SLEEP_SHARE` of it), so the status call spins only for what the estimate missed.
  These do not spin: on 2 cores a spinner competes with both sides' TCP threads (issue 25 measured
  raw 32 MiB reads at 0.78 GB/s spinning, 1.24 GB/s sleeping);
* ``transfer_engine_bench`` — Mooncake's C++ benchmark from the wheel (``-threads`` = cores,
  contiguous blocks, fixed duration): what the engine does without Python in the loop.

The bytes of every Python-API repetition are verified: each block's first 8 bytes must be the
index of the peer page it came from (the peer writes its page index there).
"""

from __future__ import annotations

import atexit
import math
import os
import time
from dataclasses import dataclass

from benchmarks._lib.peers import PeerProcess
from benchmarks._lib.raw_te import RAW_METHODS, read_blocks, te_bench_gbps
from benchmarks._lib.report import Claim, Section, median, progress, save_plot, table

KIB, MIB = 1 << 10, 1 << 20
PAGE = 4096
CONNECTOR_LIKE = "sync 512"  # the connector's method before read_batches, for reference


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
def memcpy_seconds(block_bytes: int, num_blocks: int, reps: int = 3, threads: int = 1) -> list[float]:
    import torch

    src = torch.ones((num_blocks, block_bytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    idx = torch.from_numpy(_perm(num_blocks)).long()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.index_select(src, 0, idx, out=dst)  # warm-up, first touch
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.index_select(src, 0, idx, out=dst)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return times


def memcpy_gbps(block_bytes: int, num_blocks: int, reps: int = 3, threads: int = 1) -> float:
    return block_bytes * num_blocks / median(memcpy_seconds(block_bytes, num_blocks, reps, threads)) / 1e9


# ---------------------------------------------------------------- raw TransferEngine (Python API)
class _Peer(PeerProcess):
    """The target process: one registered buffer of ``nbytes``."""

    def __init__(self, nbytes: int) -> None:
        super().__init__("benchmarks._lib.peers", str(nbytes), what="TransferEngine peer")
        self.name, self.addr, self.nbytes = self.ready["peer"], int(self.ready["addr"]), int(self.ready["bytes"])


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


def raw_te_read_seconds(block_bytes: int, num_blocks: int, reps: int = 3, method: str = CONNECTOR_LIKE) -> list[float]:
    """Seconds to pull ``num_blocks`` remote blocks into scattered local slots, per rep; the bytes
    of every rep are checked (each block's first page index)."""
    import numpy as np

    if block_bytes % PAGE:
        raise ValueError("block_bytes must be a multiple of 4 KiB (the peer's page pattern)")
    init = _initiator()
    total = block_bytes * num_blocks
    peer = init.peer_for(total)
    local = np.zeros(total, dtype=np.uint8)
    local[::PAGE] = 1  # touch every page before timing
    base = int(local.ctypes.data)
    rc = init.te.register_memory(base, total)
    if rc != 0:
        raise RuntimeError(f"register_memory rc={rc}")
    perm = _perm(num_blocks)
    dst = [base + i * block_bytes for i in range(num_blocks)]
    src = [peer.addr + int(p) * block_bytes for p in perm]
    lens = [block_bytes] * num_blocks
    heads = local.view(np.uint64)[:: block_bytes // 8]  # first 8 bytes of every local block
    expected = perm.astype(np.uint64) * np.uint64(block_bytes // PAGE)

    def once() -> float:
        heads[:] = np.uint64(2**64 - 1)
        t0 = time.perf_counter()
        read_blocks(init.te, peer.name, dst, src, lens, method)
        seconds = time.perf_counter() - t0
        if not np.array_equal(heads, expected):
            bad = int(np.count_nonzero(heads != expected))
            raise RuntimeError(f"raw TE ({method}): {bad} of {num_blocks} blocks hold the wrong bytes")
        return seconds

    try:
        once()  # warm-up: handshake, first touch on the peer side
        return [once() for _ in range(reps)]
    finally:
        init.te.unregister_memory(base)


def raw_te_read_gbps(block_bytes: int, num_blocks: int, reps: int = 3, method: str = CONNECTOR_LIKE) -> float:
    return block_bytes * num_blocks / median(raw_te_read_seconds(block_bytes, num_blocks, reps, method)) / 1e9


# ---------------------------------------------------------------- the section
def _loglog_slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / den if den else float("nan")


def prompt_bytes(num_tokens: int) -> int:
    bb, nb = prompt_blocks(num_tokens)
    return bb * nb


def _plot(block_sizes: list[int], series: dict[str, dict[int, list[float]]], lengths, len_rows) -> str:
    """Left: GB/s by block size (median with min-max band) of every method; right: whole prompts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for name, by_size in series.items():
        xs = [b for b in block_sizes if by_size.get(b)]
        if not xs:
            continue
        med = [median(by_size[b]) for b in xs]
        style = "k-o" if name.startswith("memcpy") else ("--x" if name == "transfer_engine_bench" else "-s")
        line = a1.plot([x / KIB for x in xs], med, style, label=name, markersize=4)[0]
        a1.fill_between([x / KIB for x in xs], [min(by_size[b]) for b in xs], [max(by_size[b]) for b in xs],
                        color=line.get_color(), alpha=0.15)
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("block size (KiB)")
    a1.set_ylabel("GB/s (median; band: min-max of reps)")
    a1.set_title("Throughput by block size")
    for name, key, style in (("memcpy, all threads", "memcpy", "k-o"), ("raw TE, best method", "te", "-s")):
        xs = [n for n in lengths if len_rows.get((n, key))]
        a2.plot([prompt_bytes(n) / MIB for n in xs], [len_rows[(n, key)] * 1e3 for n in xs], style, label=name,
                markersize=4)
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("bytes moved (MiB)")
    a2.set_ylabel("time (ms, median)")
    a2.set_title(f"Whole prompt ({LAYOUT.bytes_per_token // KIB} KiB/token), log-log; dotted: slope 1")
    if lengths:
        ref = [prompt_bytes(n) / MIB for n in lengths]
        for key in ("memcpy", "te"):
            if len_rows.get((lengths[0], key)):
                t0 = len_rows[(lengths[0], key)] * 1e3
                a2.plot(ref, [t0 * r / ref[0] for r in ref], ":", color="grey", linewidth=0.8)
    for ax in (a1, a2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return save_plot(fig, "transfer_raw.png")


def run(quick: bool) -> Section:
    block_sizes = [16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 2 * MIB]
    total = (64 if quick else 256) * MIB
    lengths = [1024, 4096] if quick else [1024, 2048, 4096, 8192, 16384]
    reps = 3 if quick else 7
    threads = os.cpu_count() or 1
    bench_s = 2.0 if quick else 5.0
    notes: list[str] = []
    # series name -> block size -> GB/s of every rep
    series: dict[str, dict[int, list[float]]] = {"memcpy, 1 thread": {}, f"memcpy, {threads} threads": {}}
    series.update({m: {} for m in RAW_METHODS})
    series["transfer_engine_bench"] = {}
    errors: dict[str, str] = {}
    try:
        for b in progress(block_sizes, desc="raw transfer by block size"):
            n = total // b
            series["memcpy, 1 thread"][b] = [b * n / t / 1e9 for t in memcpy_seconds(b, n, reps, 1)]
            series[f"memcpy, {threads} threads"][b] = [b * n / t / 1e9 for t in memcpy_seconds(b, n, reps, threads)]
            for method in RAW_METHODS:
                if method in errors:
                    continue
                try:
                    series[method][b] = [b * n / t / 1e9 for t in raw_te_read_seconds(b, n, reps, method)]
                except Exception as exc:  # noqa: BLE001 - report, keep the other methods
                    errors[method] = f"{type(exc).__name__}: {exc}"
            if "transfer_engine_bench" not in errors:
                try:
                    series["transfer_engine_bench"][b] = [te_bench_gbps(b, bench_s, threads)]
                except Exception as exc:  # noqa: BLE001
                    errors["transfer_engine_bench"] = f"{type(exc).__name__}: {exc}"
        len_rows: dict[tuple[int, str], float] = {}  # seconds, best TE method by median
        len_method: dict[int, str] = {}
        for n_tok in progress(lengths, desc="raw transfer by prompt length"):
            bb, nb = prompt_blocks(n_tok)
            len_rows[(n_tok, "memcpy")] = median(memcpy_seconds(bb, nb, reps, threads))
            best = None
            for method in RAW_METHODS:
                if method in errors:
                    continue
                try:
                    t = median(raw_te_read_seconds(bb, nb, reps, method))
                except Exception as exc:  # noqa: BLE001
                    errors[method] = f"{type(exc).__name__}: {exc}"
                    continue
                if best is None or t < best[0]:
                    best = (t, method)
            if best:
                len_rows[(n_tok, "te")], len_method[n_tok] = best
    finally:
        close_peers()
    notes += [f"{m}: incomplete: {e}" for m, e in errors.items()]

    te_names = [*RAW_METHODS, "transfer_engine_bench"]
    rows, best_by_size = [], {}
    for b in block_sizes:
        meds = {m: median(series[m][b]) for m in te_names if series[m].get(b)}
        best = max(meds, key=meds.get) if meds else None  # type: ignore[arg-type]
        best_by_size[b] = best
        rows.append([
            f"{b // KIB} KiB", total // b,
            median(series["memcpy, 1 thread"].get(b, [])), median(series[f"memcpy, {threads} threads"].get(b, [])),
            *[meds.get(m, float("nan")) for m in te_names],
            best or "–",
            meds[best] / meds[CONNECTOR_LIKE] if best and CONNECTOR_LIKE in meds else float("nan"),
        ])
    t1 = table(
        ["block size", "blocks", "memcpy 1 thread GB/s", f"memcpy {threads} threads GB/s",
         *[f"TE {m} GB/s" for m in te_names], "best TE", f"best / {CONNECTOR_LIKE}"],
        rows,
    )
    rows2 = []
    for n_tok in lengths:
        nbytes = prompt_bytes(n_tok)
        mc, te = len_rows.get((n_tok, "memcpy")), len_rows.get((n_tok, "te"))
        rows2.append([
            f"{n_tok // 1024}k", f"{nbytes / MIB:,.0f}",
            f"{mc * 1e3:.3g}" if mc else "–", nbytes / mc / 1e9 if mc else "–",
            len_method.get(n_tok, "–"), f"{te * 1e3:.3g}" if te else "–", nbytes / te / 1e9 if te else "–",
            te / mc if te and mc else "–",
        ])
    t2 = table(
        ["prompt", "MiB", f"memcpy ({threads} threads) ms", "memcpy GB/s", "best TE method", "TE ms", "TE GB/s",
         "TE / memcpy time"],
        rows2,
    )
    claims = []
    for b in block_sizes:
        best = best_by_size[b]
        if best and series[CONNECTOR_LIKE].get(b):
            gain = median(series[best][b]) / median(series[CONNECTOR_LIKE][b])
            claims.append(Claim(
                f"{b // KIB} KiB blocks: best raw TE use is `{best}` at {median(series[best][b]):.2f} GB/s, "
                f"{gain:.2f}x synchronous calls one at a time (`{CONNECTOR_LIKE}`, the connector's old method, {median(series[CONNECTOR_LIKE][b]):.2f} GB/s)"
            ))
    for key, label in (("memcpy", "memcpy"), ("te", "raw TE (best method)")):
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
        f"block-size sweep: {total // MIB} MiB per measurement, blocks to random local slots, median of {reps} "
        "after a warm-up, every repetition's bytes checked; memcpy: torch index_select; "
        f"transfer_engine_bench: {threads} submission threads, batches of 128 contiguous blocks, "
        f"{bench_s:.0f} s per size, one figure (its own average)"
    )
    return Section(
        title="Transfer path: raw ceilings",
        summary=(
            "The ceilings any KV transfer on this machine is measured against: a local gather copy (1 thread "
            "and all threads) and Mooncake's TransferEngine pulling blocks from a second process over loopback "
            "TCP, used four ways from Python (synchronous 512-block calls and 8 asynchronous calls in flight, both "
            "waiting on Mooncake's spinning status calls; 4 x 256 and 2 x 512 asynchronous calls in flight that "
            "sleep until a call is due before asking, so they do not spin) and by Mooncake's own C++ "
            "`transfer_engine_bench`. 'best TE' is the fastest of them per block size; the P2P connector "
            "section reports against the best of the Python methods, measured in its own repetitions."
        ),
        tables=[t1, t2],
        plots=[_plot(block_sizes, series, lengths, len_rows)],
        notes=notes,
        claims=claims,
    )
