"""Decode pulls with several requests in flight, from one and from two prefills (issue 13 §3).

No vLLM engine: each prefill is a ``MooncakeWorker`` (``kv_producer``) in its own process over
registered CPU regions (4 layers, ``BLOCK_BYTES`` per block and layer, a byte pattern per block and
layer); the decode is a ``MooncakeWorker`` (``kv_consumer``) in this process, driven the way vLLM's
model runner drives it: ``start_step`` with N pulls at once, ``get_finished`` polled until all N
are reported. Per request: latency from ``start_step`` to its report; per round: throughput. Every
destination block is checked byte for byte after each round.

In the same round the decode's own TransferEngine reads the very same remote blocks raw, three ways:
synchronous batches per prefill (all N requests' blocks, chunked at 512), one asynchronous batch per
request submitted at once then awaited (both spin on Mooncake's status calls), and per prefill the
reader that sleeps until a call is due before asking (no spinning wait); the fastest is the "best raw
TE" of that round. The raw reads run on a thread and are seen by the same poll (``POLL_S`` of
:mod:`benchmarks._lib.p2p_pull`) as the connector's ``get_finished``.

``run(quick)`` returns the report's section; ``measure_all(rounds)`` one dict per (prefills, in
flight), which ``write_rows(rows, path)`` writes as a Markdown table. Run alone:
``python -m benchmarks.p2p.pull_concurrency [--quick]`` (writes ``benchmarks/results/pull_concurrency.md``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from kv_common.testing.ports import free_port

from benchmarks._lib.p2p_pull import POLL_S, raw_on_thread
from benchmarks._lib.peers import PeerProcess
from benchmarks._lib.raw_te import read_blocks
from benchmarks._lib.report import RESULTS, Claim, Section, table

KIB = 1 << 10
BLOCK_BYTES = 64 * KIB  # per layer
NUM_LAYERS = 4
HEADS = 4
BLOCKS_PER_REQUEST = 8  # 2 MiB per request
IN_FLIGHT = (1, 4, 16)
PREFILLS = (1, 2)
SLEEPING = "async 4x256, sleep"  # the raw method that sleeps before asking (benchmarks._lib.raw_te)


def _pattern(block: int, layer: int) -> int:
    return (block * 7 + layer * 31 + 1) % 251


def _regions(num_blocks: int, pattern: bool):
    import numpy as np

    layers = []
    for layer in range(NUM_LAYERS):
        a = np.zeros(num_blocks * BLOCK_BYTES, dtype=np.uint8)
        if pattern:
            for b in range(num_blocks):
                a[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES] = _pattern(b, layer)
        layers.append(a)
    return layers


def _worker(engine_id: str, producer: bool, port: int, layers, num_blocks: int):
    from kv_common.kv_byte_settings import KVByteSettings
    from kv_mooncake.config import MooncakeConfig
    from kv_mooncake.worker import LocalCache, MooncakeWorker, RankContext

    cfg = MooncakeConfig(side_channel_host="127.0.0.1", hold_timeout_s=600.0, lease_s=60.0, pull_timeout_s=120.0)
    w = MooncakeWorker(cfg, RankContext(engine_id=engine_id, is_producer=producer, is_consumer=not producer,
                                        side_channel_port=port, total_kv_heads=HEADS,
                                        kv_byte_settings=KVByteSettings(model="bench")))
    cache = LocalCache([f"l{i}" for i in range(NUM_LAYERS)], [a.ctypes.data for a in layers],
                       [BLOCK_BYTES] * NUM_LAYERS, num_blocks, HEADS)
    w.register_cache(cache, {"block_size": 16, "head_size": BLOCK_BYTES // HEADS // 16 // 8, "num_layers": NUM_LAYERS},
                     "float32")
    return w


# ---------------------------------------------------------------- prefill side (child process)
def _serve(engine_id: str, port: int, num_blocks: int) -> int:
    from kv_mooncake.step import HoldRequest, MooncakeStep

    layers = _regions(num_blocks, pattern=True)
    w = _worker(engine_id, True, port, layers, num_blocks)
    print(json.dumps({"ready": True, "te": w.te.rpc_address, "bases": [a.ctypes.data for a in layers]}), flush=True)
    for line in sys.stdin:  # {"holds": {request_id: [block ids]}}
        holds = json.loads(line)["holds"]
        w.start_step(MooncakeStep(holds=[HoldRequest(request_id=r, num_blocks=len(ids), block_ids=ids)
                                         for r, ids in holds.items()]))
        w.get_finished()
        print(json.dumps({"held": len(holds)}), flush=True)
    print(json.dumps({"leaks": w.leak_report()}), flush=True)
    w.close()
    return 0


class _Prefill(PeerProcess):
    """A prefill worker in its own process (:func:`_serve`), on a side-channel port of its own."""

    def __init__(self, engine_id: str, num_blocks: int) -> None:
        self.port, self.engine_id = free_port(), engine_id
        super().__init__("benchmarks.p2p.pull_concurrency", "--serve", engine_id, str(self.port), str(num_blocks),
                         what=f"prefill worker {engine_id}")
        self.te_address, self.bases = self.ready["te"], self.ready["bases"]

    def hold(self, holds: dict[str, list[int]]) -> None:
        self.request({"holds": holds})

    def close(self, timeout_s: float = 20.0) -> dict:
        """Stop the prefill; returns its leak report (held blocks, active reads) at the end."""
        return super().close(timeout_s).get("leaks", {})


# ---------------------------------------------------------------- decode side (this process)
def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _raw_reads(engine, prefills, plan, local_bases) -> float:
    """Best raw TE time for the same reads: sync 512-block batches per prefill, one async batch per
    request (both spin on Mooncake's status calls), or per prefill the sleeping reader of
    :mod:`benchmarks._lib.raw_te` (no spinning wait). Each runs on a thread of its own, seen by the same
    poll as the connector's get_finished."""
    per_peer: dict[int, tuple[list[int], list[int]]] = {}
    per_request: list[tuple[int, list[int], list[int]]] = []
    for p, remote_ids, local_ids in plan:
        loc, rem = [], []
        for layer in range(NUM_LAYERS):
            for r, d in zip(remote_ids, local_ids):
                rem.append(prefills[p].bases[layer] + r * BLOCK_BYTES)
                loc.append(local_bases[layer] + d * BLOCK_BYTES)
        per_request.append((p, loc, rem))
        acc = per_peer.setdefault(p, ([], []))
        acc[0].extend(loc)
        acc[1].extend(rem)

    def per_prefill(method: str) -> None:
        for p, (loc, rem) in per_peer.items():
            read_blocks(engine, prefills[p].te_address, loc, rem, [BLOCK_BYTES] * len(loc), method)

    def per_request_async() -> None:
        ids = [engine.batch_transfer_async_read(prefills[p].te_address, loc, rem, [BLOCK_BYTES] * len(loc))
               for p, loc, rem in per_request]
        assert engine.get_batch_transfer_status(ids) == 0

    return min(raw_on_thread(lambda: per_prefill("sync 512"), "raw sync reads"),
               raw_on_thread(per_request_async, "raw async reads"),
               raw_on_thread(lambda: per_prefill(SLEEPING), "raw sleeping reads"))


def measure(num_prefills: int, in_flight: int, rounds: int) -> dict:
    import numpy as np
    from kv_mooncake.group_blocks import GroupBlocks
    from kv_mooncake.params import RemoteSource
    from kv_mooncake.step import MooncakeStep, PullRequest

    per_prefill_blocks = in_flight * BLOCKS_PER_REQUEST + 8
    local_blocks = in_flight * BLOCKS_PER_REQUEST
    prefills = [_Prefill(f"P{i}", per_prefill_blocks) for i in range(num_prefills)]
    local = _regions(local_blocks, pattern=False)
    decode = _worker("D", False, 0, local, local_blocks)
    local_bases = [a.ctypes.data for a in local]
    latencies: list[float] = []
    walls: list[float] = []
    raw: list[float] = []
    try:
        for rnd in range(rounds + 1):  # round 0 warms up (handshakes, connections)
            plan = []  # (prefill, remote ids, local ids) per request
            holds: list[dict[str, list[int]]] = [{} for _ in prefills]
            for i in range(in_flight):
                p = i % num_prefills
                slot = i // num_prefills
                remote = [(slot * BLOCKS_PER_REQUEST + k * 3 + rnd) % per_prefill_blocks for k in range(BLOCKS_PER_REQUEST)]
                local_ids = [i * BLOCKS_PER_REQUEST + k for k in range(BLOCKS_PER_REQUEST)]
                plan.append((p, remote, local_ids))
                holds[p][f"r{rnd}-{i}"] = remote
            for p, h in zip(prefills, holds):
                p.hold(h)
            for a in local:
                a[:] = 0
            pulls = [PullRequest(request_id=f"r{rnd}-{i}", local_block_ids=[local_ids],
                                 blocks_by_group=[GroupBlocks(0, BLOCKS_PER_REQUEST)],
                                 source=RemoteSource(engine_id=prefills[p].engine_id, host="127.0.0.1",
                                                     port=prefills[p].port, request_id=f"r{rnd}-{i}",
                                                     block_ids_by_group=[remote]))
                     for i, (p, remote, local_ids) in enumerate(plan)]
            t0 = time.perf_counter()
            decode.start_step(MooncakeStep(pulls=pulls))
            done: dict[str, float] = {}
            while len(done) < in_flight:
                for r in decode.get_finished()[1] or ():
                    done[r] = time.perf_counter() - t0
                if time.perf_counter() - t0 > 120:
                    raise RuntimeError(f"pulls not done after 120 s: {len(done)} of {in_flight}")
                time.sleep(POLL_S)  # the raw reads are seen by the same poll
            wall = time.perf_counter() - t0
            errors = decode.ledger.take_block_ids_with_load_errors()
            if errors:
                raise RuntimeError(f"load errors in blocks {sorted(errors)[:8]}")
            for _p, remote, local_ids in plan:
                for layer in range(NUM_LAYERS):
                    for r, d in zip(remote, local_ids):
                        got = local[layer][d * BLOCK_BYTES:(d + 1) * BLOCK_BYTES]
                        if not np.all(got == _pattern(r, layer)):
                            raise RuntimeError(f"wrong bytes in local block {d} layer {layer}")
            raw_s = _raw_reads(decode.te._engine, prefills, plan, local_bases)
            if rnd:
                latencies.extend(done.values())
                walls.append(wall)
                raw.append(raw_s)
    finally:
        decode.close()
        leaks = [p.close() for p in prefills]
    request_bytes = BLOCKS_PER_REQUEST * NUM_LAYERS * BLOCK_BYTES
    total = in_flight * request_bytes
    wall = sorted(walls)[len(walls) // 2]
    raw_s = sorted(raw)[len(raw) // 2]
    return {
        "prefills": num_prefills,
        "in_flight": in_flight,
        "request_MiB": request_bytes / (1 << 20),
        "pulls_per_s": in_flight / wall,
        "GB_per_s": total / wall / 1e9,
        "p50_ms": 1e3 * _quantile(latencies, 0.5),
        "p99_ms": 1e3 * _quantile(latencies, 0.99),
        "raw_GB_per_s": total / raw_s / 1e9,
        "vs_raw": raw_s / wall,
        "prefill_leaks": leaks,
    }


def rounds_for(quick: bool) -> int:
    return 5 if quick else 10


def measure_all(rounds: int) -> list[dict]:
    return [measure(p, n, rounds) for p in PREFILLS for n in IN_FLIGHT]


def run(quick: bool = False):
    rounds = rounds_for(quick)
    rows = measure_all(rounds)
    claims = []
    for p in PREFILLS:
        mine = {r["in_flight"]: r for r in rows if r["prefills"] == p}
        lo, hi = mine[min(mine)], mine[max(mine)]
        claims.append(Claim(
            f"{p} prefill{'s' if p > 1 else ''}: {hi['in_flight']} pulls in flight move {hi['GB_per_s']:.2f} GB/s "
            f"({hi['GB_per_s'] / lo['GB_per_s']:.1f}x one at a time), p50 / p99 latency {hi['p50_ms']:.1f} / "
            f"{hi['p99_ms']:.1f} ms against {lo['p50_ms']:.1f} / {lo['p99_ms']:.1f} ms; "
            f"{hi['vs_raw']:.2f} of the best raw TE reads of the same blocks"))
    worst = min(rows, key=lambda r: r["vs_raw"])
    claims.append(Claim(f"slowest against raw: {worst['prefills']} prefill(s), {worst['in_flight']} in flight: "
                        f"{worst['vs_raw']:.2f} of the best raw TE reads"))
    leaked = [(r["prefills"], r["in_flight"], leak) for r in rows for leak in r["prefill_leaks"]
              if any((leak or {}).values())]
    claims.append(Claim("prefill leak reports at the end of every measurement: "
                        + (f"left over {leaked}" if leaked else "nothing held, no active read"), not leaked))
    return Section(
        title="Decode pulls with several requests in flight, from one and from two prefills (issue 13 §3)",
        summary=(
            f"One decode MooncakeWorker pulls N requests of {BLOCKS_PER_REQUEST * NUM_LAYERS * BLOCK_BYTES >> 20} MiB "
            f"({BLOCKS_PER_REQUEST} blocks x {NUM_LAYERS} layers of {BLOCK_BYTES >> 10} KiB) at once from one or two "
            "prefill workers (own processes, loopback TCP), started together the way vLLM's model runner starts a "
            "step's pulls, polled with get_finished until all N are reported; every destination byte checked after "
            "each round. Latency: start to the request's report. 'of raw': the same blocks read by the decode's "
            "own TransferEngine in the same round (sync batches per prefill, one async batch per request, or the "
            "sleeping reader per prefill), the fastest of the three, seen by the same get_finished-period poll."
        ),
        tables=[table(["prefills", "in flight", "pulls/s", "GB/s", "p50 ms", "p99 ms", "best raw TE GB/s", "of raw"],
                      [[r["prefills"], r["in_flight"], r["pulls_per_s"], r["GB_per_s"], r["p50_ms"], r["p99_ms"],
                        r["raw_GB_per_s"], r["vs_raw"]] for r in rows])],
        notes=[f"{rounds} rounds per row after a warm-up round; p99 over rounds x requests in flight (with few "
               "samples it is the slowest one)"],
        claims=claims,
    )


def write_rows(rows: list[dict], path: str | os.PathLike[str]) -> None:
    head = ["prefills", "in flight", "pulls/s", "GB/s", "p50 ms", "p99 ms", "best raw TE GB/s", "of raw"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['prefills']} | {r['in_flight']} | {r['pulls_per_s']:.0f} | {r['GB_per_s']:.2f} | "
                     f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['raw_GB_per_s']:.2f} | {r['vs_raw']:.2f} |")
    Path(path).write_text("\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        return _serve(argv[1], int(argv[2]), int(argv[3]))
    rows = measure_all(rounds_for("--quick" in argv))
    out = RESULTS / "pull_concurrency.md"
    write_rows(rows, out)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    sys.exit(main(sys.argv[1:]))
