"""Start-up warning for per-process hash seeds; BlockStored events carry parents and token ids."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")  # the start-up check and KV events are vLLM types

from kv_store.config import StoreConnectorConfig
from kv_store.connector_base import hash_seed_warning
from kv_store.metadata import StoreReport
from kv_store.scheduler import StoreScheduler

BS = 4


def test_hash_seed_warning_only_for_random_per_process_seeds():
    assert "PYTHONHASHSEED" in hash_seed_warning("xxhash", environ={})
    assert hash_seed_warning("xxhash_cbor", environ={}) is not None
    assert hash_seed_warning("xxhash", environ={"PYTHONHASHSEED": "0"}) is None
    assert hash_seed_warning("sha256", environ={}) is None
    assert hash_seed_warning("sha256_cbor", environ={}) is None


class Req:
    def __init__(self, rid, tokens):
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.num_tokens = len(tokens)
        out, parent = [], b""
        for i in range(len(tokens) // BS):
            parent = hashlib.sha256(parent + repr(tokens[i * BS : (i + 1) * BS]).encode()).digest()
            out.append(parent)
        self.block_hashes = out


def test_block_stored_events_have_parent_and_tokens():
    pytest.importorskip("vllm")
    from kv_common.embedded_backend import EmbeddedBackend

    sched = StoreScheduler(backend=EmbeddedBackend(1 << 20), namespace="ns", rank_tags=["r0"], block_size=BS,
                           config=StoreConnectorConfig(), load_enabled=True, save_enabled=True)
    req = Req("a", list(range(100, 114)))  # 3 full blocks + 2 tokens
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), 0)
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a", block_ids=([1, 2, 3, 4],), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                              num_computed_tokens=[]),
        num_scheduled_tokens={"a": 14}, preempted_req_ids=set(),
    )
    plan = sched.build_plan(out)
    assert len(plan.saves[0].block_hashes) == 3
    h = req.block_hashes
    # blocks 0 and 2 stored (1 failed): two runs
    sched.on_worker_report(StoreReport(stored=[h[0], h[2]]))
    events = sched.take_events()
    assert [e.block_hashes for e in events] == [[h[0]], [h[2]]]
    assert events[0].parent_block_hash is None and events[0].token_ids == [100, 101, 102, 103]
    assert events[1].parent_block_hash == h[1] and events[1].token_ids == [108, 109, 110, 111]
    # vLLM's own medium values (vllm.distributed.kv_events.MEDIUM_*): a router reading the events
    # tells a host-memory copy from a GPU one; the embedded store holds values in host memory.
    from vllm.distributed.kv_events import MEDIUM_CPU

    assert {e.medium for e in events} == {MEDIUM_CPU}
    sched.on_worker_report(StoreReport(removed=[h[0]]))
    assert [e.medium for e in sched.take_events()] == [MEDIUM_CPU]


def test_each_backend_names_its_tier_in_vllms_medium_values():
    pytest.importorskip("vllm")
    from kv_common.embedded_backend import EmbeddedBackend
    from kv_store.mooncake_backend import MooncakeBackend
    from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE

    assert EmbeddedBackend.kv_event_medium == MEDIUM_CPU  # host memory (its spill files are a cold copy)
    assert MooncakeBackend.kv_event_medium == MEDIUM_CPU  # the pool's DRAM segments
    assert {EmbeddedBackend.kv_event_medium, MooncakeBackend.kv_event_medium} <= {MEDIUM_GPU, MEDIUM_CPU,
                                                                                  MEDIUM_STORAGE}


def test_chained_blocks_make_one_event():
    pytest.importorskip("vllm")
    from kv_common.embedded_backend import EmbeddedBackend

    sched = StoreScheduler(backend=EmbeddedBackend(1 << 20), namespace="ns", rank_tags=["r0"], block_size=BS,
                           config=StoreConnectorConfig(), load_enabled=True, save_enabled=True)
    req = Req("a", list(range(8)))
    state = SimpleNamespace(request=req)
    sched._track_tokens(state.request, 0, 2)
    sched.on_worker_report(StoreReport(stored=list(req.block_hashes)))
    (event,) = sched.take_events()
    assert event.block_hashes == req.block_hashes and event.token_ids == list(range(8))
    assert not sched._block_tokens
