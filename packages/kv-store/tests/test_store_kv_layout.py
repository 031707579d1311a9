"""Which KV tensors the store worker accepts: a value copies whole blocks, so a block must be one
contiguous run of bytes with blocks outermost (``kv_common.kv_layout.whole_block_bytes``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")  # the worker side moves torch tensors

from kv_common.embedded_backend import EmbeddedBackend
from kv_common.kv_layout import LayoutError
from kv_store import codec
from kv_store.config import StoreConnectorConfig
from kv_store.metadata import BlockTransfer, StorePlan
from kv_store.worker import StoreWorker

BLOCKS, BS, HEADS, HEAD = 6, 4, 2, 8


def make_worker(**layout):
    return StoreWorker(backend=EmbeddedBackend(16 << 20), namespace="ns", rank_tag="r0",
                       config=StoreConnectorConfig(staging_bytes=1 << 16), **layout)


def test_older_cuda_layout_with_kv_outermost_is_refused():
    """``[2, blocks, block, heads, head]`` is contiguous, but a block's K and V lie a whole tensor
    half apart: taking ``shape[0]`` as the block count would address the wrong bytes."""
    worker = make_worker(kv_heads=HEADS, head_size=HEAD)
    cache = torch.zeros(2, BLOCKS, BS, HEADS, HEAD)
    try:
        with pytest.raises(LayoutError, match=r"\(2, 6, 4, 2, 8\)"):
            worker.register_kv_caches({"layer0": cache, "layer1": cache.clone()})
    finally:
        worker.close(1)


@pytest.mark.parametrize("layout", [{}, {"kv_heads": HEADS, "head_size": HEAD}], ids=["stride-only", "from-config"])
def test_vllm_032_layout_moves_whole_blocks(layout):
    """vLLM 0.32's ``[blocks, heads, block, 2*head]``: the same value size and block count whether
    the heads are known or read from the strides, and a saved block loads back bit for bit."""
    worker = make_worker(**layout)
    torch.manual_seed(0)
    caches = {f"layer{i}": torch.randn(BLOCKS, HEADS, BS, 2 * HEAD) for i in range(2)}
    try:
        worker.register_kv_caches(caches)
        assert worker.value_size == 2 * HEADS * BS * 2 * HEAD * 4 + codec.TRAILER_SIZE
        hashes = [bytes([i]) * 32 for i in range(2)]
        worker.submit_saves(StorePlan(saves=[BlockTransfer(request_id="s", block_hashes=hashes, block_ids=[[1, 2]])]))
        worker.wait_for_request_saves(["s"])
        worker.load_sync(StorePlan(loads=[BlockTransfer(request_id="l", block_hashes=hashes, block_ids=[[4, 5]])]))
        assert worker.ledger.take_block_ids_with_load_errors() == set()
        for cache in caches.values():
            assert torch.equal(cache[4:6], cache[1:3])
    finally:
        worker.close(1)


def test_flashinfer_layout_with_blocks_outermost_is_accepted():
    worker = make_worker(kv_heads=HEADS, head_size=HEAD)
    try:
        worker.register_kv_caches({"layer0": torch.zeros(BLOCKS, 2, BS, HEADS, HEAD)})
        assert worker.value_size == 2 * BS * HEADS * HEAD * 4 + codec.TRAILER_SIZE
    finally:
        worker.close(1)


def test_unknown_shape_is_refused_when_the_heads_are_known():
    worker = make_worker(kv_heads=HEADS, head_size=HEAD)
    try:
        with pytest.raises(LayoutError, match=r"\(6, 3, 4, 16\)"):
            worker.register_kv_caches({"layer0": torch.zeros(BLOCKS, 3, BS, 2 * HEAD)})
    finally:
        worker.close(1)


def test_non_contiguous_cache_is_refused():
    worker = make_worker()
    cache = torch.zeros(BS, BLOCKS, HEADS, 2 * HEAD).transpose(0, 1)  # blocks not outermost in memory
    try:
        with pytest.raises(ValueError, match="layer0"):
            worker.register_kv_caches({"layer0": cache})
    finally:
        worker.close(1)


def test_id_runs_cut_block_ids_into_consecutive_runs():
    from kv_store.kv_view import id_runs

    assert id_runs([]) == []
    assert id_runs([7]) == [(0, 7, 1)]
    assert id_runs([3, 4, 5, 9, 10, 2, 8, 9, 10, 11]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1), (6, 8, 4)]
    assert id_runs([5, 4]) == [(0, 5, 1), (1, 4, 1)]  # descending ids are not a run


@pytest.mark.parametrize("load_timeout_s", [0.0, 10.0], ids=["no-deadline", "deadline"])
def test_staged_blocks_in_long_and_short_runs_land_in_their_own_blocks(load_timeout_s):
    """Through staging (no zero-copy parts), blocks whose ids run for a while move as one copy per
    run, single ones a block at a time: every block still lands where its id says, across passes."""
    from kv_store.kv_view import MIN_RUN_BLOCKS, id_runs

    saved = [1, 2, 3, 4, 5, 6, 30, 8, 9, 10, 11, 12, 13, 14, 20]  # a long run, a single, a long run, a single
    loaded = [40, 41, 42, 43, 44, 45, 46, 47, 33, 50, 52, 54, 55, 56, 60]
    assert max(r[2] for r in id_runs(loaded)) >= MIN_RUN_BLOCKS > min(r[2] for r in id_runs(saved))
    backend = EmbeddedBackend(16 << 20)
    backend.pass_bytes = None  # the save gathers all its runs in one pass
    worker = StoreWorker(backend=backend, namespace="ns", rank_tag="r0", zero_copy=False,
                         config=StoreConnectorConfig(staging_bytes=1 << 20, load_timeout_s=load_timeout_s))
    torch.manual_seed(0)
    caches = {f"layer{i}": torch.randn(64, HEADS, BS, 2 * HEAD) for i in range(3)}
    try:
        worker.register_kv_caches(caches)
        hashes = [bytes([i]) * 32 for i in range(len(saved))]
        worker.submit_saves(StorePlan(saves=[BlockTransfer(request_id="s", block_hashes=hashes, block_ids=[saved])]))
        worker.wait_for_request_saves(["s"])
        for pass_bytes in (1, 5 * worker.value_size, None):  # runs cut where passes end, or not
            backend.pass_bytes = pass_bytes
            for cache in caches.values():
                cache[loaded] = 0
            worker.load_sync(StorePlan(loads=[BlockTransfer(request_id="l", block_hashes=hashes, block_ids=[loaded])]))
            assert worker.ledger.take_block_ids_with_load_errors() == set()
            for cache in caches.values():
                assert torch.equal(cache[loaded], cache[saved]), pass_bytes
    finally:
        worker.close(1)
