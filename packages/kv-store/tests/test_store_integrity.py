"""Value integrity (issue 15 §3, §5): xxh3 trailer, old-format values refused, optional keyed MAC."""

from __future__ import annotations

import struct
import zlib

import pytest
from kv_store import codec

PAYLOAD = bytes(range(256)) * 64


def sealed(payload: bytes = PAYLOAD, **kw) -> bytearray:
    value = bytearray(payload + bytes(codec.TRAILER_SIZE))
    codec.write_trailer(memoryview(value), len(payload), True, **kw)
    return value


def check(value: bytearray, **kw) -> str | None:
    return codec.check_value(memoryview(value), len(PAYLOAD), len(value), **kw)


def test_values_are_checked_with_xxh3_and_corruption_is_found():
    value = sealed()
    assert bytes(value[len(PAYLOAD) : len(PAYLOAD) + 4]) == codec.MAGIC_XXH3
    assert check(value) is None
    value[100] ^= 1
    assert check(value).startswith("checksum mismatch")


def test_parts_and_whole_values_carry_the_same_trailer():
    parts = [memoryview(PAYLOAD[:1000]), memoryview(PAYLOAD[1000:])]
    trailer = memoryview(bytearray(codec.TRAILER_SIZE))
    codec.seal_parts(parts, trailer, True)
    assert bytes(trailer) == bytes(sealed()[len(PAYLOAD) :])
    assert codec.check_parts(parts, trailer, len(PAYLOAD) + codec.TRAILER_SIZE) is None


KEY = codec.mac_key_from_env("KV_TEST_MAC", {"KV_TEST_MAC": "a deployment secret of 32 bytes!"})
OTHER = codec.mac_key_from_env("KV_TEST_MAC", {"KV_TEST_MAC": "another deployment secret, 32 b!"})


def test_keyed_mac_accepts_only_values_sealed_with_the_key():
    value = sealed(key=KEY)
    assert bytes(value[len(PAYLOAD) : len(PAYLOAD) + 4]) == codec.MAGIC_MAC
    assert check(value, key=KEY) is None
    assert check(value, key=OTHER).startswith("MAC mismatch")
    assert "no MAC key" in check(value)  # a keyed value is not trusted blindly without the key
    # Someone without the key plants KV with a valid xxh3 checksum, or without any check.
    forged = sealed()
    assert "no MAC" in check(forged, key=KEY)
    unchecked = bytearray(PAYLOAD + bytes(codec.TRAILER_SIZE))
    codec.write_trailer(memoryview(unchecked), len(PAYLOAD), False)
    assert "no MAC" in check(unchecked, key=KEY)
    tampered = bytearray(value)
    tampered[7] ^= 1
    assert check(tampered, key=KEY).startswith("MAC mismatch")


def test_mac_key_must_be_set_and_long_enough():
    assert codec.mac_key_from_env(None) is None
    with pytest.raises(ValueError, match="not set"):
        codec.mac_key_from_env("KV_TEST_MAC", {})
    with pytest.raises(ValueError, match="at least 16"):
        codec.mac_key_from_env("KV_TEST_MAC", {"KV_TEST_MAC": "short"})


def test_worker_with_a_mac_key_refuses_values_stored_without_it(monkeypatch):
    torch = pytest.importorskip("torch")
    from kv_common.embedded_backend import EmbeddedBackend
    from kv_store.config import StoreConnectorConfig
    from kv_store.metadata import BlockTransfer, StorePlan
    from kv_store.worker import StoreWorker

    monkeypatch.setenv("KV_TEST_MAC", "a deployment secret of 32 bytes!")
    backend = EmbeddedBackend(16 << 20)
    hashes = [bytes([i]) * 32 for i in range(1, 3)]

    def worker(**cfg):
        torch.manual_seed(0)
        caches = {"l0": torch.randn(8, 2, 4, 8)}
        w = StoreWorker(backend=backend, namespace="ns", rank_tag="r0",
                        config=StoreConnectorConfig(staging_bytes=1 << 16, **cfg))
        w.register_kv_caches(caches)
        return w, caches

    plain, _ = worker()
    plain.submit_saves(StorePlan(saves=[BlockTransfer(request_id="s", block_hashes=hashes, block_ids=[[1, 2]])]))
    plain.wait_for_request_saves(["s"])
    keyed, caches = worker(mac_key_env="KV_TEST_MAC")
    keyed.load_sync(StorePlan(loads=[BlockTransfer(request_id="l", block_hashes=hashes, block_ids=[[5, 6]])]))
    assert keyed.ledger.take_block_ids_with_load_errors() == {5, 6}
    # what the keyed worker stores itself it loads
    other = [bytes([9]) * 32]
    keyed.submit_saves(StorePlan(saves=[BlockTransfer(request_id="k", block_hashes=other, block_ids=[[3]])]))
    keyed.wait_for_request_saves(["k"])
    keyed.load_sync(StorePlan(loads=[BlockTransfer(request_id="m", block_hashes=other, block_ids=[[7]])]))
    assert keyed.ledger.take_block_ids_with_load_errors() == set()
    assert torch.equal(caches["l0"][7], caches["l0"][3])
    for w in (plain, keyed):
        w.close(1)


