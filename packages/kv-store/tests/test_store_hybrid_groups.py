"""Several KV-cache groups (vLLM's hybrid manager): block ranges against vLLM's own allocator and a
token-level oracle, state groups refused at start-up, and a save/lookup/load round trip with real
tensors whose sliding-window group holds the null block."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kv_common.embedded_backend import EmbeddedBackend
from kv_common.failure_ledger import FailureLedger
from kv_common.kv_cache_groups import FULL, SLIDING_WINDOW, KVGroup, UnsupportedKVGroup
from kv_store import group_blocks
from kv_store.config import StoreConnectorConfig
from kv_store.group_worker import GroupedStoreWorker
from kv_store.scheduler import StoreScheduler
from kv_store.worker import StoreWorker
from test_store_scheduler_worker import FakeRequest

BS = 4


def full_group(index: int = 0) -> KVGroup:
    return KVGroup(index=index, kind=FULL, spec_name="FullAttentionSpec", block_size=BS, layer_names=(f"l{index}",))


def window_group(window: int, index: int = 1) -> KVGroup:
    return KVGroup(index=index, kind=SLIDING_WINDOW, spec_name="SlidingWindowSpec", block_size=BS,
                   layer_names=(f"l{index}",), sliding_window=window)


# ---- the oracle: which blocks a token at position n attends to, block by block -------------------
def needed_by_tokens(kind: str, window: int, n_tokens: int) -> set[int]:
    """Blocks holding a token the next token (position ``n_tokens``) attends to: all earlier tokens
    under full attention, the ``window - 1`` before it under a sliding window (vLLM's window
    includes the token itself)."""
    first_token = 0 if kind == FULL else max(0, n_tokens - window + 1)
    return {t // BS for t in range(first_token, n_tokens)}


@settings(max_examples=300, deadline=None)
@given(window=st.integers(1, 20), first=st.integers(0, 6), extra=st.integers(1, 6), data=st.data())
def test_hit_blocks_against_token_oracle(window, first, extra, data):
    groups = [full_group(), window_group(window)]
    end = first + extra
    present = [[data.draw(st.booleans()) for _ in range(first, end)] for _ in groups]

    def loadable(m: int) -> bool:
        for g, group in enumerate(groups):
            need = needed_by_tokens(group.kind, window, m * BS)
            if not all(present[g][k - first] for k in need if k >= first):
                return False
        return True

    want = max((m - first for m in range(first + 1, end + 1) if loadable(m)), default=0)
    assert group_blocks.hit_blocks(groups, present, first, end, BS) == want
    for group in groups:
        lo, hi = group_blocks.hit_range(group, first, end, BS)
        assert set(range(lo, hi)) == {k for k in needed_by_tokens(group.kind, window, end * BS) if k >= first}


# ---- against vLLM's own allocator --------------------------------------------------------------
def iface():
    """vLLM's spec classes (the tests that need vLLM skip without it)."""
    return pytest.importorskip("vllm.v1.kv_cache_interface")


