"""MooncakeConnectorV1's worker pull path against the raw TransferEngine, same blocks, same run.

Two processes, no vLLM engine: a prefill ``MooncakeWorker`` (``kv_producer``, child process) and a
decode ``MooncakeWorker`` (``kv_consumer``, this process), each with real registered CPU KV tensors
in vLLM's CPU layout (one ``[num_blocks, kv_heads, block_size, 2*head_size]`` tensor per layer).
The prefill holds one request per repetition (scattered block ids); the decode runs the connector's
worker path on it: ``MooncakeWorker._pull`` (pull plan, handshake (cached after the warm-up),
PullStarted with the block ids, the address list, chunked TE reads, PullDone) and then the raw
TransferEngine reads the very same blocks (one ``batch_transfer_sync_read`` per 512 blocks, the
per-block address list, no side channel) with the decode worker's own engine.

Run alone: ``python -m benchmarks.bench_mooncake [--quick]``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from benchmarks.report import ROOT, Section, median, plot_path, ratio, table

KIB, MIB = 1 << 10, 1 << 20
HEAD_SIZE, BLOCK_TOKENS, NUM_LAYERS, DTYPE_BYTES = 128, 128, 4, 2  # fp16; one head of a block = 64 KiB
BLOCK_SIZES = [16 * KIB, 64 * KIB, 128 * KIB, 256 * KIB, 512 * KIB, 1 * MIB, 2 * MIB]
RAW_BATCH = 512
SMALL_PULL_BLOCK = 256 * KIB
ENGINE_ID = "bench-prefill"


def _shape(block_bytes: int) -> tuple[int, int]:
    """(KV heads, tokens per block) of one layer's block of ``block_bytes``: 128-token blocks of
    whole heads from 64 KiB up, one head of fewer tokens below."""
    token_bytes = 2 * HEAD_SIZE * DTYPE_BYTES
    head_block = BLOCK_TOKENS * token_bytes
    if block_bytes >= head_block:
        return block_bytes // head_block, BLOCK_TOKENS
    return 1, block_bytes // token_bytes


def _kv_caches(block_bytes: int, num_blocks: int, fill: int):
    import torch

    heads, tokens = _shape(block_bytes)
    caches = {}
    for layer in range(NUM_LAYERS):
        t = torch.empty((num_blocks, heads, tokens, 2 * HEAD_SIZE), dtype=torch.float16)
        t.view(torch.uint8).view(-1)[:] = (fill + layer) % 251  # touch every page
        caches[f"model.layers.{layer}.self_attn.attn"] = t
    return caches


def _worker(producer: bool, port: int, heads: int):
    from kv_mooncake.config import MooncakeConfig
    from kv_mooncake.pull_plan import PrefillLayout
    from kv_mooncake.worker import MooncakeWorker

    cfg = MooncakeConfig(hold_timeout_s=600.0, lease_s=60.0, pull_timeout_s=120.0)
    return MooncakeWorker(
        cfg, engine_id=ENGINE_ID, is_producer=producer, is_consumer=not producer, side_channel_port=port,
        prefill_layout=PrefillLayout(tp_size=1, total_kv_heads=heads), total_kv_heads=heads,
        compatibility_base={"model": "bench"},
    )


# ---------------------------------------------------------------- prefill side (child process)
def _serve(port: int, block_bytes: int, num_blocks: int) -> int:
    from kv_mooncake.metadata import HoldRequest, MooncakeStep

    caches = _kv_caches(block_bytes, num_blocks, fill=7)
    w = _worker(True, port, _shape(block_bytes)[0])
    w.register_kv_caches(caches)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:  # {"hold": rid, "block_ids": [...]}
        msg = json.loads(line)
        ids = msg["block_ids"]
        w.start_step(MooncakeStep(holds=[HoldRequest(request_id=msg["hold"], num_blocks=len(ids), block_ids=ids)]))
        w.get_finished()
        print(json.dumps({"held": msg["hold"]}), flush=True)
    w.close()
    return 0


class _Prefill:
    def __init__(self, block_bytes: int, num_blocks: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_mooncake", "--serve", str(self.port), str(block_bytes), str(num_blocks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
        )
        if not json.loads(self.proc.stdout.readline() or '{"ready": false}').get("ready"):  # type: ignore[union-attr]
            self.close()
            raise RuntimeError("prefill worker did not start")

    def hold(self, request_id: str, block_ids: list[int]) -> None:
        self.proc.stdin.write(json.dumps({"hold": request_id, "block_ids": block_ids}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        self.proc.stdout.readline()  # type: ignore[union-attr]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)


# ---------------------------------------------------------------- decode side (this process)
def measure(block_bytes: int, total_bytes: int, reps: int) -> dict[str, list[float]]:
    """Seconds per pull of ``total_bytes`` through the connector path and the raw engine."""
    import numpy as np
    from kv_mooncake.metadata import PullRequest, RemoteSource
    from kv_mooncake.pull_plan import PrefillRank, plan_pulls, request_seed

    heads = _shape(block_bytes)[0]
    per_pull = total_bytes // (block_bytes * NUM_LAYERS)  # blocks of one request
    num_blocks = 2 * per_pull + 1
    rng = np.random.default_rng(block_bytes)
    prefill = _Prefill(block_bytes, num_blocks)
    decode = _worker(False, 0, heads)
    try:
        caches = _kv_caches(block_bytes, num_blocks, fill=0)
        decode.register_kv_caches(caches)
        out: dict[str, list[float]] = {"connector": [], "raw": []}
        for rep in range(reps + 1):  # rep 0: warm-up (handshake, connections, first touch)
            remote_ids = [int(b) for b in rng.permutation(num_blocks)[:per_pull]]
            local_ids = [int(b) for b in rng.permutation(num_blocks)[:per_pull]]
            rid = f"bench-{block_bytes}-{rep}"
            prefill.hold(rid, remote_ids)
            source = RemoteSource(engine_id=ENGINE_ID, host="127.0.0.1", port=prefill.port, request_id=rid,
                                  block_ids=remote_ids)
            req = PullRequest(request_id=rid, source=source, local_block_ids=[local_ids], num_blocks=per_pull,
                              skip_blocks=0)
            # The raw engine: the same blocks (per-block list, no merging), same engine, no side channel.
            pull = plan_pulls(decode.prefill_layout, decode.decode_layout, decode.decode_rank, per_pull, 0,
                              request_seed(rid))[0]
            assert pull.source == PrefillRank(0, 0)

            def connector(rid: str = rid, req: PullRequest = req) -> float:
                decode._pending_pulls.add(rid)
                t0 = time.perf_counter()
                # The worker path, synchronously (vLLM runs it on the pull pool), up to the moment
                # the request is reported finished; the DONE it owes the prefill follows off that path.
                owed = decode._pull_and_report(req)
                seconds = time.perf_counter() - t0
                decode._send_done(owed)
                if decode.ledger.take_block_ids_with_load_errors():
                    raise RuntimeError(f"connector pull {rid} failed (see the log)")
                decode.get_finished()
                return seconds

            def raw(pull=pull, remote_ids: list[int] = remote_ids, local_ids: list[int] = local_ids) -> float:
                hs = next(iter(decode._handshakes.values()))
                local, remote, lengths = [], [], []
                for li, name in enumerate(decode.cache.layer_names):  # type: ignore[union-attr]
                    ri = hs.layer_names.index(name)
                    for src_pos, dst_pos in pull.blocks:
                        remote.append(hs.base_addresses[ri] + remote_ids[src_pos] * hs.block_bytes[ri])
                        local.append(decode.cache.base_addresses[li] + local_ids[dst_pos] * block_bytes)  # type: ignore[union-attr]
                        lengths.append(block_bytes)
                engine = decode.te._engine
                t0 = time.perf_counter()
                for s in range(0, len(lengths), RAW_BATCH):
                    rc = engine.batch_transfer_sync_read(hs.te_address, local[s:s + RAW_BATCH],
                                                         remote[s:s + RAW_BATCH], lengths[s:s + RAW_BATCH])
                    if rc != 0:
                        raise RuntimeError(f"raw batch_transfer_sync_read rc={rc}")
                return time.perf_counter() - t0

            if rep % 2:  # alternate the order: neither path always runs on a warmer cache
                t_raw, t_conn = raw(), connector()
            else:
                t_conn, t_raw = connector(), raw()
            if rep:
                out["connector"].append(t_conn)
                out["raw"].append(t_raw)
        # Checksum: the last pulled blocks equal the prefill's pattern (fill 7 + layer).
        first = next(iter(caches.values()))
        got = first[local_ids[0]].view(-1).view(__import__("torch").uint8)[:64]
        if not bool((got == 7).all()):
            raise RuntimeError("pulled bytes differ from the prefill's")
        return out
    finally:
        decode.close()
        prefill.close()


def _plot(rows: list[tuple[int, float, float]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [b / KIB for b, _, _ in rows]
    a1.plot(xs, [c for _, c, _ in rows], "-o", label="connector worker path")
    a1.plot(xs, [r for _, _, r in rows], "-s", label="raw TransferEngine")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("block size (KiB)")
    a1.set_ylabel("GB/s (median)")
    a1.set_title("Pull throughput, loopback TCP")
    a1.legend(fontsize=8)
    a2.plot(xs, [ratio(c, r) for _, c, r in rows], "-o")
    a2.axhline(0.9, color="grey", linestyle=":", label="target 0.9")
    a2.set_xscale("log", base=2)
    a2.set_ylim(0, 1.3)
    a2.set_xlabel("block size (KiB)")
    a2.set_ylabel("connector / raw")
    a2.set_title("Ratio")
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(plot_path("mooncake.png"), dpi=110)
    plt.close(fig)
    return "benchmarks/plots/mooncake.png"


def run(quick: bool) -> Section:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    total = (32 if quick else 128) * MIB
    reps = 5 if quick else 9
    rows: list[tuple[int, float, float]] = []
    paired: dict[int, float] = {}
    notes: list[str] = []
    for b in BLOCK_SIZES:
        try:
            t = measure(b, total, reps)
        except Exception as exc:  # noqa: BLE001 - report, keep the other sizes
            notes.append(f"{b // KIB} KiB: {type(exc).__name__}: {exc}")
            continue
        rows.append((b, total / median(t["connector"]) / 1e9, total / median(t["raw"]) / 1e9))
        # Each run pulls with both paths back to back: the per-run ratio cancels most of the load
        # drift other processes cause on a shared machine.
        paired[b] = median([r / c for c, r in zip(t["connector"], t["raw"], strict=True)])
    tab = table(
        ["block size", "blocks per pull (all layers)", "connector GB/s", "raw TE GB/s",
         "ratio of medians", "median paired ratio"],
        [[f"{b // KIB} KiB", total // b, c, r, ratio(c, r), paired[b]] for b, c, r in rows],
    )
    # Small pulls show the fixed cost per pull (plan, PullStarted round trip, report) that the
    # bytes no longer hide: 256 KiB blocks, pull sizes 1 MiB up.
    small_rows = []
    for small in ([1, 4, 16] if quick else [1, 2, 4, 8, 16, 64]):
        try:
            t = measure(SMALL_PULL_BLOCK, small * MIB, reps)
        except Exception as exc:  # noqa: BLE001 - report, keep the other sizes
            notes.append(f"{small} MiB pull: {type(exc).__name__}: {exc}")
            continue
        small_rows.append([
            f"{small} MiB", small * MIB // SMALL_PULL_BLOCK,
            median([(c - r) * 1e3 for c, r in zip(t["connector"], t["raw"], strict=True)]),
            median([r / c for c, r in zip(t["connector"], t["raw"], strict=True)]),
        ])
    small_tab = table(
        ["pull size (256 KiB blocks)", "blocks", "connector - raw, ms (median)", "median paired ratio"],
        small_rows,
    )
    return Section(
        title="MooncakeConnectorV1: worker pull path vs raw TransferEngine",
        summary=(
            f"One pull of {total // MIB} MiB ({NUM_LAYERS} layers, scattered block ids on both sides) per run, "
            f"median of {reps} runs after a warm-up (the two paths back to back in each run, alternating "
            "which goes first), two processes on loopback TCP. 'connector' is the "
            "decode worker's pull path (plan, PullStarted lease with the block ids, chunked TE reads, PullDone); "
            "'raw' is the same engine reading the same blocks with batch_transfer_sync_read, no side channel. "
            "The paired ratio (connector / raw within each run, then the median) is the number to read "
            "on a shared machine. Target: connector / raw >= 0.9."
        ),
        tables=[tab, small_tab],
        plots=[_plot(rows)] if rows else [],
        notes=notes + [
            "The second table is the fixed cost per pull (plan, the PullStarted round trip over the "
            "side channel's kept-open connection, the report). Before the side channel kept its "
            "connections open (one new ZMQ connection per message) it was about 5 ms and 8 MiB pulls "
            "ran at about 0.6 of raw. A 4k-token prompt of a 32-layer, 8-KV-head fp16 model is 512 MiB."
        ],
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(_serve(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
    sec = run(quick="--quick" in sys.argv)
    print(sec.summary)
    print("\n".join(sec.tables))
    print("\n".join(sec.notes))
