"""The worker's zero-copy "parts" path: same bytes as the staging path, same failure handling."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kv_common.backend import BackendCapabilities  # noqa: E402
from kv_common.embedded_backend import EmbeddedBackend  # noqa: E402
from kv_store import codec  # noqa: E402
from kv_store.config import StoreConnectorConfig  # noqa: E402
from kv_store.metadata import BlockTransfer, StorePlan  # noqa: E402
from kv_store.worker import StoreWorker  # noqa: E402

BS = 4


class PartsBackend(EmbeddedBackend):
    """An embedded store that also speaks the parts protocol (as kv-store's does)."""

    capabilities = BackendCapabilities(zero_copy_parts=True)

    def __init__(self, *a, refuse_register: bool = False, **kw):
        super().__init__(*a, **kw)
        self.refuse_register = refuse_register
        self.registered = []

    def register_buffer(self, buffer):
        if self.refuse_register and len(self.registered) >= 3:  # staging x2 and layer 0 pass
            raise RuntimeError("overlapping registration")
        self.registered.append(buffer)

    def unregister_buffer(self, buffer):
        self.registered = [b for b in self.registered if b is not buffer]

    def batch_put_parts(self, keys, parts):
        return self.batch_put(keys, [b"".join(p) for p in parts])

    def batch_get_parts(self, keys, parts):
        out = []
        for value, bufs in zip(self.batch_get(keys), parts, strict=True):
            if value is None or len(value) != sum(len(b) for b in bufs):
                out.append(-1)
                continue
            off = 0
            for b in bufs:
                b[:] = value[off : off + len(b)]
                off += len(b)
            out.append(len(value))
        return out


def make_worker(backend, seed=0, **cfg):
    torch.manual_seed(seed)
    caches = {f"layer{i}": torch.randn(16, 2, BS, 8) for i in range(3)}
    w = StoreWorker(backend=backend, namespace="ns", rank_tag="r0",
                    config=StoreConnectorConfig(staging_bytes=1 << 12, **cfg))
    w.register_kv_caches(caches)
    return w, caches


def hashes(n, salt=b""):
    return [bytes([i]) * 8 + salt for i in range(n)]


def save(worker, hs, ids, req="a"):
    worker.submit_saves(StorePlan(saves=[BlockTransfer(request_id=req, block_hashes=hs, block_ids=[ids])]))
    worker.wait_for_request_saves([req])


def test_parts_and_staging_write_identical_values_and_read_each_other():
    parts_backend = PartsBackend(64 << 20)
    plain = EmbeddedBackend(64 << 20)
    wp, cp = make_worker(parts_backend)
    ws, cs = make_worker(plain)
    assert wp.zero_copy and not ws.zero_copy
    hs = hashes(10)  # more blocks than staging slots: chunked
    assert wp._save_staging.slots < 10
    save(wp, hs, list(range(10)))
    save(ws, hs, list(range(10)))
    keys = [f"kv/ns/r0/{h.hex()}" for h in hs]
    assert parts_backend.batch_get(keys) == plain.batch_get(keys)
    # a parts worker loads what a staging worker saved (and back)
    fresh, caches = make_worker(PartsBackend(64 << 20), seed=1)
    fresh.backend._memory.update(plain._memory)
    fresh.load_sync(StorePlan(loads=[BlockTransfer(request_id="b", block_hashes=hs, block_ids=[list(range(6, 16))])]))
    assert fresh.ledger.take_block_ids_with_load_errors() == set()
    for name in caches:
        assert torch.equal(caches[name][6:16], cs[name][0:10])


def test_parts_corruption_and_miss_are_load_errors():
    backend = PartsBackend(64 << 20)
    worker, caches = make_worker(backend)
    hs = hashes(3)
    save(worker, hs, [1, 2, 3])
    keys = [f"kv/ns/r0/{h.hex()}" for h in hs]
    raw = bytearray(backend.batch_get([keys[1]])[0])
    raw[7] ^= 0xFF
    backend.batch_remove([keys[1]])
    backend.batch_put([keys[1]], [bytes(raw)])
    load = StorePlan(loads=[BlockTransfer(request_id="b", block_hashes=hs, block_ids=[[7, 8, 9]])])
    worker.load_sync(load)
    assert worker.ledger.take_block_ids_with_load_errors() == {8, 9}
    assert torch.equal(caches["layer2"][7], caches["layer2"][1])
    backend.batch_remove([keys[0]])
    worker.load_sync(load)
    assert worker.ledger.take_block_ids_with_load_errors() == {7, 8, 9}
    assert worker.stats.failures.get("miss") == 1 and worker.stats.failures.get("corrupt") == 1


def test_parts_without_checksum_and_trailer_checks():
    payload = [memoryview(bytearray(b"abc")), memoryview(bytearray(b"defg"))]
    trailer = memoryview(bytearray(codec.TRAILER_SIZE))
    codec.seal_parts(payload, trailer, True)
    whole = bytearray(b"abcdefg" + bytes(codec.TRAILER_SIZE))
    codec.write_trailer(memoryview(whole), 7, True)
    assert bytes(trailer) == bytes(whole[7:])
    assert codec.check_parts(payload, trailer, 7 + codec.TRAILER_SIZE) is None
    assert "size" in codec.check_parts(payload, trailer, 7)
    payload[1][0] ^= 1
    assert codec.check_parts(payload, trailer, 7 + codec.TRAILER_SIZE).startswith("checksum mismatch")
    codec.seal_parts(payload, trailer, False)
    assert codec.check_parts(payload, trailer, 7 + codec.TRAILER_SIZE) is None


def test_registration_failure_falls_back_to_staging():
    backend = PartsBackend(64 << 20, refuse_register=True)
    worker, caches = make_worker(backend)
    assert not worker.zero_copy
    hs = hashes(2)
    save(worker, hs, [1, 2])
    worker.load_sync(StorePlan(loads=[BlockTransfer(request_id="b", block_hashes=hs, block_ids=[[5, 6]])]))
    assert worker.ledger.take_block_ids_with_load_errors() == set()
    assert torch.equal(caches["layer0"][5:7], caches["layer0"][1:3])


@pytest.mark.parametrize("seal", [dict(checksum=True), dict(checksum=False), dict(mac_key_env="KV_TEST_MAC")],
                         ids=["xxh3", "no checksum", "mac"])
def test_owned_puts_store_the_staging_paths_values_uncopied_and_read_only(seal, monkeypatch):
    """kv-store's embedded backend keeps the value the saver joined and sealed (no second copy):
    the same bytes as the staging path's, loaded back intact, never writable through a get, and
    a stored value changed afterwards is a load error, not KV."""
    from kv_store.embedded import EmbeddedStoreBackend

    monkeypatch.setenv("KV_TEST_MAC", "a deployment secret of 32 bytes!")
    owned, plain = EmbeddedStoreBackend(64 << 20), EmbeddedBackend(64 << 20)
    wo, co = make_worker(owned, **seal)
    ws, _ = make_worker(plain, **seal)
    assert wo.zero_copy and not ws.zero_copy
    hs = hashes(10)  # more blocks than staging slots: several passes
    save(wo, hs, list(range(10)))
    save(ws, hs, list(range(10)))
    keys = wo.keys(hs)
    assert all(type(owned._memory[k]) is bytearray for k in keys)  # kept as the saver built it
    got = owned.batch_get(keys)
    assert got == plain.batch_get(keys)
    assert all(isinstance(v, memoryview) and v.readonly for v in got)
    load = StorePlan(loads=[BlockTransfer(request_id="b", block_hashes=hs, block_ids=[list(range(6, 16))])])
    fresh, caches = make_worker(owned, seed=1, **seal)
    fresh.load_sync(load)
    assert fresh.ledger.take_block_ids_with_load_errors() == set()
    for name in caches:
        assert torch.equal(caches[name][6:16], co[name][0:10])
    owned._memory[keys[4]][3] ^= 0xFF  # the store's own copy changes after the put
    fresh.load_sync(load)
    damaged = set(range(10, 16)) if seal.get("checksum", True) else set()
    assert fresh.ledger.take_block_ids_with_load_errors() == damaged


def test_a_backend_overriding_batch_put_does_not_inherit_owned_puts():
    from kv_store.embedded import EmbeddedStoreBackend

    class Gated(EmbeddedStoreBackend):
        def batch_put(self, keys, values):
            return super().batch_put(keys, values)

    assert EmbeddedStoreBackend(1 << 20).capabilities.owned_puts
    assert not Gated(1 << 20).capabilities.owned_puts
    assert Gated(1 << 20).capabilities.zero_copy_parts