def vllm_manager(window: int):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    spec = dict(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = iface().KVCacheConfig(num_blocks=128, kv_cache_tensors=[], kv_cache_groups=[
        iface().KVCacheGroupSpec(["l0"], iface().FullAttentionSpec(**spec)),
        iface().KVCacheGroupSpec(["l1"], iface().SlidingWindowSpec(**spec, sliding_window=window)),
    ])
    return KVCacheManager(cfg, max_model_len=512, scheduler_block_size=BS, hash_block_size=BS, enable_caching=True)


def vllm_request(req_id: str, tokens: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(BS, sha256))


@pytest.mark.parametrize("window", [1, 3, 4, 6, 9, 64])
@pytest.mark.parametrize(("local_blocks", "external_blocks"), [(0, 1), (0, 5), (2, 3), (3, 1), (1, 6)])
def test_hit_range_is_what_vllm_allocates_for_external_tokens(window, local_blocks, external_blocks):
    """The blocks a load writes are exactly the non-null blocks vLLM allocated for the external
    tokens, in every group, after a local prefix-cache hit of ``local_blocks``."""
    manager = vllm_manager(window)
    n = (local_blocks + external_blocks) * BS + 3
    tokens = list(range(100, 100 + n))
    if local_blocks:  # a finished request leaves the prefix in vLLM's cache
        warm = vllm_request("warm", tokens[: local_blocks * BS] + [7, 7, 7])
        manager.allocate_slots(warm, len(warm.all_token_ids))
        manager.free(warm)
    req = vllm_request("r", tokens)
    blocks, local_tokens = manager.get_computed_blocks(req)[:2]
    first = local_tokens // BS
    ext = local_blocks + external_blocks - first
    if ext <= 0:
        pytest.skip("vLLM's local hit covers the external range")
    manager.allocate_slots(req, n - (first + ext) * BS, num_new_computed_tokens=local_tokens,
                           new_computed_blocks=blocks, num_external_computed_tokens=ext * BS, delay_cache_blocks=True)
    ids = manager.get_block_ids("r")
    for group, group_ids in zip([full_group(), window_group(window)], ids, strict=True):
        lo, hi = group_blocks.hit_range(group, first, first + ext, BS)
        allocated = {k for k in range(first, first + ext) if group_ids[k] != group_blocks.NULL_BLOCK_ID}
        assert set(range(lo, hi)) == allocated, (group.kind, group_ids, first, ext)


@pytest.mark.parametrize("window", [1, 4, 6, 9])
def test_save_range_is_what_vllm_still_holds_in_the_step(window):
    """Chunked prefill: in each step the blocks a save reads are blocks vLLM holds for the request
    in that step (a freed block may be another request's by then)."""
    manager = vllm_manager(window)
    req = vllm_request("r", list(range(40)))
    computed, saved = 0, 0
    for chunk in (6, 9, 12, 13):
        manager.allocate_slots(req, chunk)
        full = (computed + chunk) // BS
        held = manager.get_block_ids("r")[1]
        lo, hi = group_blocks.save_range(window_group(window), saved, full, computed)
        assert all(held[k] != group_blocks.NULL_BLOCK_ID for k in range(lo, hi)), (held, lo, hi)
        # and no block vLLM still holds is left out, except those already saved
        assert {k for k in range(saved, full) if held[k] != group_blocks.NULL_BLOCK_ID} == set(range(lo, hi))
        computed += chunk
        req.num_computed_tokens = computed
        saved = full


# ---- start-up refusals ---------------------------------------------------------------------------
def kv_config(*specs):
    return iface().KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        iface().KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)])


def attention(block_size: int = 16, window: int | None = None):
    spec = dict(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return (iface().SlidingWindowSpec(**spec, sliding_window=window) if window
            else iface().FullAttentionSpec(**spec))


def test_state_group_refused_at_start_up():
    from kv_store.connector_base import hybrid_groups

    mamba = iface().MambaSpec(block_size=16, shapes=((2, 8), (4, 8)), dtypes=(torch.float32, torch.float32))
    with pytest.raises(UnsupportedKVGroup) as err:
        hybrid_groups(kv_config(attention(), mamba), "AscendStoreConnector", block_size=16, dcp_size=1)
    text = str(err.value)
    assert "AscendStoreConnector" in text and "group 1" in text and "state" in text and "MambaSpec" in text, text
    assert "model.layers.1.attn" in text, text


def test_group_layouts_refused_or_kept():
    from kv_store.connector_base import hybrid_groups

    assert hybrid_groups(kv_config(attention()), "C", block_size=16, dcp_size=1) == ()  # one group: as before
    assert hybrid_groups(None, "C", block_size=16, dcp_size=1) == ()
    groups = hybrid_groups(kv_config(attention(), attention(window=64)), "C", block_size=16, dcp_size=1)
    assert [g.kind for g in groups] == [FULL, SLIDING_WINDOW]
    with pytest.raises(UnsupportedKVGroup, match="block_size 32"):
        hybrid_groups(kv_config(attention(), attention(block_size=32, window=64)), "C", block_size=16, dcp_size=1)
    with pytest.raises(UnsupportedKVGroup, match="decode_context_parallel_size 2"):
        hybrid_groups(kv_config(attention(), attention(window=64)), "C", block_size=16, dcp_size=2)


# ---- a round trip: scheduler and grouped worker over real tensors and an embedded store ----------
class FakeGroupBlocks:
    """vLLM's KVCacheBlocks with one block list per group."""

    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return tuple(list(g) for g in self.ids)


def step_output(req, block_ids, computed, scheduled):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=block_ids, num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                              num_computed_tokens=[]),
        num_scheduled_tokens={req.request_id: scheduled}, preempted_req_ids=[],
    )


NUM_BLOCKS = 16
WINDOW = 6
GROUPS = (full_group(0), window_group(WINDOW, 1))


def kv_caches(seed: int | None):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return {g.layer_names[0]: (torch.rand((NUM_BLOCKS, 2, BS, 16), generator=gen) if gen is not None
                               else torch.zeros((NUM_BLOCKS, 2, BS, 16)))
            for g in GROUPS}


