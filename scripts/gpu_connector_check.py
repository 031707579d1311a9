"""The connectors' data paths on a real CUDA GPU, without vLLM: what a lent GPU machine with no
network can run (it cannot install vLLM's CUDA build; ``scripts/gpu-check.sh`` is the whole check
with engines and tokens, for a machine that can).

Checks, each on KV caches in GPU memory (``torch.cuda``), bytes compared on the device:

* ``p2p-hybrid``: kv-mooncake's prefill and decode workers with Mooncake's CUDA TransferEngine (TCP
  between two engines of this process), two KV-cache groups (full attention and a sliding window):
  each layer read through its own group's block ids, only the window's blocks, never the null
  block; the decode's other blocks untouched; the prefill freed its hold after the read;
* ``p2p-bulk``: a 32 MiB pull in 256 KiB blocks, GPU to GPU through the same path, timed;
* ``store-embedded`` / ``store-mooncake``: kv-store's StoreWorker saves four blocks of three CUDA
  layers and loads them back into other blocks, synchronously and on its loader thread, through
  the embedded backend and through a Mooncake Store (``mooncake_master`` from Mooncake's wheel);
* ``doctor``: kv_common's Mooncake build check names the installed build and the device.

Prints one JSON line per check and a summary; exits 1 on any failure.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

import torch  # noqa: E402

# GPU_CHECK_DEVICE=cpu runs the same checks on host memory (a dry run of this script on a CPU machine).
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
BLOCK, NUM_BLOCKS, BLOCK_BYTES, HEADS = 4, 32, 1024, 2
LAYERS = ["l0", "l1", "l2", "l3"]
# 23 tokens in blocks of 4: the prefill's window kept blocks 7..9 at positions 3..5, the decode's 17..18.
REMOTE = [[1, 2, 3, 4, 5, 6], [0, 0, 0, 7, 8, 9]]
LOCAL = [[11, 12, 13, 14, 15, 16], [0, 0, 0, 0, 17, 18]]


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Instance:
    """One rank's KV cache in GPU memory: one region per layer, registered with its worker."""

    def __init__(self, cfg: Any, groups: Any, *, producer: bool, seed: int, num_blocks: int = NUM_BLOCKS,
                 block_bytes: int = BLOCK_BYTES, layers: list[str] = LAYERS) -> None:
        from kv_common.kv_byte_settings import KVByteSettings
        from kv_common.testing.ports import free_port
        from kv_mooncake.worker import LocalCache, MooncakeWorker, RankContext

        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.block_bytes = block_bytes
        self.layers = [torch.randint(0, 256, (num_blocks * block_bytes,), dtype=torch.uint8, device=DEVICE,
                                     generator=gen) for _ in layers]
        self.before = [t.clone() for t in self.layers]
        self.worker = MooncakeWorker(cfg, RankContext(engine_id="P" if producer else "D", is_producer=producer,
                                                      is_consumer=not producer, side_channel_port=free_port(),
                                                      total_kv_heads=HEADS, kv_byte_settings=KVByteSettings(model="m"),
                                                      kv_groups=groups))
        cache = LocalCache(layers, [t.data_ptr() for t in self.layers], [block_bytes] * len(layers), num_blocks,
                           HEADS)
        self.worker.register_cache(cache, {"block_size": BLOCK, "head_size": 8, "num_layers": len(layers)},
                                   "float32")

    def block(self, layer: int, block: int, *, before: bool = False) -> torch.Tensor:
        src = self.before if before else self.layers
        return src[layer][block * self.block_bytes:(block + 1) * self.block_bytes]


def _pull(decode: Instance, port: int, remote: list[list[int]], local: list[list[int]],
          blocks_by_group: list[tuple[int, int]]) -> tuple[set[int], float]:
    from kv_mooncake.group_blocks import GroupBlocks
    from kv_mooncake.params import RemoteSource
    from kv_mooncake.step import MooncakeStep, PullRequest

    source = RemoteSource(engine_id="P", host="127.0.0.1", port=port, request_id="r", block_ids_by_group=remote)
    pull = PullRequest(request_id="d-r", source=source, local_block_ids=local,
                       blocks_by_group=[GroupBlocks(*blocks) for blocks in blocks_by_group], check_null_blocks=True)
    start = time.perf_counter()
    decode.worker.start_step(MooncakeStep(pulls=[pull]))
    deadline = time.monotonic() + 30
    while "d-r" not in (decode.worker.get_finished()[1] or ()):
        if time.monotonic() > deadline:
            raise TimeoutError("the pull did not finish in 30 s")
        time.sleep(0.0005)
    return decode.worker.ledger.take_block_ids_with_load_errors(), time.perf_counter() - start


