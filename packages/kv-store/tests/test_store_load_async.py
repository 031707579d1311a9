"""load_mode "async" (issue 15 §2): a store load never blocks the forward.

The scheduler answers ``load_kv_async=True``; the worker starts the gets on its loader thread and
returns at once; the request is reported in ``finished_recving`` (``take_finished_loads``) exactly
once, when its blocks are in place, failed (only the bad block and those after it are load errors),
past ``load_timeout_s`` (given up: nothing of the late get lands in the KV cache), or aborted.
The backend is the real embedded store behind a gate (``BlockingBackend``).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest

torch = pytest.importorskip("torch")

from kv_store.config import StoreConnectorConfig
from kv_store.keys import block_keys
from kv_store.metadata import StorePlan
from kv_store.worker import StoreWorker
from test_store_scheduler_worker import BS, FakeBlocks, FakeRequest, make_scheduler
from test_store_stall import HASHES, BlockingBackend, make_worker, saved_worker, timed, transfer, wait_until


@pytest.fixture
def backend():
    b = BlockingBackend(16 << 20)
    yield b
    b.release_all()


def poll_finished(worker: StoreWorker, limit_s: float = 5.0, aborted: frozenset[str] = frozenset()) -> set[str]:
    """Call take_finished_loads once per 'engine step' until something is reported."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done = worker.take_finished_loads(set(aborted))
        if done:
            return done
        time.sleep(0.01)
    raise AssertionError(f"nothing reported within {limit_s}s")


def test_scheduler_answers_load_async_for_a_hit_only(backend):
    sched = make_scheduler(backend, load_mode="async")
    hit = FakeRequest("hit", list(range(3 * BS + 1)))
    backend.batch_put(block_keys("ns", "r0", hit.block_hashes), [b"x"] * 3)
    assert sched.get_num_new_matched_tokens(hit, 0) == (3 * BS, True)
    miss = FakeRequest("miss", list(range(100, 100 + 3 * BS + 1)))
    assert sched.get_num_new_matched_tokens(miss, 0) == (0, False)  # vLLM: async only with tokens
    assert make_scheduler(backend).get_num_new_matched_tokens(hit, 0) == (3 * BS, False)  # sync default
    for r in (hit, miss):
        sched.update_state_after_alloc(r, FakeBlocks([]), 0)
    sched.close()


def test_async_load_returns_at_once_and_reports_once_when_in_place(backend):
    worker, caches = saved_worker(backend, load_mode="async")
    backend.hold("get")
    took = timed(lambda: worker.start_async(StorePlan(loads=[transfer("x", HASHES, [9, 10, 11, 12])])), 5.0)
    assert took < 2, f"start_async waited {took:.2f}s for a held get: the forward would wait"
    assert worker.take_finished_loads(set()) == set()  # still loading: not reported
    assert worker.leak_report()["pending_loads"] == 1
    backend.release("get")
    assert poll_finished(worker) == {"x"}
    assert worker.take_finished_loads(set()) == set()  # exactly once
    for c in caches.values():
        assert torch.equal(c[9:13], c[1:5])
    assert worker.ledger.take_block_ids_with_load_errors() == set()
    assert worker.leak_report()["pending_loads"] == 0
    assert worker.stats.reduce()["blocks_loaded"] == 4
    worker.close(1)


def test_async_load_larger_than_staging_goes_in_rounds(backend):
    worker, caches = make_worker(backend, num_blocks=24, load_mode="async")
    small = StoreWorker(backend=backend, namespace="ns", rank_tag="r0",
                        config=StoreConnectorConfig(staging_bytes=2 * worker.value_size, load_mode="async"))
    small.register_kv_caches(caches)
    hashes = [bytes([i]) * 32 for i in range(20, 27)]
    worker.submit_saves(StorePlan(saves=[transfer("w", hashes, list(range(1, 8)))]))
    worker.wait_for_request_saves(["w"])
    small.start_async(StorePlan(loads=[transfer("x", hashes, list(range(11, 18)))]))
    assert poll_finished(small) == {"x"}
    for c in caches.values():
        assert torch.equal(c[11:18], c[1:8])
    assert small.ledger.take_block_ids_with_load_errors() == set()
    worker.close(1)
    small.close(1)


def test_async_load_missing_block_fails_only_it_and_later_ones(backend):
    worker, caches = saved_worker(backend, load_mode="async")
    backend.batch_remove(worker.keys(HASHES[2:3]))  # the third of four blocks is gone
    worker.start_async(StorePlan(loads=[transfer("x", HASHES, [9, 10, 11, 12])]))
    assert poll_finished(worker) == {"x"}
    assert worker.ledger.take_block_ids_with_load_errors() == {11, 12}  # vLLM recomputes only these
    for c in caches.values():
        assert torch.equal(c[9:11], c[1:3])
    worker.close(1)