class Side:
    """One instance's scheduler and grouped worker over ``backend``."""

    def __init__(self, backend, caches):
        config = StoreConnectorConfig(checksum=True, load_mode="async")
        self.ledger = FailureLedger()
        self.scheduler = StoreScheduler(backend=backend, namespace="ns", rank_tags=["t"], block_size=BS,
                                        config=config, load_enabled=True, save_enabled=True, groups=GROUPS)
        self.worker = GroupedStoreWorker(GROUPS, {
            g.index: StoreWorker(backend=backend, namespace="ns", rank_tag=group_blocks.group_tag("t", g, 2),
                                 config=config, layer_groups={g.layer_names[0]: 0}, ledger=self.ledger)
            for g in GROUPS})
        self.worker.register_kv_caches(caches)

    def close(self):
        self.worker.close(5.0)
        self.scheduler.close()


def wait_loaded(side, req_id):

    deadline = time.monotonic() + 10
    while req_id not in side.worker.take_finished_loads(set()):
        assert time.monotonic() < deadline, "async load never finished"
        time.sleep(0.01)


def test_round_trip_loads_every_group_and_never_the_null_block():
    backend = EmbeddedBackend(capacity_bytes=64 << 20)
    src, dst = kv_caches(1), kv_caches(None)
    a, b = Side(backend, src), Side(backend, dst)
    try:
        tokens = list(range(23))  # 5 full blocks + 3 tokens
        req = FakeRequest("r", tokens)
        # A computes the whole prompt in one step: blocks 1..6 in both groups
        a_ids = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
        a.scheduler.update_state_after_alloc(req, FakeGroupBlocks(a_ids), 0)
        plan = a.scheduler.build_plan(step_output(req, a_ids, 0, len(tokens)))
        assert sorted((t.group, len(t.block_hashes)) for t in plan.saves) == [(0, 5), (1, 5)]
        a.worker.submit_saves(plan)
        a.worker.wait_for_request_saves(["r"])

        # B: vLLM's layout for a 20-token external hit: window 6 skips 15 tokens = 3 null blocks
        tokens_b, loadable = b.scheduler.get_num_new_matched_tokens(req, 0)
        assert (tokens_b, loadable) == (20, True)
        b_ids = ([2, 3, 4, 5, 6, 7], [0, 0, 0, 9, 10, 11])
        b.scheduler.update_state_after_alloc(req, FakeGroupBlocks(b_ids), 20)
        load = b.scheduler.build_plan(step_output(req, b_ids, 0, 3))
        assert sorted((t.group, t.block_ids[0]) for t in load.loads) == [(0, [2, 3, 4, 5, 6]), (1, [9, 10])]
        b.worker.start_async(load)
        wait_loaded(b, "r")
        full, window = (dst[g.layer_names[0]] for g in GROUPS)
        src_full, src_window = (src[g.layer_names[0]] for g in GROUPS)
        for k in range(5):
            assert torch.equal(full[b_ids[0][k]], src_full[a_ids[0][k]])
        for k in (3, 4):
            assert torch.equal(window[b_ids[1][k]], src_window[a_ids[1][k]])
        assert not window[0].any() and not full[0].any()  # the null block: never written
        assert not b.ledger.take_failed_requests()
    finally:
        a.close()
        b.close()


def test_window_blocks_missing_shorten_the_hit_and_a_bad_one_fails_the_request():
    backend = EmbeddedBackend(capacity_bytes=64 << 20)
    src, dst = kv_caches(2), kv_caches(None)
    a, b = Side(backend, src), Side(backend, dst)
    try:
        req = FakeRequest("r", list(range(23)))
        a_ids = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
        a.scheduler.update_state_after_alloc(req, FakeGroupBlocks(a_ids), 0)
        plan = a.scheduler.build_plan(step_output(req, a_ids, 0, 23))
        a.worker.submit_saves(plan)
        a.worker.wait_for_request_saves(["r"])
        keys = {g.index: a.worker.workers[g.index].keys(req.block_hashes) for g in GROUPS}
        # the window's block 4 is gone: a 5-block hit needs it; a 4-block hit needs window blocks 2, 3
        backend.batch_remove([keys[1][4]])
        assert b.scheduler.get_num_new_matched_tokens(req, 0) == (16, True)
        # after the lookup, full block 1's value is replaced by block 2's (sealed for another key)
        (moved,) = backend.batch_get([keys[0][2]])
        backend.batch_remove([keys[0][1]])
        assert backend.batch_put([keys[0][1]], [moved]) == [True]
        b_ids = ([2, 3, 4, 5, 6, 7], [0, 0, 9, 10, 11, 12])  # 16 tokens, window 6: 2 null blocks
        b.scheduler.update_state_after_alloc(req, FakeGroupBlocks(b_ids), 16)
        load = b.scheduler.build_plan(step_output(req, b_ids, 0, 7))
        assert sorted((t.group, t.block_ids[0]) for t in load.loads) == [(0, [2, 3, 4, 5]), (1, [9, 10])]
        b.worker.start_async(load)
        wait_loaded(b, "r")  # reported once both groups are over
        assert b.ledger.take_failed_requests() == {"r"}  # the whole request: vLLM recomputes it
        assert not dst["l0"][3].any()  # the bad value never landed
    finally:
        a.close()
        b.close()


