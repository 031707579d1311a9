"""The P2P pull harness: one pull through MooncakeConnectorV1's public path and the same blocks read raw.

Two processes, no vLLM engine: a prefill ``MooncakeWorker`` (``kv_producer``, child process:
``python -m benchmarks._lib.p2p_pull --serve PORT BLOCK_BYTES NUM_BLOCKS [--verify-kv]``) and a
decode ``MooncakeConnectorV1`` worker side (``kv_consumer``, this process), each with real
registered CPU KV tensors in vLLM's CPU layout. :func:`measure` times each repetition's pull from
``start_load_kv`` to the ``get_finished`` poll that reports it, and the same remote blocks read by
the decode's own TransferEngine with every raw method (:mod:`benchmarks._lib.raw_te`), each on a
thread seen by the same poll (:func:`raw_on_thread`, every :data:`POLL_S`). Used by the P2P pull
section (``p2p/pull``), the verify_kv section (``p2p/verify_kv_cost``) and, for the poll and the
raw reads on a thread, ``p2p/pull_concurrency``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from collections.abc import Callable

from kv_common.testing.ports import free_port

from benchmarks._lib.peers import PeerProcess
from benchmarks._lib.raw_te import RAW_METHODS, read_blocks
from benchmarks._lib.report import median

HEAD_SIZE, BLOCK_TOKENS, NUM_LAYERS, DTYPE_BYTES = 128, 128, 4, 2  # fp16; one head of a block = 64 KiB
ENGINE_ID = "bench-prefill"
# How often the connector's get_finished and the raw reads' completion are polled (vLLM polls once
# per engine step, milliseconds). Issue 25: a 0.1 ms poll that only the connector paid slowed it
# from 1.12 ms to 2.57 ms per 1 MiB pull on 2 cores; now both sides pay the same poll.
POLL_S = float(os.environ.get("KV_BENCH_POLL_MS", "0.5")) / 1e3


def _shape(block_bytes: int) -> tuple[int, int]:
    """(KV heads, tokens per block) of one layer's block of ``block_bytes``: 128-token blocks of
    whole heads from 64 KiB up, one head of fewer tokens below."""
    token_bytes = 2 * HEAD_SIZE * DTYPE_BYTES
    head_block = BLOCK_TOKENS * token_bytes
    if block_bytes >= head_block:
        return block_bytes // head_block, BLOCK_TOKENS
    return 1, block_bytes // token_bytes


def block_value(block_id, layer: int):
    """The byte every byte of the prefill's block ``block_id`` of ``layer`` holds (never 0)."""
    return (block_id * 7 + layer * 13) % 251 + 1


def _kv_caches(block_bytes: int, num_blocks: int, pattern: bool):
    import torch

    heads, tokens = _shape(block_bytes)
    caches = {}
    for layer in range(NUM_LAYERS):
        t = torch.empty((num_blocks, heads, tokens, 2 * HEAD_SIZE), dtype=torch.float16)
        rows = t.view(torch.uint8).view(num_blocks, -1)
        if pattern:
            rows[:] = block_value(torch.arange(num_blocks), layer).to(torch.uint8)[:, None]
        else:
            rows.zero_()  # touch every page
        caches[f"model.layers.{layer}.self_attn.attn"] = t
    return caches


def _worker(producer: bool, port: int, heads: int, verify_kv: bool = False):
    from kv_common.kv_byte_settings import KVByteSettings
    from kv_mooncake.config import MooncakeConfig
    from kv_mooncake.rank_layout import PrefillLayout
    from kv_mooncake.worker import MooncakeWorker, RankContext

    cfg = MooncakeConfig(side_channel_host="127.0.0.1", hold_timeout_s=600.0, lease_s=60.0, pull_timeout_s=120.0,
                         verify_kv=verify_kv)
    return MooncakeWorker(cfg, RankContext(engine_id=ENGINE_ID, is_producer=producer, is_consumer=not producer,
                                           side_channel_port=port,
                                           prefill_layout=PrefillLayout(tp_size=1, total_kv_heads=heads),
                                           total_kv_heads=heads, kv_byte_settings=KVByteSettings(model="bench")))


# ---------------------------------------------------------------- prefill side (child process)
def _serve(port: int, block_bytes: int, num_blocks: int, verify_kv: bool = False) -> int:
    from kv_mooncake.step import HoldRequest, MooncakeStep

    caches = _kv_caches(block_bytes, num_blocks, pattern=True)
    w = _worker(True, port, _shape(block_bytes)[0], verify_kv)
    w.register_kv_caches(caches)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:  # {"hold": rid, "block_ids": [...]}
        msg = json.loads(line)
        ids = msg["block_ids"]
        t0 = time.perf_counter()  # with verify_kv the hold digests every block: timed for p2p/verify_kv_cost
        w.start_step(MooncakeStep(holds=[HoldRequest(request_id=msg["hold"], num_blocks=len(ids), block_ids=ids)]))
        w.get_finished()
        print(json.dumps({"held": msg["hold"], "hold_s": time.perf_counter() - t0}), flush=True)
    print(json.dumps({"leaks": w.leak_report()}), flush=True)
    w.close()
    return 0