def test_async_load_past_its_deadline_is_given_up_and_never_lands_late(backend):
    worker, caches = saved_worker(backend, load_mode="async", load_timeout_s=0.3)
    before = {name: c[9:15].clone() for name, c in caches.items()}
    backend.hold("get")
    entered = backend.entered["get"]
    t0 = time.monotonic()
    worker.start_async(StorePlan(loads=[transfer("x", HASHES, [9, 10, 11, 12])]))
    # The loader must be in the hung get when the load is given up: one given up while still
    # queued ends at once and would not hold the loader.
    wait_until(lambda: backend.entered["get"] > entered)
    assert poll_finished(worker) == {"x"}
    assert 0.25 <= time.monotonic() - t0 < 10  # the deadline, not the 30 s hang
    assert worker.ledger.take_block_ids_with_load_errors() == {9, 10, 11, 12}
    # The get still hangs: the next load fails at once (next step) instead of queueing behind it.
    worker.start_async(StorePlan(loads=[transfer("y", HASHES[:2], [13, 14])]))
    assert worker.take_finished_loads(set()) == {"y"}
    assert worker.ledger.take_block_ids_with_load_errors() == {13, 14}
    counters = worker.stats.reduce()
    assert counters["load_timeouts"] == 1 and counters["loads_skipped_backend_stalled"] == 1, counters
    backend.release("get")  # the late get returns: nothing of it reaches the KV cache or the ledger
    late = worker.loader._async_late
    assert late is not None
    late.exception(10)  # the late get is over (TimeoutError if it still hangs)
    for name, c in caches.items():
        assert torch.equal(c[9:15], before[name]), f"{name}: a given-up load wrote into the KV cache"
    assert worker.ledger.take_block_ids_with_load_errors() == set()
    # The backend answers again: async loads work again (a generous deadline: this load proves
    # the backend answers, not its speed on a loaded machine).
    worker.loader.config = msgspec.structs.replace(worker.config, load_timeout_s=10.0)
    worker.start_async(StorePlan(loads=[transfer("z", HASHES, [9, 10, 11, 12])]))
    assert poll_finished(worker) == {"z"}
    for c in caches.values():
        assert torch.equal(c[9:13], c[1:5])
    worker.close(1)


def test_request_aborted_while_loading_is_reported_at_once_and_its_blocks_untouched(backend):
    worker, caches = saved_worker(backend, load_mode="async")
    before = {name: c[9:13].clone() for name, c in caches.items()}
    backend.hold("get")
    worker.start_async(StorePlan(loads=[transfer("x", HASHES, [9, 10, 11, 12])]))
    # vLLM frees an aborted WAITING_FOR_REMOTE_KVS request's blocks only once it is reported here.
    assert worker.take_finished_loads({"x"}) == {"x"}
    assert worker.take_finished_loads({"x"}) == set()
    assert worker.ledger.take_block_ids_with_load_errors() == set()  # nobody recomputes it
    backend.release("get")
    worker.loader._executor.submit(lambda: None).result(5)  # the loader has passed the aborted load
    for name, c in caches.items():
        assert torch.equal(c[9:13], before[name]), f"{name}: an aborted load wrote into freed blocks"
    assert worker.leak_report()["pending_loads"] == 0
    worker.close(1)


def test_every_rank_reports_its_own_load(backend):
    """TP > 1: each rank's worker loads its own keys and reports the request once (vLLM waits
    for every rank before it schedules the request)."""
    workers = []
    for rank in ("r0", "r1"):
        w = StoreWorker(backend=backend, namespace="ns", rank_tag=rank,
                        config=StoreConnectorConfig(staging_bytes=1 << 16, load_mode="async"))
        caches = {f"layer{i}": torch.randn(16, 2, BS, 8) for i in range(2)}
        w.register_kv_caches(caches)
        w.submit_saves(StorePlan(saves=[transfer("w", HASHES, [1, 2, 3, 4])]))
        w.wait_for_request_saves(["w"])
        workers.append((w, caches))
    plan = StorePlan(loads=[transfer("x", HASHES, [9, 10, 11, 12])])
    for w, _ in workers:
        w.start_async(plan)
    for w, caches in workers:
        assert poll_finished(w) == {"x"}
        assert torch.equal(caches["layer0"][9:13], caches["layer0"][1:5])
        w.close(1)


def test_a_request_whose_async_load_ran_is_not_offered_another(backend):
    """vLLM frees a request whose async load failed with no valid block and looks it up again: a
    hit that keeps failing (a get past its deadline while exists still answers) must not be
    offered again, or the request loops for ever (seen in the engine test before this rule)."""
    sched = make_scheduler(backend, load_mode="async")
    req = FakeRequest("r", list(range(3 * BS + 1)))
    backend.batch_put(block_keys("ns", "r0", req.block_hashes), [b"x"] * 3)
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4]), 3 * BS)
    assert len(sched.build_plan(SimpleNamespace(
        scheduled_new_reqs=[], num_scheduled_tokens={}, preempted_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                              num_computed_tokens=[]))).loads) == 1
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again: recompute
    sched.request_finished(req, [])
    assert sched.leak_report() == {"pending_saves": 0, "pending_loads": 0, "held_requests": 0}
    sched.close()
