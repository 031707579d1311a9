"""Integrity cost alone: checksum throughput of zlib crc32, crc32c and xxh3 on this machine.

Each algorithm hashes every block value of a buffer separately (the store connector checksums one
value per block), single thread, block sizes of a KV block's range; a plain copy of the same blocks
(``bytearray`` slice copy) is the memory-speed reference. Algorithms whose module is not installed
are reported as such (``crc32c`` and ``xxhash`` are PyPI packages; zlib ships with Python).

``store/integrity_put_get`` measures the same checks end to end, through the store worker. The
one-core ceilings here say how far the check alone keeps the store path from the raw backend when
nothing overlaps it: ``one_core_ceilings`` (:mod:`benchmarks._lib.checksums`, which the store
sections share).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable

from benchmarks._lib.checksums import gbps, one_core_ceilings
from benchmarks._lib.report import Claim, Section, median, save_plot, table

KIB, MIB = 1 << 10, 1 << 20


def algorithms() -> tuple[dict[str, Callable[[memoryview], int]], list[str]]:
    """name -> function over a buffer; and notes on what is missing."""
    algos: dict[str, Callable[[memoryview], int]] = {"zlib crc32": zlib.crc32}
    notes = []
    try:
        import crc32c

        hw = getattr(crc32c, "hardware_based", None)
        algos["crc32c" + (" (hardware)" if hw else " (software)" if hw is False else "")] = crc32c.crc32c
    except ImportError:
        notes.append("crc32c not installed (pip install crc32c)")
    try:
        import xxhash

        algos["xxh3 64"] = xxhash.xxh3_64_intdigest
    except ImportError:
        notes.append("xxhash not installed (pip install xxhash)")
    return algos, notes


def run(quick: bool) -> Section:
    total = (64 if quick else 256) * MIB
    reps = 3 if quick else 7
    sizes = [16 * KIB, 256 * KIB, 2 * MIB]
    buf = memoryview(os.urandom(total))
    algos, notes = algorithms()
    dst = bytearray(2 * MIB)

    def copy(b: memoryview) -> None:
        dst[: len(b)] = b

    funcs = {"copy (reference)": copy, **algos}
    res = {(name, s): gbps(fn, buf, s, reps) for name, fn in funcs.items() for s in sizes}
    rows = [[name, *[median(res[(name, s)]) for s in sizes], 1e3 / median(res[(name, 256 * KIB)])] for name in funcs]
    claims = []
    base = "zlib crc32"
    for name in algos:
        g = median(res[(name, 256 * KIB)])
        claims.append(Claim(
            f"{name}: {g:.2f} GB/s on 256 KiB blocks (one thread), {1e3 / g:.0f} ms per GB"
            + (f", {g / median(res[(base, 256 * KIB)]):.1f}x zlib crc32" if name != base else "")))
    ceilings = {}
    if "xxh3 64" in algos:
        ceilings = one_core_ceilings(buf[: min(len(buf), 64 * MIB)], reps=max(5, reps))
        claims.append(Claim(
            "one core, copy + xxh3 check as a fraction of the copy alone (256 KiB blocks, 4 MiB passes): "
            f"put {ceilings['put']:.2f} (unfused {ceilings['put_unfused']:.2f}); get through staging "
            f"{ceilings['get_staged']:.2f} (with the scatter in the passes too {ceilings['get_staged_fused']:.2f}): "
            "the store path's ceiling against a memory-speed raw backend when nothing overlaps the check"))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name in funcs:
            ax.plot([s / KIB for s in sizes], [median(res[(name, s)]) for s in sizes],
                    "k--o" if name.startswith("copy") else "-o", label=name, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_xticks([s / KIB for s in sizes], [f"{s // KIB}" for s in sizes])
        ax.set_xlabel("block size (KiB)")
        ax.set_ylabel("GB/s, median (one thread)")
        ax.set_title("Checksum throughput per block")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        plots = [save_plot(fig, "integrity.png")]
    except ImportError as exc:
        plots, notes = [], notes + [f"no plot: {exc}"]
    return Section(
        title="Integrity cost alone: crc32, crc32c, xxh3",
        summary=(
            f"Checksum throughput (GB/s) hashing each block of a {total // MIB} MiB random buffer separately, one "
            f"thread, median of {reps}; the copy row is a plain copy of the same blocks. 'ms per GB' (256 KiB "
            "blocks) is what the checksum adds to every GB a store connector puts or gets when it is not overlapped."
        ),
        tables=[table(["algorithm", *[f"{s // KIB} KiB GB/s" for s in sizes], "ms per GB (256 KiB)"], rows)],
        plots=plots,
        notes=notes,
        claims=claims,
    )