class _Prefill(PeerProcess):
    """The prefill worker in its own process (:func:`_serve`), on a side-channel port of its own."""

    def __init__(self, block_bytes: int, num_blocks: int, verify_kv: bool = False) -> None:
        self.port = free_port()
        super().__init__("benchmarks._lib.p2p_pull", "--serve", str(self.port), str(block_bytes), str(num_blocks),
                         *(["--verify-kv"] if verify_kv else []), what="prefill worker")

    def hold(self, request_id: str, block_ids: list[int]) -> float:
        """Hand the prefill a hold of ``block_ids``; returns how long taking it took there (s)."""
        return float(self.request({"hold": request_id, "block_ids": block_ids}).get("hold_s", float("nan")))

    def close(self, timeout_s: float = 20.0) -> dict:
        """Stop the prefill; returns its leak report (held blocks, active reads) at the end."""
        return super().close(timeout_s).get("leaks", {})


# ---------------------------------------------------------------- decode side (this process)
def _public_connector(worker):
    """A MooncakeConnectorV1 whose worker side is ``worker``: vLLM builds it from a VllmConfig; the
    benchmark needs only the worker-side methods vLLM's model runner calls."""
    from kv_mooncake.connector import MooncakeConnectorV1

    conn = MooncakeConnectorV1.__new__(MooncakeConnectorV1)
    conn._worker = worker
    conn._scheduler = None
    conn._connector_metadata = None
    return conn


def seen_by_poll(started: float, is_done: Callable[[], bool], what: str, timeout_s: float = 120.0) -> float:
    """Seconds from ``started`` to the first poll (every :data:`POLL_S`) at which ``is_done()``."""
    deadline = time.monotonic() + timeout_s
    while not is_done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not done within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return time.perf_counter() - started


def raw_on_thread(read: Callable[[], None], what: str) -> float:
    """Seconds of ``read()`` run on a thread of its own, seen by :func:`seen_by_poll` (as the
    connector's pull runs on its pool and is seen by the get_finished poll)."""
    done = threading.Event()
    failed: list[BaseException] = []

    def body() -> None:
        try:
            read()
        except BaseException as exc:  # noqa: BLE001 - handed to the timing thread
            failed.append(exc)
        finally:
            done.set()

    t0 = time.perf_counter()
    threading.Thread(target=body, name="raw-read", daemon=True).start()
    seconds = seen_by_poll(t0, done.is_set, what)
    if failed:
        raise failed[0]
    return seconds


class Measured:
    def __init__(self) -> None:
        self.connector: list[float] = []  # start_load_kv -> the poll at which get_finished reported it
        self.raw: dict[str, list[float]] = {m: [] for m in RAW_METHODS}
        self.leaks: dict[str, dict] = {}
        self.hold_s: list[float] = []  # the prefill taking the hold (digests included with verify_kv)
        self.phases: list[dict[str, float]] = []  # per connector pull: the decode's stats.record_phases

    def best_raw(self) -> list[float]:
        """The best raw method (lowest median over the repetitions), its time in each repetition.

        Not the fastest method per repetition: the minimum of several noisy methods sits below each
        method's own median, so a connector exactly as fast as the best method would score ~0.85."""
        best_method = min(self.raw, key=lambda k: median(self.raw[k]))
        return list(self.raw[best_method])


