"""Per-group pulls with real TransferEngines (TCP loopback) and real side channels: two KV-cache
groups (full attention, a sliding window), each layer read through its own group's block ids, only
the window's blocks of the sliding group, never the null block, and load errors named per group."""

from __future__ import annotations

import os
import time

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("mooncake.engine")

from kv_common.kv_byte_settings import KVByteSettings
from kv_common.kv_cache_groups import KVGroup  # noqa: E402
from kv_mooncake.config import MooncakeConfig  # noqa: E402
from kv_mooncake.group_blocks import GroupBlocks
from kv_mooncake.params import RemoteSource
from kv_mooncake.step import HoldRequest, MooncakeStep, PullRequest
from kv_mooncake.worker import LocalCache, MooncakeWorker, RankContext

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
BLOCK, NUM_BLOCKS, BLOCK_BYTES, HEADS = 4, 32, 1024, 2
SHAPE = {"block_size": BLOCK, "head_size": 8, "num_layers": 4}
# Layers 0 and 2 full attention, 1 and 3 a sliding window of 6 tokens (Gemma 2's alternation).
GROUPS = (KVGroup(0, "full", "FullAttentionSpec", BLOCK, ("l0", "l2")),
          KVGroup(1, "sliding_window", "SlidingWindowSpec", BLOCK, ("l1", "l3"), sliding_window=6))
LAYERS = ["l0", "l1", "l2", "l3"]


class Instance:
    def __init__(self, cfg: MooncakeConfig, *, producer: bool, seed: int):
        from kv_common.testing.ports import free_port

        rng = np.random.default_rng(seed)
        self.layers = [rng.integers(0, 256, NUM_BLOCKS * BLOCK_BYTES, dtype=np.uint8) for _ in LAYERS]
        self.worker = MooncakeWorker(cfg, RankContext(engine_id="P" if producer else "D", is_producer=producer,
                                                      is_consumer=not producer, side_channel_port=free_port(),
                                                      total_kv_heads=HEADS, kv_byte_settings=KVByteSettings(model="m"),
                                                      kv_groups=GROUPS))
        cache = LocalCache(LAYERS, [a.ctypes.data for a in self.layers], [BLOCK_BYTES] * 4, NUM_BLOCKS, HEADS)
        self.worker.register_cache(cache, SHAPE, "float32")
        self.before = [a.copy() for a in self.layers]

    def block(self, layer: int, block: int, *, before: bool = False) -> bytes:
        return (self.before if before else self.layers)[layer][block * BLOCK_BYTES:(block + 1) * BLOCK_BYTES].tobytes()


@pytest.fixture
def pair():
    cfg = MooncakeConfig(pull_timeout_s=10.0)
    prefill, decode = Instance(cfg, producer=True, seed=1), Instance(cfg, producer=False, seed=2)
    yield prefill, decode
    decode.worker.close()
    prefill.worker.close()


# 23 tokens in blocks of 4: 6 blocks a group. The prefill's window kept blocks 3..5 (its null block 0
# stands for the others), the decode's allocation kept 4..5: the window after 23 tokens is 18..22.
REMOTE = [[1, 2, 3, 4, 5, 6], [0, 0, 0, 7, 8, 9]]
LOCAL = [[11, 12, 13, 14, 15, 16], [0, 0, 0, 0, 17, 18]]


def _pull(port: int, remote: list[list[int]]) -> PullRequest:
    source = RemoteSource(engine_id="P", host="127.0.0.1", port=port, request_id="r", block_ids_by_group=remote)
    return PullRequest(request_id="d-r", source=source, local_block_ids=LOCAL,
                       blocks_by_group=[GroupBlocks(0, 6), GroupBlocks(4, 6)], check_null_blocks=True)


def _run(decode: Instance, pull: PullRequest) -> set[int]:
    decode.worker.start_step(MooncakeStep(pulls=[pull]))
    deadline = time.monotonic() + 20
    while "d-r" not in (decode.worker.get_finished()[1] or ()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return decode.worker.ledger.take_block_ids_with_load_errors()


def test_each_layer_is_read_through_its_own_groups_blocks(pair):
    prefill, decode = pair
    held = sorted({b for g in REMOTE for b in g if b})
    prefill.worker.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=len(held), block_ids=held)]))
    assert _run(decode, _pull(prefill.worker.context.side_channel_port, REMOTE)) == set()
    moved: set[tuple[int, int]] = set()
    for layer, name in enumerate(LAYERS):
        group = 0 if name in GROUPS[0].layer_names else 1
        first = 0 if group == 0 else 4
        for pos in range(first, 6):
            assert decode.block(layer, LOCAL[group][pos]) == prefill.block(layer, REMOTE[group][pos]), (name, pos)
            moved.add((layer, LOCAL[group][pos]))
    # Nothing else changed: not the null block, not the other group's blocks in a layer, not the
    # window's dropped blocks (the prefill's block 7 at position 3 stays unread).
    for layer in range(len(LAYERS)):
        for block in range(NUM_BLOCKS):
            if (layer, block) not in moved:
                assert decode.block(layer, block) == decode.block(layer, block, before=True), (layer, block)
    assert prefill.worker.leak_report()["held_requests"] == 0  # the one reader's DONE freed every group's blocks


