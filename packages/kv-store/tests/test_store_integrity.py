"""Value integrity (issue 15 §3, §5; issue 23 §3): xxh3 trailer, old-format values refused, optional
keyed MAC, every value bound to the store key it was stored under."""

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


# ---- issue 23 §3: a value is bound to the key it was stored under ----------------------------

SEALS = {"xxh3": dict(checksum=True), "mac": dict(mac_key_env="KV_TEST_MAC"), "no checksum": dict(checksum=False)}
MOVES = {  # where someone who can write to a shared store copies a valid value
    "another block hash": ("ns", "r0", 1),
    "another rank tag": ("ns", "r1", 0),
    "another namespace": ("other", "r0", 0),
}


@pytest.mark.parametrize("path", ["staging", "parts"])
@pytest.mark.parametrize("seal", sorted(SEALS))
@pytest.mark.parametrize("move", sorted(MOVES))
def test_a_value_copied_to_another_key_loads_as_a_miss(seal, move, path, monkeypatch):
    """A writer copies a valid value (KV of their own prompt) to the key of another prefix, rank
    tag or namespace: the reader must count an integrity failure and recompute, never load it.
    ``parts``: values saved and loaded zero-copy (loads without a deadline go straight into the
    KV blocks, checked there)."""
    torch = pytest.importorskip("torch")
    from kv_common.embedded_backend import EmbeddedBackend
    from kv_store import keys
    from kv_store.config import StoreConnectorConfig
    from kv_store.embedded import EmbeddedStoreBackend
    from kv_store.metadata import BlockTransfer, StorePlan
    from kv_store.worker import StoreWorker

    monkeypatch.setenv("KV_TEST_MAC", "a deployment secret of 32 bytes!")
    backend = EmbeddedBackend(16 << 20) if path == "staging" else EmbeddedStoreBackend(16 << 20)
    cfg = dict(SEALS[seal], load_timeout_s=10.0 if path == "staging" else 0)

    def worker(namespace, tag):
        torch.manual_seed(0)
        caches = {"l0": torch.randn(8, 2, 4, 8)}
        w = StoreWorker(backend=backend, namespace=namespace, rank_tag=tag,
                        config=StoreConnectorConfig(staging_bytes=1 << 16, **cfg))
        w.register_kv_caches(caches)
        w.layout_tag = LAYOUT_A  # both of one layout, as StoreConnectorBase.check_manifest sets it
        return w, caches

    hashes = [bytes([i]) * 32 for i in range(1, 3)]
    writer, _ = worker("ns", "r0")
    writer.submit_saves(StorePlan(saves=[BlockTransfer(request_id="s", block_hashes=hashes[:1], block_ids=[[1]])]))
    writer.wait_for_request_saves(["s"])
    (value,) = backend.batch_get(writer.keys(hashes[:1]))
    namespace, tag, target = MOVES[move]
    assert backend.batch_put([keys.block_key(namespace, tag, hashes[target])], [value]) == [True]
    reader, caches = worker(namespace, tag)
    before = caches["l0"][5].clone()
    reader.load_sync(StorePlan(loads=[BlockTransfer(request_id="l", block_hashes=hashes[target:target + 1],
                                                    block_ids=[[5]])]))
    assert reader.ledger.take_block_ids_with_load_errors() == {5}, "a value moved to another key loaded as a hit"
    assert reader.stats.failures.get("corrupt") == 1  # an integrity failure, not a plain miss
    assert reader.zero_copy == (path == "parts")
    if path == "staging":  # zero-copy: whatever landed in the block is recomputed by vLLM
        assert torch.equal(caches["l0"][5], before)
    # the value where it was stored still loads
    writer.load_sync(StorePlan(loads=[BlockTransfer(request_id="w", block_hashes=hashes[:1], block_ids=[[6]])]))
    assert writer.ledger.take_block_ids_with_load_errors() == set()
    for w in (writer, reader):
        w.close(1)


