"""Scheduler side with fake requests, worker side with real CPU tensors and EmbeddedBackend."""

from __future__ import annotations

import hashlib
import importlib.util
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")  # the worker side moves torch tensors

from kv_common.backend import Backend
from kv_common.embedded_backend import EmbeddedBackend
from kv_store import codec
from kv_store.config import StoreConnectorConfig
from kv_store.metadata import BlockTransfer, StorePlan
from kv_store.scheduler import StoreScheduler
from kv_store.worker import StoreWorker

BS = 4


def chain(tokens, bs=BS):
    out, parent = [], b""
    for i in range(len(tokens) // bs):
        parent = hashlib.sha256(parent + repr(tokens[i * bs : (i + 1) * bs]).encode()).digest()
        out.append(parent)
    return out


@dataclass
class FakeRequest:
    request_id: str
    tokens: list[int]
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self):
        self.block_hashes = chain(self.tokens)

    @property
    def num_tokens(self):
        return len(self.tokens)


class FakeBlocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (list(self.ids),)


def new_req_output(req, block_ids, computed, scheduled):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(block_ids,), num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req.request_id: scheduled},
        preempted_req_ids=set(),
    )


def make_scheduler(backend, **cfg):
    # A hit must not turn into a miss because the lookup thread was descheduled on a loaded
    # machine: tests that time lookups out pass lookup_timeout_s themselves.
    cfg.setdefault("lookup_timeout_s", 10.0)
    return StoreScheduler(
        backend=backend, namespace="ns", rank_tags=["r0"], block_size=BS,
        config=StoreConnectorConfig(**cfg), load_enabled=True, save_enabled=True,
    )


def make_worker(backend, num_blocks=16, layers=2, **cfg):
    torch.manual_seed(0)
    caches = {f"layer{i}": torch.randn(num_blocks, 2, BS, 8) for i in range(layers)}
    w = StoreWorker(backend=backend, namespace="ns", rank_tag="r0", config=StoreConnectorConfig(staging_bytes=1 << 16, **cfg))
    w.register_kv_caches(caches)
    return w, caches


def drain(worker, req_ids):
    deadline = time.monotonic() + 10
    done = set()
    while done != set(req_ids) and time.monotonic() < deadline:
        done |= worker.get_finished(set(req_ids))
        time.sleep(0.01)
    return done


def test_save_then_lookup_then_load_roundtrip():
    backend = EmbeddedBackend(16 << 20)
    sched = make_scheduler(backend)
    worker, caches = make_worker(backend)
    req = FakeRequest("a", list(range(18)))  # 4 full blocks + 2 tokens
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 0)
    plan = sched.build_plan(new_req_output(req, [1, 2, 3, 4, 5], 0, 18))
    assert [len(s.block_hashes) for s in plan.saves] == [4]
    worker.submit_saves(plan)
    assert sched.request_finished(req, [1, 2, 3, 4, 5]) == (True, None)
    assert drain(worker, {"a"}) == {"a"}
    sched.on_finished_sending({"a"})
    assert sched.leak_report() == {"pending_saves": 0, "pending_loads": 0, "held_requests": 0}
    assert worker.leak_report()["held_requests"] == 0
    report = worker.take_report()
    sched.on_worker_report(report)
    assert len(report.stored_by_tag["r0"]) == 4  # under its rank tag
    if importlib.util.find_spec("vllm") is not None:  # KV events are vLLM types
        assert sched.take_events()  # BlockStored

    # Same prompt again: all 4 blocks present, prompt 18 tokens -> 16 tokens from the store.
    req2 = FakeRequest("b", list(range(18)))
    assert sched.get_num_new_matched_tokens(req2, 0) == (16, False)
    sched.update_state_after_alloc(req2, FakeBlocks([9, 10, 11, 12, 13]), 16)
    plan2 = sched.build_plan(new_req_output(req2, [9, 10, 11, 12, 13], 16, 2))
    assert len(plan2.loads) == 1 and not plan2.saves
    worker.load_sync(plan2)
    for cache in caches.values():
        assert torch.equal(cache[9:13], cache[1:5])
    assert worker.ledger.take_block_ids_with_load_errors() == set()
    # Metadata survives pickling (vLLM sends it to the worker process).
    import pickle

    pytest.importorskip("vllm")
    from kv_store.vllm_metadata import StoreConnectorMetadata

    meta = pickle.loads(pickle.dumps(StoreConnectorMetadata(plan2)))
    assert meta.plan.loads[0].block_ids == [[9, 10, 11, 12]]


def test_full_hit_leaves_last_block_and_local_hit_is_subtracted():
    backend = EmbeddedBackend(16 << 20)
    sched = make_scheduler(backend)
    req = FakeRequest("a", list(range(16)))
    keys = [f"kv/ns/r0/{h.hex()}" for h in req.block_hashes]
    backend.batch_put(keys, [b"x"] * 4)
    assert sched.get_num_new_matched_tokens(req, 0) == (12, False)
    assert sched.get_num_new_matched_tokens(req, 4) == (8, False)