LAYOUT_A, LAYOUT_B = 0x1234_5678_9ABC_DEF0, 0x0FED_CBA9_8765_4321


@pytest.mark.parametrize("how", ["xxh3", "mac", "no checksum"])
def test_a_value_of_another_layout_fails_its_check_with_equal_sizes(how):
    """The layout tag (``manifest.layout_tag``): same payload, same size, other layout: refused."""
    value = bytearray(PAYLOAD + bytes(codec.TRAILER_SIZE))
    key = KEY if how == "mac" else None
    codec.write_trailer(memoryview(value), len(PAYLOAD), how != "no checksum", key, tag=LAYOUT_A)
    assert check(value, key=key, tag=LAYOUT_A) is None
    why = check(value, key=key, tag=LAYOUT_B)
    assert why is not None and "mismatch" in why, why
    assert check(value, key=key) is not None  # an untagged reader does not take it either


def _old_format(payload: bytes = PAYLOAD) -> list[bytearray]:
    """Trailers of the unreleased formats without a layout tag: KVS1 (zlib crc32) and KVS0 (none)."""
    return [bytearray(payload + struct.pack("<4sIQ", magic, check, len(payload)))
            for magic, check in ((b"KVS1", zlib.crc32(payload)), (b"KVS0", 0))]


def test_old_format_values_are_refused_by_every_reader():
    for value in _old_format():
        for kw in ({}, {"tag": LAYOUT_A}, {"key": KEY}, {"key": KEY, "tag": LAYOUT_A}):
            why = check(value, **kw)
            assert why is not None and "bad magic" in why, (bytes(value[-16:-12]), kw, why)
    plain = sealed()  # xxh3 without a seed: a value sealed without the layout tag
    assert check(plain, tag=LAYOUT_A).startswith("checksum mismatch")


def test_worker_refuses_an_old_format_value_as_a_miss():
    """A block stored in an old format under this worker's key is a load error (recomputed), never
    copied into the KV cache."""
    torch = pytest.importorskip("torch")
    from kv_common.embedded_backend import EmbeddedBackend
    from kv_store import keys
    from kv_store.config import StoreConnectorConfig
    from kv_store.metadata import BlockTransfer, StorePlan
    from kv_store.worker import StoreWorker

    backend = EmbeddedBackend(16 << 20)
    caches = {"l0": torch.randn(8, 2, 4, 8)}
    worker = StoreWorker(backend=backend, namespace="ns", rank_tag="r0",
                         config=StoreConnectorConfig(staging_bytes=1 << 16))
    worker.register_kv_caches(caches)
    worker.layout_tag = LAYOUT_A  # as StoreConnectorBase.check_manifest does
    hashes = [bytes([i]) * 32 for i in range(1, 3)]
    payload = bytes(worker.view.payload_size)
    for key, value in zip(keys.block_keys("ns", "r0", hashes), _old_format(payload), strict=True):
        assert backend.batch_put([key], [bytes(value)]) == [True]
    before = caches["l0"][5:7].clone()
    worker.load_sync(StorePlan(loads=[BlockTransfer(request_id="l", block_hashes=hashes, block_ids=[[5, 6]])]))
    assert worker.ledger.take_block_ids_with_load_errors() == {5, 6}
    assert torch.equal(caches["l0"][5:7], before)
    worker.close(1)


def test_the_tag_must_fit_64_bits():
    with pytest.raises(ValueError, match="64-bit"):
        codec.write_trailer(memoryview(bytearray(PAYLOAD + bytes(codec.TRAILER_SIZE))), len(PAYLOAD), True, tag=1 << 64)