class SlowPutBackend(EmbeddedBackend):
    """The embedded store, every put 0.3 s late (a save outlasts the step that queued it)."""

    def batch_put(self, keys, values):
        time.sleep(0.3)
        return super().batch_put(keys, values)

    def batch_put_parts(self, keys, values):
        time.sleep(0.3)
        return super().batch_put_parts(keys, values)


def test_window_saves_are_done_when_the_step_returns():
    """vLLM frees a window's blocks while the request runs (to other requests): the window group's
    save must not read them a step later. Full-attention saves stay in the background (vLLM holds
    those blocks until the saves are reported)."""
    backend = SlowPutBackend(capacity_bytes=64 << 20)
    a = Side(backend, kv_caches(3))
    try:
        req = FakeRequest("r", list(range(23)))
        ids = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
        a.scheduler.update_state_after_alloc(req, FakeGroupBlocks(ids), 0)
        a.worker.submit_saves(a.scheduler.build_plan(step_output(req, ids, 0, 23)))
        window = a.worker.workers[1]
        assert window.leak_report()["pending_saves"] == 0
        assert all(backend.batch_exists(window.keys(req.block_hashes[:5])))
        a.worker.wait_for_request_saves(["r"])
        assert a.worker.get_finished({"r"}) == {"r"}  # over in every group: vLLM may free its blocks
    finally:
        a.close()


# ---- the connector: SupportsHMA, refusals at construction, namespace, per-request load errors ----
def hybrid_connector(kv_cache_config, role: str = "SCHEDULER"):
    pytest.importorskip("vllm")
    from kv_common.testing.fake_vllm_config import fake_vllm_config
    from kv_common.vllm_compat import base_module
    from kv_store.connector_base import StoreConnectorBase

    class EmbeddedStoreConnector(StoreConnectorBase):
        connector_name = "EmbeddedStoreConnector"

        def make_backend(self, config, role):
            return EmbeddedBackend(16 << 20)

    config = fake_vllm_config(block_size=16)
    config.kv_transfer_config = SimpleNamespace(kv_connector_extra_config={}, is_kv_consumer=True,
                                                is_kv_producer=True, kv_load_failure_policy="recompute")
    return EmbeddedStoreConnector(config, getattr(base_module().KVConnectorRole, role), kv_cache_config)


def test_connector_is_hma_and_refuses_state_groups_at_construction():
    from kv_common.vllm_compat import base_module

    hybrid = hybrid_connector(kv_config(attention(), attention(window=64)))
    single = hybrid_connector(kv_config(attention()))
    try:
        assert isinstance(hybrid, base_module().SupportsHMA)
        assert hybrid.store_config.load_mode == "async"  # per-request load errors need an async load
        assert single.store_config.load_mode == "sync" and single.groups == ()
        assert hybrid.namespace != single.namespace  # other group layouts never share a value
        other_window = hybrid_connector(kv_config(attention(), attention(window=32)))
        assert other_window.namespace != hybrid.namespace
        other_window.shutdown()
    finally:
        hybrid.shutdown()
        single.shutdown()
    mamba = iface().MambaSpec(block_size=16, shapes=((2, 8),), dtypes=(torch.float32,))
    with pytest.raises(UnsupportedKVGroup, match="MambaSpec"):
        hybrid_connector(kv_config(attention(), mamba))


def test_connector_reports_a_failed_group_load_per_request_never_by_block_id():
    """vLLM refuses block ids of several groups (its scheduler raises): a load that failed in one
    group fails the request (failed_recving), which vLLM recomputes."""
    from kv_store.metadata import BlockTransfer, StorePlan
    from kv_store.vllm_metadata import StoreConnectorMetadata

    worker = hybrid_connector(kv_config(attention(), attention(window=64)), role="WORKER")
    try:
        worker.register_kv_caches({f"model.layers.{i}.attn": torch.zeros((8, 4, 16, 64)) for i in range(2)})
        # group 1's block is not in the store (gone since the lookup); group 0's is never asked for
        missing = [BlockTransfer(request_id="r", block_hashes=[bytes(32)], block_ids=[[3]], group=g) for g in (0, 1)]
        worker.bind_connector_metadata(StoreConnectorMetadata(StorePlan(loads=missing)))
        deadline = time.monotonic() + 10
        results = worker.get_transfer_results(set())
        while "r" not in results.finished_recving:
            assert time.monotonic() < deadline, "the failed load was never reported"
            time.sleep(0.01)
            results = worker.get_transfer_results(set())
        assert results.failed_recving == {"r"}
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()
