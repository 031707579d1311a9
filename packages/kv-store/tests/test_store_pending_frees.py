"""vLLM asks ``has_pending_block_frees`` before it preempts a request for lack of blocks: while
finished requests' blocks are held for saves in flight, the answer must be yes, so vLLM waits for
those blocks instead of preempting (and recomputing) a running request."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kv_common.embedded_backend import EmbeddedBackend  # noqa: E402
from test_store_scheduler_worker import FakeBlocks, FakeRequest, make_scheduler, new_req_output  # noqa: E402


def test_pending_block_frees_while_saves_hold_blocks():
    sched = make_scheduler(EmbeddedBackend(16 << 20))
    assert sched.has_pending_block_frees() is False
    req = FakeRequest("a", list(range(18)))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 0)
    sched.build_plan(new_req_output(req, [1, 2, 3, 4, 5], 0, 18))
    assert sched.has_pending_block_frees() is False  # running: its blocks are not freeable anyway
    assert sched.request_finished(req, [1, 2, 3, 4, 5]) == (True, None)  # held for its saves
    assert sched.has_pending_block_frees() is True
    sched.on_finished_sending({"a"})
    assert sched.has_pending_block_frees() is False


def test_connector_answers_vllm_hook():
    pytest.importorskip("vllm")
    from kv_store.connector_base import StoreConnectorBase

    # The hook must be ours, not KVConnectorBase_V1's "always False".
    assert "has_pending_block_frees" in StoreConnectorBase.__dict__


def test_a_save_given_up_during_preemption_still_frees_the_request_when_it_finishes():
    """Issue 23 §5. vLLM preempts a request whose save hangs: ``wait_for_request_saves`` gives the
    save up at its deadline. The backend recovers, the request resumes, computes no new full block
    and finishes: the scheduler holds its blocks for that save, so the workers must report it in
    ``finished_sending``, or its blocks leak and ``has_pending_block_frees`` stays true (vLLM then
    never preempts again)."""
    from test_store_scheduler_worker import make_worker
    from test_store_stall import BlockingBackend, timed, wait_until

    backend = BlockingBackend(16 << 20)
    try:
        sched = make_scheduler(backend)
        worker, _ = make_worker(backend, save_timeout_s=0.3)
        req = FakeRequest("a", list(range(18)))  # 4 full blocks + 2 tokens
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 0)
        backend.hold("put")
        worker.submit_saves(sched.build_plan(new_req_output(req, [1, 2, 3, 4, 5], 0, 18)))
        wait_until(lambda: backend.entered["put"] >= 1)  # the save hangs in the backend
        preempt = new_req_output(req, [], 0, 0)
        preempt.scheduled_new_reqs, preempt.num_scheduled_tokens = [], {}
        preempt.preempted_req_ids = {"a"}
        plan = sched.build_plan(preempt)
        assert plan.preempted == ["a"]
        timed(lambda: worker.wait_for_request_saves(plan.preempted), 15.0)  # given up at its deadline
        # The backend recovers; steps go by (vLLM asks for finished requests every step).
        backend.release("put")
        worker.saver._executor.submit(lambda: None).result(10)  # the hung put has returned
        for _ in range(3):
            assert worker.get_finished(set()) == set()
        # Resumed, no new full block, finished: held for the save vLLM was told about.
        assert sched.request_finished(req, [6, 7, 8, 9, 10]) == (True, None)
        assert sched.has_pending_block_frees() is True
        finished_sending = worker.get_finished({"a"})
        assert finished_sending == {"a"}, "the given-up save's request is never reported: its blocks leak"
        sched.on_finished_sending(finished_sending)
        assert sched.has_pending_block_frees() is False
        assert sched.leak_report() == {"pending_saves": 0, "pending_loads": 0, "held_requests": 0}
        assert worker.leak_report()["held_requests"] == 0
        assert worker.get_finished(set()) == set()  # reported once
        worker.close(1)
    finally:
        backend.release_all()
