"""Device-neutral store data path (issue 15 §4), proven on CPU with guard tensors.

The KV caches are ``HostAccessGuardTensor``s: host-only access (``.numpy()``, ``.data_ptr()`` ...)
outside ``kv_common.device`` fails. ``strict`` guards stand for accelerator memory: the worker must
move them with the device copy path only (gather into host staging, wait, then hand to a backend).
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from kv_common.embedded_backend import EmbeddedBackend
from kv_common.testing.host_guard import HostAccessError, HostAccessGuardTensor
from kv_store.config import StoreConnectorConfig
from kv_store.metadata import BlockTransfer, StorePlan
from kv_store.worker import StoreWorker

HASHES = [bytes([i]) * 32 for i in range(1, 5)]


def guarded_caches(strict: bool, num_blocks: int = 16):
    torch.manual_seed(0)
    plain = {f"layer{i}": torch.randn(num_blocks, 2, 4, 8) for i in range(3)}
    return {k: HostAccessGuardTensor.wrap(v, strict=strict) for k, v in plain.items()}


def roundtrip(backend, caches, **kw):
    worker = StoreWorker(backend=backend, namespace="ns", rank_tag="r0",
                         config=StoreConnectorConfig(staging_bytes=1 << 16, **kw.pop("cfg", {})), **kw)
    worker.register_kv_caches(caches)
    worker.submit_saves(StorePlan(saves=[BlockTransfer(request_id="s", block_hashes=HASHES, block_ids=[[1, 2, 3, 4]])]))
    worker.wait_for_request_saves(["s"])
    assert worker.get_finished({"s"}) == {"s"}
    for layout in ("sync", "async"):
        dst = [9, 10, 11, 12] if layout == "sync" else [5, 6, 7, 8]
        plan = StorePlan(loads=[BlockTransfer(request_id=layout, block_hashes=HASHES, block_ids=[dst])])
        if layout == "sync":
            worker.load_sync(plan)
        else:
            worker.start_async(plan)  # the loader thread scatters through the device shim too
            deadline = time.monotonic() + 10
            while not worker.take_finished_loads(set()) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert worker.ledger.take_block_ids_with_load_errors() == set()
        for cache in caches.values():
            assert torch.equal(cache[dst].as_subclass(torch.Tensor), cache[1:5].as_subclass(torch.Tensor))
    worker.close(1)
    return worker


def test_the_guard_catches_host_access():
    t = HostAccessGuardTensor.wrap(torch.zeros(4))
    for access in (lambda: t.numpy(), lambda: t.data_ptr(), lambda: t.view(torch.uint8).numpy()):
        with pytest.raises(HostAccessError):
            access()
    from kv_common import device

    assert len(device.host_bytes(t)) == 16  # inside the shim it is allowed
    with pytest.raises(HostAccessError):
        device.host_bytes(HostAccessGuardTensor.wrap(torch.zeros(4), strict=True))


@pytest.mark.parametrize("load_timeout_s", [0.0, 10.0], ids=["zero-copy-loads", "deadline"])
def test_host_kv_is_touched_only_through_the_device_shim(load_timeout_s):
    roundtrip(EmbeddedBackend(16 << 20), guarded_caches(strict=False), cfg={"load_timeout_s": load_timeout_s})


@pytest.mark.parametrize("load_timeout_s", [0.0, 10.0], ids=["no-deadline", "deadline"])
def test_device_kv_moves_only_through_the_copy_engine(load_timeout_s):
    """Strict guards (device memory): no host access at all; gathers and scatters are device copies."""
    roundtrip(EmbeddedBackend(16 << 20), guarded_caches(strict=True), cfg={"load_timeout_s": load_timeout_s},
              host_kv=False)
