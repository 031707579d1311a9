"""Checksum speed on one core: per-block hash throughput, and the ceiling a copy plus the xxh3
check leaves a store path (``store/checksum_speed`` reports both; ``store/put_get`` and
``store/integrity_put_get`` hold the connector to those ceilings).
"""

from __future__ import annotations

import time
from collections.abc import Callable

KIB, MIB = 1 << 10, 1 << 20


def gbps(fn: Callable[[memoryview], object], buf: memoryview, block: int, reps: int) -> list[float]:
    n = len(buf) // block
    blocks = [buf[i * block : (i + 1) * block] for i in range(n)]
    for b in blocks[: min(n, 8)]:
        fn(b)  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for b in blocks:
            fn(b)
        out.append(n * block / (time.perf_counter() - t0) / 1e9)
    return out


def one_core_ceilings(buf: memoryview, block: int = 256 * KIB, pass_bytes: int = 4 * MIB,
                      reps: int = 5) -> dict[str, float]:
    """Fractions of a plain copy of ``buf`` (block by block) that a store path with the xxh3 check
    can reach on one core: ``put`` = check and copy in cache-sized passes (the worker's save);
    ``put_unfused`` = check everything, then copy everything (the worker before passes);
    ``get_staged`` = copy into staging and check in passes, then a second copy of everything into
    the KV cache (the worker's load with a deadline); ``get_staged_fused`` = the same with the
    second copy in the passes too. Best of ``reps`` per variant, variants interleaved (the fastest
    run is the one least disturbed by the machine's other work)."""
    import xxhash

    h = xxhash.xxh3_64_intdigest
    n = len(buf) // block
    blocks = [buf[i * block : (i + 1) * block] for i in range(n)]
    stage, kv = memoryview(bytearray(n * block)), memoryview(bytearray(n * block))
    per = max(1, pass_bytes // block)

    def copy(lo: int = 0, hi: int = n, src: list[memoryview] | None = None, dst: memoryview = stage) -> None:
        for i in range(lo, hi):
            dst[i * block : (i + 1) * block] = (src or blocks)[i]

    staged = [stage[i * block : (i + 1) * block] for i in range(n)]
    variants: dict[str, Callable[[], None]] = {"copy": copy}

    def put() -> None:
        for lo in range(0, n, per):
            for b in blocks[lo : lo + per]:
                h(b)
            copy(lo, min(lo + per, n))

    def put_unfused() -> None:
        for b in blocks:
            h(b)
        copy()

    def get_staged(fused: bool = False) -> None:
        for lo in range(0, n, per):
            hi = min(lo + per, n)
            copy(lo, hi)
            for b in staged[lo:hi]:
                h(b)
            if fused:
                copy(lo, hi, staged, kv)
        if not fused:
            copy(0, n, staged, kv)

    variants |= {"put": put, "put_unfused": put_unfused, "get_staged": get_staged,
                 "get_staged_fused": lambda: get_staged(True)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps + 1):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = min(times["copy"][1:])
    return {name: base / min(t[1:]) for name, t in times.items() if name != "copy"}