STORE_KEY = b"kv/ns/hg0of1.pcp0of1.dcp0of1/" + b"ab" * 32
OTHER_KEYS = [b"kv/ns/hg0of1.pcp0of1.dcp0of1/" + b"ab" * 31 + b"ac", b"kv/ns/hg1of2.pcp0of1.dcp0of1/" + b"ab" * 32,
              b"kv/other/hg0of1.pcp0of1.dcp0of1/" + b"ab" * 32, b""]


@pytest.mark.parametrize("how", ["xxh3", "mac", "no checksum"])
def test_every_kind_of_check_binds_the_store_key(how):
    key = KEY if how == "mac" else None
    value = bytearray(PAYLOAD + bytes(codec.TRAILER_SIZE))
    codec.write_trailer(memoryview(value), len(PAYLOAD), how != "no checksum", key, tag=LAYOUT_A, store_key=STORE_KEY)
    assert check(value, key=key, tag=LAYOUT_A, store_key=STORE_KEY) is None
    for other in OTHER_KEYS:
        why = check(value, key=key, tag=LAYOUT_A, store_key=other)
        assert why is not None and "mismatch" in why, (other, why)
    parts = [memoryview(PAYLOAD[:100]), memoryview(PAYLOAD[100:])]
    trailer = memoryview(bytearray(codec.TRAILER_SIZE))
    codec.seal_parts(parts, trailer, how != "no checksum", key, tag=LAYOUT_A, store_key=STORE_KEY)
    assert bytes(trailer) == bytes(value[len(PAYLOAD):])
    assert codec.check_parts(parts, trailer, len(value), key, tag=LAYOUT_A, store_key=OTHER_KEYS[0]) is not None


def test_values_sealed_before_the_key_was_bound_are_misses():
    """The formats before issue 23 (KVS3 / KVSM / KVSL: layout tag, no key): refused with a reason,
    never an exception, so the loader counts a miss and vLLM recomputes."""
    import hashlib

    import xxhash

    mac = int.from_bytes(hashlib.blake2b(PAYLOAD, digest_size=8, key=KEY, person=LAYOUT_A.to_bytes(8, "little")).digest(),
                         "little")
    for magic, value_check in ((b"KVS3", xxhash.xxh3_64_intdigest(PAYLOAD, seed=LAYOUT_A)), (b"KVSM", mac),
                               (b"KVSL", LAYOUT_A)):
        value = bytearray(PAYLOAD + struct.pack("<4sQI", magic, value_check, len(PAYLOAD)))
        for kw in ({}, {"key": KEY}):
            why = check(value, tag=LAYOUT_A, store_key=STORE_KEY, **kw)
            assert why is not None and "older format" in why, (magic, kw, why)


# The value format, pinned: stored values are checked with these bytes, so a change here is a new
# format (new magics, codec.VALUE_FORMAT) or it turns every stored block into a miss silently.
# Pinned anew for issue 23 (the store key in the seed and the MAC: KVB3 / KVBM / KVBL); the values
# were computed from the format's description (xxhash / hashlib directly), not by codec.
PINNED_TRAILERS = {
    "xxh3": "4b5642338df6df8de5b27c1600400000",
    "mac": "4b56424d28bf67ac1e94c36c00400000",
    "no checksum": "4b56424c7b8b3a23cb0717cb00400000",
}


@pytest.mark.parametrize("how", sorted(PINNED_TRAILERS))
def test_the_value_format_is_pinned(how):
    value = bytearray(PAYLOAD + bytes(codec.TRAILER_SIZE))
    codec.write_trailer(memoryview(value), len(PAYLOAD), how != "no checksum", KEY if how == "mac" else None,
                        tag=LAYOUT_A, store_key=STORE_KEY)
    assert bytes(value[len(PAYLOAD):]).hex() == PINNED_TRAILERS[how]
    assert codec.VALUE_FORMAT == "key-bound"