def check_p2p_hybrid() -> dict[str, Any]:
    from kv_common.kv_cache_groups import KVGroup
    from kv_mooncake.config import MooncakeConfig
    from kv_mooncake.step import HoldRequest, MooncakeStep

    groups = (KVGroup(0, "full", "FullAttentionSpec", BLOCK, ("l0", "l2")),
              KVGroup(1, "sliding_window", "SlidingWindowSpec", BLOCK, ("l1", "l3"), sliding_window=6))
    cfg = MooncakeConfig(pull_timeout_s=20.0)
    prefill = Instance(cfg, groups, producer=True, seed=1)
    decode = Instance(cfg, groups, producer=False, seed=2)
    try:
        held = sorted({b for g in REMOTE for b in g if b})
        prefill.worker.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=len(held),
                                                                  block_ids=held)]))
        errors, seconds = _pull(decode, prefill.worker.context.side_channel_port, REMOTE, LOCAL, [(0, 6), (4, 6)])
        assert errors == set(), f"load errors {sorted(errors)}"
        _sync()
        moved = set()
        for layer, name in enumerate(LAYERS):
            group = 0 if name in groups[0].layer_names else 1
            for pos in range(0 if group == 0 else 4, 6):
                assert torch.equal(decode.block(layer, LOCAL[group][pos]), prefill.block(layer, REMOTE[group][pos])), \
                    f"layer {name} position {pos}: bytes differ"
                moved.add((layer, LOCAL[group][pos]))
        untouched = sum(1 for layer in range(len(LAYERS)) for b in range(NUM_BLOCKS) if (layer, b) not in moved)
        for layer in range(len(LAYERS)):
            for b in range(NUM_BLOCKS):
                if (layer, b) not in moved:
                    assert torch.equal(decode.block(layer, b), decode.block(layer, b, before=True)), \
                        f"layer {layer} block {b} changed"
        deadline = time.monotonic() + 10
        while prefill.worker.leak_report()["held_requests"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prefill.worker.leak_report()["held_requests"] == 0, "the prefill still holds the request"
        return {"blocks_pulled": len(moved), "blocks_untouched": untouched, "pull_ms": round(seconds * 1e3, 2)}
    finally:
        decode.worker.close()
        prefill.worker.close()


def check_p2p_bulk() -> dict[str, Any]:
    from kv_common.kv_cache_groups import KVGroup
    from kv_mooncake.config import MooncakeConfig
    from kv_mooncake.step import HoldRequest, MooncakeStep

    block_bytes, blocks, layers = 256 << 10, 64, ["l0", "l1"]  # 2 layers x 64 blocks x 256 KiB = 32 MiB
    groups = (KVGroup(0, "full", "FullAttentionSpec", BLOCK, tuple(layers)),)
    cfg = MooncakeConfig(pull_timeout_s=20.0)
    prefill = Instance(cfg, groups, producer=True, seed=3, num_blocks=blocks + 1, block_bytes=block_bytes,
                       layers=layers)
    decode = Instance(cfg, groups, producer=False, seed=4, num_blocks=blocks + 1, block_bytes=block_bytes,
                      layers=layers)
    try:
        times = []
        for _ in range(5):
            ids = list(range(1, blocks + 1))
            prefill.worker.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=blocks,
                                                                      block_ids=ids)]))
            errors, seconds = _pull(decode, prefill.worker.context.side_channel_port, [ids], [ids], [(0, blocks)])
            assert errors == set(), f"load errors {sorted(errors)}"
            times.append(seconds)
            deadline = time.monotonic() + 10
            while prefill.worker.leak_report()["held_requests"] and time.monotonic() < deadline:
                time.sleep(0.01)
        _sync()
        for layer in range(len(layers)):
            assert torch.equal(decode.layers[layer][block_bytes:], prefill.layers[layer][block_bytes:]), "bytes differ"
        best = min(times)
        total = 2 * blocks * block_bytes
        return {"bytes": total, "best_ms": round(best * 1e3, 2), "median_ms": round(sorted(times)[2] * 1e3, 2),
                "best_GBps": round(total / best / 1e9, 2)}
    finally:
        decode.worker.close()
        prefill.worker.close()


