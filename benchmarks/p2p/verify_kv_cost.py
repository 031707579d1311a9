"""What ``verify_kv`` costs a P2P pull (issue 13 §5: off by default, its cost in BENCHMARKS.md).

The harness of the P2P pull section, :mod:`benchmarks._lib.p2p_pull` (a prefill ``MooncakeWorker``
in its own process, the decode's ``MooncakeConnectorV1`` worker side here, the pull timed through
the public path from ``start_load_kv`` until the ``get_finished`` poll that reports it, as vLLM
sees it, every destination byte checked after every repetition), run twice per block size:
``verify_kv`` off, then on (both sides: the prefill digests every block per KV head with xxh3-64 when the request finishes,
the decode checks every read batch against those digests). Each run reads the same blocks raw with
the best TransferEngine methods in the same repetitions, so "of raw" compares the two runs on a
shared yardstick although they ran a minute apart. The prefill's digesting happens when it takes
the hold, outside the pull: it is reported on its own (time of the hold call, off vs on).
"""

from __future__ import annotations

import os

from benchmarks._lib.p2p_pull import NUM_LAYERS, measure
from benchmarks._lib.report import Claim, Section, median, quantile, table

KIB, MIB = 1 << 10, 1 << 20


def _stats(m, total: int) -> dict:
    best = m.best_raw()
    return {
        "pull_ms": [1e3 * t for t in m.connector],
        "gbps": median([total / t / 1e9 for t in m.connector]),
        "of_raw": median([b / c for b, c in zip(best, m.connector, strict=True)]),
        "hold_ms": [1e3 * t for t in m.hold_s],
        "leaks": {side: {k: v for k, v in rep.items() if v} for side, rep in m.leaks.items() if any(rep.values())},
    }


def _spread(ms: list[float]) -> str:
    return f"{median(ms):.1f} [{quantile(ms, 0.1):.1f}-{quantile(ms, 0.9):.1f}]" if ms else "–"


def run(quick: bool) -> Section:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    total = (32 if quick else 128) * MIB
    reps = 7 if quick else 11
    sizes = [64 * KIB, 256 * KIB, 1 * MIB] if quick else [16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 2 * MIB]
    rows, claims, notes = [], [], []
    for b in sizes:
        try:
            off = _stats(measure(b, total, reps), total)
            on = _stats(measure(b, total, reps, verify_kv=True), total)
        except Exception as exc:  # noqa: BLE001 - report, keep the other sizes
            notes.append(f"{b // KIB} KiB: {type(exc).__name__}: {exc}")
            continue
        cost = median(on["pull_ms"]) / median(off["pull_ms"]) - 1
        # Against the raw reads of their own repetitions: a change of the machine's speed between the
        # two runs cancels out.
        cost_raw = off["of_raw"] / on["of_raw"] - 1
        hold_extra = median(on["hold_ms"]) - median(off["hold_ms"])
        rows.append([f"{b // KIB} KiB", total // (b * NUM_LAYERS), _spread(off["pull_ms"]), _spread(on["pull_ms"]),
                     f"{cost:+.0%}", f"{cost_raw:+.0%}", f"{off['gbps']:.2f}", f"{on['gbps']:.2f}", f"{off['of_raw']:.2f}",
                     f"{on['of_raw']:.2f}", _spread(off["hold_ms"]), _spread(on["hold_ms"])])
        claims.append(Claim(
            f"verify_kv on, {total // MIB} MiB pull in {b // KIB} KiB blocks: {median(on['pull_ms']):.1f} ms against "
            f"{median(off['pull_ms']):.1f} ms off ({cost:+.0%}; {cost_raw:+.0%} measured against the best raw TE "
            f"reads of each run's own repetitions: {on['of_raw']:.2f} of raw against {off['of_raw']:.2f}); the prefill's digests add {hold_extra:.1f} ms to "
            f"taking the hold ({total / max(hold_extra, 1e-6) / 1e6:.2f} GB/s)"))
        for name, st in (("off", off), ("on", on)):
            if st["leaks"]:
                claims.append(Claim(f"{b // KIB} KiB, verify_kv {name}: left over {st['leaks']}", False))
    return Section(
        title="verify_kv: what the opt-in integrity check costs a P2P pull",
        summary=(
            f"One pull of {total // MIB} MiB ({NUM_LAYERS} layers, scattered block ids) per repetition, {reps} "
            "repetitions after a warm-up, through MooncakeConnectorV1's public path (the harness of the P2P pull "
            "section), with `verify_kv` off and on; the prefill's digesting at hold time on its own. Off by default."
        ),
        tables=[table(["block size", "blocks per pull", "pull ms, off (median [p10-p90])", "pull ms, on",
                       "on / off - 1 (medians)", "on / off - 1, against raw", "GB/s off", "GB/s on", "of best raw, off (paired median)",
                       "of best raw, on", "prefill hold ms, off", "prefill hold ms, on (digests)"], rows)],
        notes=notes + [
            "digests: xxh3-64 per (block, KV head), computed by the prefill when it takes the hold and sent with the "
            "PullStarted reply; the decode checks each read batch; a mismatch is a load error (recompute)",
            "off and on are two runs of the harness one after the other; 'of best raw' pairs each pull with raw "
            "reads of the same repetition, so 'against raw' cancels a change of the machine's speed between them",
        ],
        claims=claims,
    )
