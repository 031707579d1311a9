"""Self-healing: a stored value that fails its checksum is removed, and the range is saved again
from the KV vLLM recomputes (before, it stayed in the store and ``saved_upto`` had moved past it:
every later request with that prefix loaded it, failed and recomputed, for ever)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from kv_common.embedded_backend import EmbeddedBackend  # noqa: E402
from kv_store import keys  # noqa: E402
from test_store_scheduler_worker import (  # noqa: E402,E501
    BS,
    FakeBlocks,
    FakeRequest,
    drain,
    make_scheduler,
    make_worker,
    new_req_output,
)


def _cached_step(req_id, computed, scheduled):
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[req_id], resumed_req_ids=set(), new_block_ids=[None],
                                              num_computed_tokens=[computed]),
        num_scheduled_tokens={req_id: scheduled},
        preempted_req_ids=set(),
    )


def test_corrupt_value_is_removed_and_saved_again():
    backend = EmbeddedBackend(16 << 20)
    sched = make_scheduler(backend)
    worker, caches = make_worker(backend)
    tokens = list(range(4 * BS + 2))
    a = FakeRequest("a", tokens)
    sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, FakeBlocks([1, 2, 3, 4, 5]), 0)
    worker.submit_saves(sched.build_plan(new_req_output(a, [1, 2, 3, 4, 5], 0, len(tokens))))
    sched.request_finished(a, [1, 2, 3, 4, 5])
    assert drain(worker, {"a"}) == {"a"}
    sched.on_finished_sending({"a"})
    sched.on_worker_report(worker.take_report())

    bad = keys.block_key("ns", "r0", a.block_hashes[1])
    value = bytearray(backend._memory[bad])
    value[10] ^= 0xFF
    backend._memory[bad] = bytes(value)  # block 1 rots in the store

    b = FakeRequest("b", tokens)
    assert sched.get_num_new_matched_tokens(b, 0) == (4 * BS, False)
    sched.update_state_after_alloc(b, FakeBlocks([9, 10, 11, 12, 13]), 4 * BS)
    plan = sched.build_plan(new_req_output(b, [9, 10, 11, 12, 13], 4 * BS, 2))
    worker.load_sync(plan)
    assert worker.ledger.take_block_ids_with_load_errors() == {10, 11, 12}
    sched.on_worker_report(worker.take_report())
    assert backend.batch_exists([bad]) == [False]  # the bad value is gone

    # vLLM recomputes from block 1 (num_computed_tokens truncated to 1 block): the range is saved again.
    plan = sched.build_plan(_cached_step("b", BS, 3 * BS + 2))
    assert [list(s.block_hashes) for s in plan.saves] == [list(b.block_hashes[1:4])]
    worker.submit_saves(plan)
    sched.request_finished(b, [9, 10, 11, 12, 13])
    assert drain(worker, {"b"}) == {"b"}
    assert backend.batch_exists([bad]) == [True]


def test_prefix_served_from_vllm_local_cache_is_published_again():
    """After the backend lost data (master restart, eviction), a prefix vLLM still serves from its
    own prefix cache must reach the store again: the save covers the local hit too (the worker's
    exists check skips what the store still has)."""
    backend = EmbeddedBackend(16 << 20)
    sched = make_scheduler(backend)
    worker, _ = make_worker(backend)
    tokens = list(range(4 * BS + 2))
    req = FakeRequest("c", tokens)
    # vLLM's local prefix cache has the first 2 blocks; the store has nothing (it lost them).
    assert sched.get_num_new_matched_tokens(req, 2 * BS) == (0, False)
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 0)
    plan = sched.build_plan(new_req_output(req, [1, 2, 3, 4, 5], 2 * BS, 2 * BS + 2))
    assert [list(s.block_hashes) for s in plan.saves] == [list(req.block_hashes[:4])]
    worker.submit_saves(plan)
    sched.request_finished(req, [1, 2, 3, 4, 5])
    assert drain(worker, {"c"}) == {"c"}
    assert backend.batch_exists(keys.block_keys("ns", "r0", req.block_hashes[:4])) == [True] * 4
