"""UCMConnector's data path with guard tensors (issue 15 §4): the store worker over ``UcmBackend``
touches KV memory only through ``kv_common.device`` (host KV) or the copy engine (device KV).

UCM itself is Python 3.12 only; ``FakeUcmStore`` (test_ucm_backend.py) stands in for the native
store. The same worker over the real UCM Posix store is in test_ucm_backend_posix.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kv_common.testing.host_guard import HostAccessGuardTensor
from kv_store.config import StoreConnectorConfig
from kv_store.metadata import BlockTransfer, StorePlan
from kv_store.worker import StoreWorker
from kv_ucm.ucm_backend import UcmBackend
from test_ucm_backend import FakeUcmStore

HASHES = [bytes([i]) * 32 for i in range(1, 4)]


@pytest.mark.parametrize("strict", [False, True], ids=["host-kv", "device-kv"])
def test_store_worker_over_ucm_backend_with_guarded_kv(strict):
    blocks: dict = {}
    backend = UcmBackend({"store_pipeline": "Posix", "storage_backends": "/unused"},
                         store_factory=lambda cfg, **kw: FakeUcmStore(blocks, cfg, **kw))
    torch.manual_seed(0)
    caches = {f"l{i}": HostAccessGuardTensor.wrap(torch.randn(8, 2, 4, 8), strict=strict) for i in range(2)}
    worker = StoreWorker(backend=backend, namespace="ns", rank_tag="r0",
                         config=StoreConnectorConfig(staging_bytes=1 << 16), host_kv=not strict)
    worker.register_kv_caches(caches)
    backend.open(worker.value_size)
    worker.submit_saves(StorePlan(saves=[BlockTransfer(request_id="s", block_hashes=HASHES, block_ids=[[1, 2, 3]])]))
    worker.wait_for_request_saves(["s"])
    assert len(blocks) == 3
    worker.load_sync(StorePlan(loads=[BlockTransfer(request_id="l", block_hashes=HASHES, block_ids=[[5, 6, 7]])]))
    assert worker.ledger.take_block_ids_with_load_errors() == set()
    for cache in caches.values():
        plain = cache.as_subclass(torch.Tensor)
        assert torch.equal(plain[5:8], plain[1:4])
    worker.close(1)
    backend.close()