def test_miss_after_positive_lookup_and_corruption_become_load_errors():
    backend = EmbeddedBackend(16 << 20)
    worker, caches = make_worker(backend)
    hashes = chain(list(range(12)))
    save = StorePlan(saves=[BlockTransfer(request_id="a", block_hashes=hashes, block_ids=[[1, 2, 3]])])
    worker.submit_saves(save)
    drain(worker, {"a"})
    keys = [f"kv/ns/r0/{h.hex()}" for h in hashes]
    # corrupt block 1: flip a payload byte and store it back under its key
    raw = bytearray(worker.value_size)
    assert backend.batch_get_into([keys[1]], [memoryview(raw)]) == [worker.value_size]
    raw[5] ^= 0xFF
    backend.batch_remove([keys[1]])
    backend.batch_put([keys[1]], [bytes(raw)])
    load = StorePlan(loads=[BlockTransfer(request_id="b", block_hashes=hashes, block_ids=[[7, 8, 9]])])
    worker.load_sync(load)
    assert worker.ledger.take_block_ids_with_load_errors() == {8, 9}
    assert torch.equal(caches["layer0"][7], caches["layer0"][1])
    # evicted in between lookup and load
    backend.batch_remove([keys[0]])
    worker.load_sync(load)
    assert worker.ledger.take_block_ids_with_load_errors() == {7, 8, 9}
    assert worker.stats.failures.get("miss") == 1 and worker.stats.failures.get("corrupt") == 1


def test_truncated_value_is_detected():
    payload = 100
    value = bytearray(payload + codec.TRAILER_SIZE)
    codec.write_trailer(memoryview(value), payload, True)
    assert codec.check_value(memoryview(value), payload, len(value)) is None
    assert codec.check_value(memoryview(value), payload, len(value) - 1) is not None


class SlowBackend(Backend):
    """Answers every lookup "present" after ``delay_s`` (or at once after ``release()``)."""

    def __init__(self, delay_s: float = 0.5) -> None:
        self.delay_s = delay_s
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def batch_exists(self, keys):
        self._released.wait(self.delay_s)
        return [True] * len(keys)

    def batch_put(self, keys, values):
        return [True] * len(keys)

    def batch_get_into(self, keys, buffers):
        return [-1] * len(keys)


def test_lookup_deadline_sync_counts_as_miss_and_async_asks_again():
    # The backend takes 5 s: a sync lookup back well before that was cut short by its deadline.
    slow = SlowBackend(delay_s=5.0)
    sched = make_scheduler(slow, lookup_timeout_s=0.05)
    req = FakeRequest("a", list(range(18)))
    t0 = time.monotonic()
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert time.monotonic() - t0 < 2
    slow.release()  # do not keep the lookup thread (and interpreter exit) waiting
    sched.close()
    sched2 = make_scheduler(SlowBackend(), lookup_mode="async", lookup_timeout_s=30)
    req2 = FakeRequest("b", list(range(18)))
    assert sched2.get_num_new_matched_tokens(req2, 0) == (None, False)
    # "ask again" until the lookup thread has answered (0.5 s, longer on a loaded machine)
    deadline = time.monotonic() + 10
    answer = sched2.get_num_new_matched_tokens(req2, 0)
    while answer == (None, False) and time.monotonic() < deadline:
        time.sleep(0.01)
        answer = sched2.get_num_new_matched_tokens(req2, 0)
    assert answer == (16, False)
    sched2.close()


class BrokenBackend(SlowBackend):
    def batch_exists(self, keys):
        raise ConnectionError("master gone")


def test_broken_backend_lookup_is_a_miss():
    sched = make_scheduler(BrokenBackend())
    assert sched.get_num_new_matched_tokens(FakeRequest("a", list(range(18))), 0) == (0, False)


def test_replica_rank_does_not_write_but_still_loads_and_finishes():
    """Two ranks holding the same bytes (MLA / replicated heads): only the writer saves; the
    replica reports the request finished at once and loads the writer's copy."""
    backend = EmbeddedBackend(16 << 20)
    sched = make_scheduler(backend)
    writer, caches = make_worker(backend)
    replica, replica_caches = make_worker(backend)
    replica.saver.writes_blocks = False
    req = FakeRequest("a", list(range(18)))
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 0)
    plan = sched.build_plan(new_req_output(req, [1, 2, 3, 4, 5], 0, 18))
    replica.submit_saves(plan)
    assert drain(replica, {"a"}) == {"a"}
    assert backend.batch_exists([f"kv/ns/r0/{h.hex()}" for h in plan.saves[0].block_hashes]) == [False] * 4
    writer.submit_saves(plan)
    assert drain(writer, {"a"}) == {"a"}
    req2 = FakeRequest("b", list(range(18)))
    assert sched.get_num_new_matched_tokens(req2, 0) == (16, False)
    sched.update_state_after_alloc(req2, FakeBlocks([9, 10, 11, 12, 13]), 16)
    plan2 = sched.build_plan(new_req_output(req2, [9, 10, 11, 12, 13], 16, 2))
    for cache in replica_caches.values():
        cache[9:13].zero_()
    replica.load_sync(plan2)
    for name, cache in replica_caches.items():
        assert torch.equal(cache[9:13], caches[name][1:5])
    assert replica.ledger.take_block_ids_with_load_errors() == set()
    writer.close(5)
    replica.close(5)


def test_a_failed_load_is_forgotten_once_its_request_finishes():
    """Issue 23 §8: the failure ledger kept every failed request's id for ever."""
    worker, _ = make_worker(EmbeddedBackend(16 << 20))
    missing = BlockTransfer(request_id="l", block_hashes=[bytes([7]) * 32], block_ids=[[3]])
    worker.load_sync(StorePlan(loads=[missing]))
    assert worker.ledger.take_block_ids_with_load_errors() == {3}  # vLLM recomputes it
    assert len(worker.ledger) == 1
    worker.get_finished({"l"})
    assert len(worker.ledger) == 0, "a finished request's failed load is kept for ever"
    worker.close(1)