def test_a_failed_read_names_the_unread_blocks_of_every_group(pair):
    prefill, decode = pair
    # The prefill holds only the full group's blocks: the lease names a sliding-window block it does
    # not hold, so the read is refused and nothing of either group counts as loaded.
    prefill.worker.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=6, block_ids=REMOTE[0])]))
    errors = _run(decode, _pull(prefill.worker.context.side_channel_port, REMOTE))
    assert errors == {11, 12, 13, 14, 15, 16, 17, 18}


def test_a_null_block_in_the_window_is_a_load_error_not_a_read(pair):
    prefill, decode = pair
    remote = [REMOTE[0], [0, 0, 0, 7, 0, 9]]  # position 4 of the window: the prefill's null block
    held = sorted({b for g in remote for b in g if b})
    prefill.worker.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=len(held), block_ids=held)]))
    errors = _run(decode, _pull(prefill.worker.context.side_channel_port, remote))
    assert errors == {11, 12, 13, 14, 15, 16, 17, 18}
    for layer in range(len(LAYERS)):
        assert decode.block(layer, 0) == decode.block(layer, 0, before=True)  # the null block stays untouched


# ---- how a failed pull reaches vLLM ---------------------------------------------------------------
def _connector(worker: MooncakeWorker):
    """The connector's worker side around ``worker``, under vLLM's own MultiConnector aggregation."""
    from kv_mooncake.connector import MooncakeConnectorV1
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    connector = MooncakeConnectorV1.__new__(MooncakeConnectorV1)  # its __init__ needs a whole vLLM config
    connector._scheduler, connector._worker = None, worker
    multi = MultiConnector.__new__(MultiConnector)
    multi._connectors, multi._extra_async_saves = [connector], {}
    return connector, multi


def test_a_failed_hybrid_pull_is_reported_per_request_never_as_block_ids(pair):
    """vLLM raises in the EngineCore on block-level load errors of a model with several KV-cache
    groups (its block ids are unique only within a group): the request goes out in failed_recving,
    in the step that reports it finished, through vLLM's MultiConnector too."""
    prefill, decode = pair
    connector, multi = _connector(decode.worker)
    prefill.worker.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=6, block_ids=REMOTE[0])]))
    decode.worker.start_step(MooncakeStep(pulls=[_pull(prefill.worker.context.side_channel_port, REMOTE)]))
    deadline = time.monotonic() + 20
    while not (results := multi.get_transfer_results(set())).finished_recving and time.monotonic() < deadline:
        time.sleep(0.01)
    assert results.finished_recving == {"d-r"} and results.failed_recving == {"d-r"}
    assert multi.get_block_ids_with_load_errors() == set() == connector.get_block_ids_with_load_errors()
    assert multi.get_transfer_results(set()).failed_recving == set()  # reported once


def test_a_hybrid_failure_waits_for_its_finish_and_one_group_keeps_block_ids():
    hybrid = MooncakeWorker(MooncakeConfig(), RankContext(engine_id="D", is_producer=False, is_consumer=True,
                                                          side_channel_port=0, kv_groups=GROUPS))
    # The pull thread records the failure just before it marks the request finished.
    hybrid.ledger.record_failed_load("a", [[11], [17]])
    hybrid.ledger.record_failed_load("b", [[12], [18]])
    assert hybrid.take_failed_pulls(set(), set()) == set()
    assert hybrid.take_failed_pulls({"a"}, {"b"}) == {"a"}  # b: vLLM finished it before its pull reported
    assert hybrid.take_failed_pulls({"b"}, set()) == set()
    assert hybrid.take_block_ids_with_load_errors() == set()
    one = MooncakeWorker(MooncakeConfig(), RankContext(engine_id="D", is_producer=False, is_consumer=True,
                                                       side_channel_port=0, kv_groups=GROUPS[:1]))
    one.ledger.record_failed_load("a", [[11, 12]])
    assert one.take_failed_pulls({"a"}, set()) == set()  # only the unread blocks are recomputed
    assert one.take_block_ids_with_load_errors() == {11, 12}
