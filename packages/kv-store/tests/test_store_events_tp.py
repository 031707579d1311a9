"""KV events with TP > 1: ``BlockStored`` once every rank tag has stored the block, nothing early,
duplicated or parentless, bounded memory. Reports travel the way vLLM 0.32 aggregates worker
metadata (``KVOutputAggregator``: the first non-None report is the accumulator, None is skipped)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")  # KV events are vLLM types

import torch  # noqa: E402
from kv_common.embedded_backend import EmbeddedBackend  # noqa: E402
from kv_store import scheduler as scheduler_mod  # noqa: E402
from kv_store.config import StoreConnectorConfig  # noqa: E402
from kv_store.metadata import BlockTransfer, StorePlan  # noqa: E402
from kv_store.scheduler import StoreScheduler  # noqa: E402
from kv_store.vllm_metadata import StoreWorkerMetadata  # noqa: E402
from kv_store.worker import StoreWorker  # noqa: E402
from test_store_scheduler_worker import BS, FakeBlocks, FakeRequest, drain, new_req_output  # noqa: E402

TAGS = ["t0", "t1"]


def _worker(backend, tag):
    w = StoreWorker(backend=backend, namespace="ns", rank_tag=tag, config=StoreConnectorConfig(staging_bytes=1 << 16))
    w.register_kv_caches({"layer0": torch.randn(16, 2, BS, 8)})
    return w


def _aggregate(*reports):
    """vLLM's KVOutputAggregator over the ranks' build_connector_worker_meta()."""
    acc = None
    for report in reports:
        meta = StoreWorkerMetadata(report) if report is not None else None
        if acc is None:
            acc = meta
        elif meta is not None:
            acc = acc.aggregate(meta)
    return acc.report if acc is not None else None


def _save(worker, hashes, ids):
    worker.submit_saves(StorePlan(saves=[BlockTransfer(request_id="a", block_hashes=hashes, block_ids=[ids])]))
    assert drain(worker, {"a"}) == {"a"}


def _stored(events):
    return [(list(e.block_hashes), e.parent_block_hash) for e in events if type(e).__name__ == "BlockStored"]


def _scheduler(backend):
    return StoreScheduler(backend=backend, namespace="ns", rank_tags=TAGS, block_size=BS,
                          config=StoreConnectorConfig(), load_enabled=True, save_enabled=True)


def test_block_stored_only_once_every_rank_tag_stored_it():
    backend = EmbeddedBackend(16 << 20)
    sched = _scheduler(backend)
    w0, w1 = _worker(backend, "t0"), _worker(backend, "t1")
    req = FakeRequest("a", list(range(2 * BS + 1)))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3]), 0)
    plan = sched.build_plan(new_req_output(req, [1, 2, 3], 0, 2 * BS + 1))
    (save,) = plan.saves
    h0, h1 = save.block_hashes

    # Step 1: rank 0 stored both blocks, rank 1 nothing yet (its report is None): no event.
    _save(w0, [h0, h1], [1, 2])
    sched.on_worker_report(_aggregate(w0.take_report(), w1.take_report()))
    assert _stored(sched.take_events()) == []
    # Step 2: rank 1 stored block 1 only (block 0's save still in flight): still nothing, since
    # block 1 without its parent would be parentless.
    _save(w1, [h1], [2])
    sched.on_worker_report(_aggregate(w0.take_report(), w1.take_report()))
    assert _stored(sched.take_events()) == []
    # Step 3: rank 1 stored block 0: both blocks, once, parent first.
    _save(w1, [h0], [1])
    sched.on_worker_report(_aggregate(w0.take_report(), w1.take_report()))
    assert _stored(sched.take_events()) == [([h0, h1], None)]
    # Nothing is emitted twice, and nothing is left tracked.
    sched.on_worker_report(_aggregate(w0.take_report(), w1.take_report()))
    assert _stored(sched.take_events()) == []
    assert sched.leak_report()["held_requests"] >= 0 and not sched._stored_tags


def test_tracking_is_bounded(monkeypatch):
    monkeypatch.setattr(scheduler_mod, "MAX_TRACKED_BLOCKS", 8)
    sched = _scheduler(EmbeddedBackend(1 << 20))
    from kv_store.metadata import StoreReport

    for i in range(100):  # only rank t0 ever reports: nothing completes
        sched.on_worker_report(StoreReport(stored_by_tag={"t0": [bytes([i]) * 32]}))
    assert len(sched._stored_tags) <= 8
    assert _stored(sched.take_events()) == []
