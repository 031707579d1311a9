"""A PP 1 decode pulls from a pipeline-parallel prefill with real TransferEngines (TCP loopback) and
real side channels: each stage's worker serves its own layers on its own port, counts its own
DONEs and reports its own ``finished_sending``; a stage holding other layers than the decode
expects is refused by name (a load error), never read."""

from __future__ import annotations

import os
import time

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("mooncake.engine")

from kv_common.kv_byte_settings import KVByteSettings
from kv_common.testing.ports import free_port  # noqa: E402
from kv_mooncake.config import MooncakeConfig, parse_config  # noqa: E402
from kv_mooncake.group_blocks import GroupBlocks
from kv_mooncake.params import RemoteSource
from kv_mooncake.rank_layout import PrefillLayout, PrefillRank
from kv_mooncake.step import HoldRequest, MooncakeStep, PullRequest
from kv_mooncake.worker import LocalCache, MooncakeWorker, RankContext

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
NUM_BLOCKS, BLOCK_BYTES, HEADS, NUM_LAYERS = 16, 2048, 4, 3


def _name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


class Worker:
    """A worker over numpy 'layers' (``layers``: their indices) registered with a real TransferEngine."""

    def __init__(self, cfg: MooncakeConfig, layers: list[int], *, seed: int, port: int, stage: int | None = None,
                 partition: tuple[int, ...] | None = None):
        rng = np.random.default_rng(seed)
        self.layers = {i: rng.integers(0, 256, NUM_BLOCKS * BLOCK_BYTES, dtype=np.uint8) for i in layers}
        producer = stage is not None
        pp = len(partition) if partition else 1
        self.worker = MooncakeWorker(cfg, RankContext(
            engine_id="P" if producer else "D", is_producer=producer, is_consumer=not producer,
            side_channel_port=port, total_kv_heads=HEADS,
            prefill_rank=PrefillRank(0, 0, stage or 0),
            prefill_layout=PrefillLayout(tp_size=1, total_kv_heads=HEADS, pp_size=pp),
            kv_byte_settings=KVByteSettings(model="m", pipeline_parallel_size=pp),
            layer_partition=partition if producer else None, num_hidden_layers=NUM_LAYERS))
        cache = LocalCache([_name(i) for i in layers], [a.ctypes.data for a in self.layers.values()],
                           [BLOCK_BYTES] * len(layers), NUM_BLOCKS, HEADS)
        self.worker.register_cache(cache, {"block_size": 16, "head_size": 8, "num_layers": len(layers)}, "float32")

    def block(self, layer: int, block: int) -> bytes:
        return self.layers[layer][block * BLOCK_BYTES:(block + 1) * BLOCK_BYTES].tobytes()

    def close(self) -> None:
        self.worker.close()


def _prefill(cfg: MooncakeConfig, partition: tuple[int, ...], port: int) -> list[Worker]:
    first, stages = 0, []
    for stage, count in enumerate(partition):
        stages.append(Worker(cfg, list(range(first, first + count)), seed=10 + stage, port=port,
                             stage=stage, partition=partition))
        first += count
    return stages


def _pull(request_id: str, port: int, remote: list[int], local: list[int], pp: int) -> PullRequest:
    source = RemoteSource(engine_id="P", host="127.0.0.1", port=port, request_id=request_id,
                          block_ids_by_group=[remote], pp_size=pp)
    return PullRequest(request_id=request_id, source=source, local_block_ids=[local],
                       blocks_by_group=[GroupBlocks(0, len(local))])


def _wait(check, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def _run(decode: Worker, stages: list[Worker], port: int, remote: list[int], local: list[int]) -> set[str]:
    """Hold on every stage, pull into the decode; (request finished on the decode, what each stage freed)."""
    for stage in stages:
        stage.worker.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=len(remote),
                                                                block_ids=remote)]))
    decode.worker.start_step(MooncakeStep(pulls=[_pull("r", port, remote, local, len(stages))]))
    _wait(lambda: decode.worker.puller.pending_pulls() == 0)
    assert decode.worker.get_finished()[1] == {"r"}
    return decode.worker.ledger.take_block_ids_with_load_errors()


def test_each_stage_serves_its_own_layers_and_reports_its_own_frees():
    cfg = MooncakeConfig(pull_timeout_s=20.0, lease_s=5.0)
    port = free_port()
    stages = _prefill(cfg, (2, 1), port)  # VLLM_PP_LAYER_PARTITION unset: vLLM's split of 3 layers
    decode = Worker(cfg, [2, 0, 1], seed=3, port=free_port())  # its own order: matched by name
    try:
        remote, local = [3, 5, 7], [1, 2, 9]
        assert _run(decode, stages, port, remote, local) == set()
        for stage in stages:
            for layer in stage.layers:
                assert [decode.block(layer, b) for b in local] == [stage.block(layer, b) for b in remote]
        # Each stage frees after its own reader's DONE and reports it itself (vLLM waits for all).
        for stage in stages:
            _wait(lambda s=stage: s.worker.get_finished()[0] == {"r"})
            assert stage.worker.leak_report()["held_blocks"] == 0
    finally:
        for w in (decode, *stages):
            w.close()


def test_a_stage_with_other_layers_is_a_load_error_until_the_partition_is_declared():
    # The prefill ran VLLM_PP_LAYER_PARTITION=1,2; vLLM's default for 3 layers is 2,1.
    port = free_port()
    cfg = MooncakeConfig(pull_timeout_s=20.0, lease_s=5.0, hold_timeout_s=60.0)
    stages = _prefill(cfg, (1, 2), port)
    decode = Worker(cfg, [0, 1, 2], seed=3, port=free_port())
    declared = parse_config({"pull_timeout_s": 20.0, "lease_s": 5.0, "prefill": {"pp_layer_partition": "1,2"}})
    fixed = Worker(declared, [0, 1, 2], seed=4, port=free_port())
    try:
        before = [decode.block(i, 4) for i in range(3)]
        assert _run(decode, stages, port, [6], [4]) == {4}  # every stage's part refused: nothing counts
        assert [decode.block(i, 4) for i in range(3)] == before
        for stage in stages:  # the failed reader still said DONE: nobody waits for the hold's expiry
            _wait(lambda s=stage: s.worker.get_finished()[0] == {"r"})
        assert _run(fixed, stages, port, [6], [4]) == set()
        assert [fixed.block(i, 4) for i in range(3)] == [stages[0].block(0, 6), stages[1].block(1, 6),
                                                          stages[1].block(2, 6)]
    finally:
        for w in (decode, fixed, *stages):
            w.close()


def test_a_stage_refuses_to_start_with_layers_outside_its_range():
    cfg = MooncakeConfig()
    with pytest.raises(ValueError, match="pipeline stage 0 holds model.layers.2.self_attn.attn, outside its layers 0..1"):
        Worker(cfg, [0, 2], seed=1, port=free_port(), stage=0, partition=(2, 1))