def measure(block_bytes: int, total_bytes: int, reps: int, verify_kv: bool = False) -> Measured:
    """Seconds per pull of ``total_bytes`` through the connector's public path and every raw method."""
    import numpy as np
    import torch
    from kv_mooncake.connector import MooncakeConnectorMetadata
    from kv_mooncake.group_blocks import GroupBlocks
    from kv_mooncake.params import RemoteSource
    from kv_mooncake.pull.plan import plan_pulls, request_seed
    from kv_mooncake.rank_layout import PrefillRank
    from kv_mooncake.step import MooncakeStep, PullRequest

    heads = _shape(block_bytes)[0]
    per_pull = total_bytes // (block_bytes * NUM_LAYERS)  # blocks of one request
    num_blocks = 2 * per_pull + 1
    rng = np.random.default_rng(block_bytes)
    prefill = _Prefill(block_bytes, num_blocks, verify_kv)
    decode = _worker(False, 0, heads, verify_kv)
    conn = _public_connector(decode)
    out = Measured()
    try:
        caches = _kv_caches(block_bytes, num_blocks, pattern=False)
        conn.register_kv_caches(caches)
        # As vLLM's engine core does once it is built (freeze_gc_heap): the start-up heap (torch,
        # vLLM) is out of later collections, whose full passes otherwise stalled timed pulls here.
        gc.collect()
        gc.freeze()
        rows = [t.view(torch.uint8).view(num_blocks, -1) for t in caches.values()]
        for rep in range(reps + 1):  # rep 0: warm-up (handshake, connections, first touch)
            perm = [int(b) for b in rng.permutation(num_blocks)]
            remote_ids = [int(b) for b in rng.permutation(num_blocks)[:per_pull]]
            local_ids, raw_ids = perm[:per_pull], perm[per_pull : 2 * per_pull]  # disjoint destinations
            rid = f"bench-{block_bytes}-{total_bytes}-{rep}"
            hold_s = prefill.hold(rid, remote_ids)
            source = RemoteSource(engine_id=ENGINE_ID, host="127.0.0.1", port=prefill.port, request_id=rid,
                                  block_ids_by_group=[remote_ids])
            req = PullRequest(request_id=rid, source=source, local_block_ids=[local_ids],
                              blocks_by_group=[GroupBlocks(0, per_pull)])
            pull = plan_pulls(decode.prefill_layout, decode.context.decode_layout, decode.context.decode_rank,
                              per_pull, 0, request_seed(rid))[0]
            assert pull.source == PrefillRank(0, 0)
            idx = torch.tensor(local_ids)
            for r in rows:
                r[idx] = 0

            phases: list[dict[str, float]] = []

            def connector(rid: str = rid, req: PullRequest = req, phases: list[dict[str, float]] = phases) -> float:
                conn.bind_connector_metadata(MooncakeConnectorMetadata(MooncakeStep(pulls=[req])))
                decode.stats.reset()  # this pull's phases alone
                t0 = time.perf_counter()
                conn.start_load_kv(None)
                conn.clear_connector_metadata()

                def reported() -> bool:
                    _sending, recving = conn.get_finished(set())
                    return bool(recving and rid in recving)

                seconds = seen_by_poll(t0, reported, f"pull {rid} (get_finished)")
                if conn.get_block_ids_with_load_errors():
                    raise RuntimeError(f"connector pull {rid} failed (see the log)")
                phases.append(decode.stats.phase_means_s())
                return seconds

            def raw(method: str, remote_ids: list[int] = remote_ids, raw_ids: list[int] = raw_ids, pull=pull) -> float:
                hs = next(iter(decode.puller.messenger._handshakes.values()))
                local, remote, lengths = [], [], []
                for li, name in enumerate(decode.cache.layer_names):  # type: ignore[union-attr]
                    ri = hs.layer_names.index(name)
                    for src_pos, dst_pos in pull.blocks:
                        remote.append(hs.base_addresses[ri] + remote_ids[src_pos] * hs.block_bytes[ri])
                        local.append(decode.cache.base_addresses[li] + raw_ids[dst_pos] * block_bytes)  # type: ignore[union-attr]
                        lengths.append(block_bytes)
                return raw_on_thread(
                    lambda: read_blocks(decode.te._engine, hs.te_address, local, remote, lengths, method),
                    f"raw read ({method})")

            # The connector first in the warm-up (its handshake is the raw paths' address book), then
            # the order rotates: no path always runs on a warmer cache or a quieter moment.
            runs = ["connector", *RAW_METHODS]
            shift = rep % len(runs)
            times: dict[str, float] = {}
            for name in runs[shift:] + runs[:shift] if rep else runs:
                times[name] = connector() if name == "connector" else raw(name)
            # The connector's destination holds exactly the prefill's blocks (every byte).
            src_pos_of = {dst: src for src, dst in pull.blocks}
            want = torch.tensor([remote_ids[src_pos_of[j]] for j in range(per_pull)])
            for layer, r in enumerate(rows):
                if not bool((r[idx] == block_value(want, layer).to(torch.uint8)[:, None]).all()):
                    raise RuntimeError(f"rep {rep}: layer {layer}: the connector's destination blocks differ from the prefill's")
            if rep:
                out.hold_s.append(hold_s)
                out.connector.append(times["connector"])
                out.phases.extend(phases)
                for m in RAW_METHODS:
                    out.raw[m].append(times[m])
        out.leaks["decode"] = decode.leak_report()
        return out
    finally:
        gc.unfreeze()
        decode.close()
        out.leaks["prefill"] = prefill.close()


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"]:
        sys.exit("usage: python -m benchmarks._lib.p2p_pull --serve PORT BLOCK_BYTES NUM_BLOCKS [--verify-kv]")
    sys.exit(_serve(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), verify_kv="--verify-kv" in sys.argv))