def _store_roundtrip(backend: Any) -> dict[str, Any]:
    from kv_store.config import StoreConnectorConfig
    from kv_store.metadata import BlockTransfer, StorePlan
    from kv_store.worker import StoreWorker

    hashes = [bytes([i]) * 32 for i in range(1, 5)]
    torch.manual_seed(0)
    caches = {f"layer{i}": torch.randn(16, 2, 4, 8, device=DEVICE) for i in range(3)}
    worker = StoreWorker(backend=backend, namespace="ns", rank_tag="r0",
                         config=StoreConnectorConfig(staging_bytes=1 << 16))
    try:
        worker.register_kv_caches(caches)
        worker.submit_saves(StorePlan(saves=[BlockTransfer(request_id="s", block_hashes=hashes,
                                                           block_ids=[[1, 2, 3, 4]])]))
        worker.wait_for_request_saves(["s"])
        assert worker.get_finished({"s"}) == {"s"}, "the save did not finish"
        for mode, dst in (("sync", [9, 10, 11, 12]), ("async", [5, 6, 7, 8])):
            plan = StorePlan(loads=[BlockTransfer(request_id=mode, block_hashes=hashes, block_ids=[dst])])
            if mode == "sync":
                worker.load_sync(plan)
            else:
                worker.start_async(plan)
                deadline = time.monotonic() + 20
                while not worker.take_finished_loads(set()):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the async load did not finish in 20 s")
                    time.sleep(0.01)
            assert worker.ledger.take_block_ids_with_load_errors() == set(), f"{mode}: load errors"
            _sync()
            for name, cache in caches.items():
                assert torch.equal(cache[dst], cache[1:5]), f"{mode} load: {name} differs"
        return {"blocks": 4, "layers": len(caches), "loads": ["sync", "async"], "zero_copy": worker.zero_copy}
    finally:
        worker.close(5)


def check_store_embedded() -> dict[str, Any]:
    from kv_common.embedded_backend import EmbeddedBackend

    return _store_roundtrip(EmbeddedBackend())


def check_store_mooncake() -> dict[str, Any]:
    from kv_store.mooncake_backend import MooncakeBackend
    from kv_store.testing.mooncake_processes import MooncakeMaster

    with MooncakeMaster() as master:
        backend = MooncakeBackend({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                                   "protocol": "tcp", "device_name": "", "master_server_address": master.address,
                                   "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20})
        try:
            return _store_roundtrip(backend)
        finally:
            backend.close()


def check_doctor() -> dict[str, Any]:
    from kv_common import mooncake_build

    builds = mooncake_build.installed_builds()
    facts = mooncake_build.device_facts()
    found = mooncake_build.findings(builds, facts)
    assert len(builds) == 1, f"builds {builds}"
    assert [f[0] for f in found] == ["ok"], f"findings {found}"
    return {"builds": [b.distribution for b in builds], "wanted": mooncake_build.wanted_device(facts),
            "findings": found}


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    "doctor": check_doctor, "p2p-hybrid": check_p2p_hybrid, "p2p-bulk": check_p2p_bulk,
    "store-embedded": check_store_embedded, "store-mooncake": check_store_mooncake,
}


def main(argv: list[str]) -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_connector_check: no CUDA device", file=sys.stderr)
        return 2
    from kv_common.testing.ports import use_loopback_host

    use_loopback_host()
    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "none (GPU_CHECK_DEVICE=cpu)"
    print(json.dumps({"gpu": gpu, "torch": torch.__version__,
                      "cuda": torch.version.cuda}), flush=True)
    failed = 0
    for name in argv or list(CHECKS):
        try:
            row = {"check": name, "status": "pass", **CHECKS[name]()}
        except Exception as exc:  # one check's failure is reported, the others still run
            failed += 1
            row = {"check": name, "status": "FAIL", "error": f"{type(exc).__name__}: {exc}",
                   "trace": traceback.format_exc(limit=6)}
        print(json.dumps(row, default=str), flush=True)
    print(json.dumps({"checks": len(argv or CHECKS), "failed": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
