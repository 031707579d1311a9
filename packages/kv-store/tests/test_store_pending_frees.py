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
