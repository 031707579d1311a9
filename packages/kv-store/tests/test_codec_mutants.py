"""The value trailer at its limits: every kind of check, every refusal, large values and layout tags
up to 2^64 - 1. Written against the survivors of the mutation run (docs/mutation-report.md)."""

from __future__ import annotations

import struct

import pytest
import xxhash
from kv_store import codec

TRAILER = struct.Struct("<4sQI")  # the documented trailer: magic, 64-bit check, payload length
SECRET = "a deployment secret of 32 bytes!"
KEY = codec.mac_key_from_env("KV_TEST_MAC", {"KV_TEST_MAC": SECRET})
BIG_TAG = (1 << 64) - 1
KINDS = [
    pytest.param({"checksum": True}, id="xxh3"),
    pytest.param({"checksum": True, "key": KEY}, id="mac"),
    pytest.param({"checksum": False}, id="tag-only"),
]


def sealed(payload: bytes, checksum: bool = True, **kw) -> bytearray:
    value = bytearray(payload + bytes(codec.TRAILER_SIZE))
    codec.write_trailer(memoryview(value), len(payload), checksum, **kw)
    return value


def check(value: bytearray, payload_size: int, **kw) -> str | None:
    return codec.check_value(memoryview(value), payload_size, len(value), **kw)


def trailer_of(value: bytearray) -> tuple[bytes, int, int]:
    return TRAILER.unpack_from(value, len(value) - codec.TRAILER_SIZE)


def test_the_trailer_is_16_bytes_magic_check_length():
    assert codec.TRAILER_SIZE == 16
    value = sealed(b"abc", tag=5)
    # The seed binds the layout tag and the store key (here the empty key: see test_store_integrity).
    seed_5, seed_7 = xxhash.xxh3_64_intdigest(b"", seed=5), xxhash.xxh3_64_intdigest(b"", seed=7)
    assert trailer_of(value) == (codec.MAGIC_XXH3, xxhash.xxh3_64_intdigest(b"abc", seed=seed_5), 3)
    assert trailer_of(sealed(b"abc", False, tag=7)) == (codec.MAGIC_TAG_ONLY, seed_7, 3)
    assert trailer_of(sealed(b"abc", key=KEY))[0] == codec.MAGIC_MAC


@pytest.mark.parametrize("kind", KINDS)
def test_a_value_over_4_mib_round_trips(kind):
    payload = bytes(range(256)) * ((5 << 20) // 256)
    value = sealed(payload, **kind, tag=3)
    assert check(value, len(payload), key=kind.get("key"), tag=3) is None
    assert trailer_of(value)[2] == len(payload)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tag", [0, 1, 1 << 63, BIG_TAG])
def test_layout_tags_up_to_2_64_round_trip_and_differ(kind, tag):
    value = sealed(b"payload", **kind, tag=tag)
    key = kind.get("key")
    assert check(value, 7, key=key, tag=tag) is None
    other = tag ^ 1
    assert check(value, 7, key=key, tag=other) is not None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tag", [-1, 1 << 64])
def test_a_tag_outside_64_bits_is_refused(kind, tag):
    with pytest.raises(ValueError, match="64-bit"):
        sealed(b"payload", **kind, tag=tag)


def test_the_default_tag_is_zero_on_both_sides():
    for kind in ({"checksum": True}, {"checksum": False}, {"checksum": True, "key": KEY}):
        key = kind.get("key")
        assert check(sealed(b"xy", **kind), 2, key=key, tag=0) is None
        assert check(sealed(b"xy", **kind, tag=0), 2, key=key) is None
        parts, trailer = [memoryview(b"x"), memoryview(b"y")], memoryview(bytearray(16))
        codec.seal_parts(parts, trailer, kind["checksum"], key=key)
        assert codec.check_parts(parts, trailer, 18, key=key, tag=0) is None
        codec.seal_parts(parts, trailer, kind["checksum"], key=key, tag=0)
        assert codec.check_parts(parts, trailer, 18, key=key) is None


def test_parts_carry_the_same_trailer_as_the_whole_value():
    for kind in ({"checksum": True}, {"checksum": False}, {"checksum": True, "key": KEY}):
        parts = [memoryview(b"abc"), memoryview(b"defg")]
        trailer = memoryview(bytearray(16))
        codec.seal_parts(parts, trailer, kind["checksum"], key=kind.get("key"), tag=9)
        assert bytes(trailer) == bytes(sealed(b"abcdefg", **kind, tag=9)[7:])
        one = [memoryview(b"abcdefg")]
        assert codec.check_parts(one, trailer, 23, key=kind.get("key"), tag=9) is None


def test_a_payload_over_the_trailer_limit_is_refused():
    assert codec.MAX_PAYLOAD == (1 << 32) - 1

    class Claimed:  # a part that says how long it is; no 4 GiB buffer needed
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

    trailer = memoryview(bytearray(16))
    codec.seal_parts([Claimed(codec.MAX_PAYLOAD)], trailer, False)  # type: ignore[list-item]
    assert trailer_of(bytearray(trailer))[2] == codec.MAX_PAYLOAD
    with pytest.raises(ValueError, match="exceeds"):
        codec.seal_parts([Claimed(1 << 32)], trailer, False)  # type: ignore[list-item]


@pytest.mark.parametrize("kind", KINDS)
def test_a_value_of_another_size_is_refused_with_both_sizes(kind):
    value = sealed(b"0123456789", **kind)
    key = kind.get("key")
    assert check(value, 10, key=key) is None
    problem = codec.check_value(memoryview(value), 10, 25, key=key)
    assert problem == "size 25 != expected 26"
    problem = codec.check_parts([memoryview(value[:10])], memoryview(value)[10:], 27, key=key)
    assert problem == "size 27 != expected 26"


@pytest.mark.parametrize("kind", KINDS)
def test_an_unknown_magic_is_refused(kind):
    value = sealed(b"0123456789", **kind)
    value[10:14] = b"KVS2"  # a foreign or older format, the rest of the trailer intact
    problem = check(value, 10, key=kind.get("key"))
    assert problem is not None and "bad magic" in problem


@pytest.mark.parametrize("kind", KINDS)
def test_a_trailer_whose_length_disagrees_is_refused(kind):
    value = sealed(b"0123456789", **kind)
    magic, digest, _ = trailer_of(value)
    TRAILER.pack_into(value, 10, magic, digest, 9)
    assert check(value, 10, key=kind.get("key")) == "trailer length 9 != 10"


def test_each_kind_of_value_against_each_reader():
    plain, tagged, maced = sealed(b"kv"), sealed(b"kv", False), sealed(b"kv", key=KEY)
    assert check(plain, 2) is None and check(tagged, 2) is None
    assert check(maced, 2) == "MAC-sealed value but no MAC key configured"
    assert check(maced, 2, key=KEY) is None
    assert check(plain, 2, key=KEY).startswith("no MAC")
    assert check(tagged, 2, key=KEY).startswith("no MAC")
    other = codec.mac_key_from_env("V", {"V": "another deployment secret, 32 b!"})
    assert check(maced, 2, key=other) == "MAC mismatch"
    corrupt = bytearray(plain)
    corrupt[0] ^= 1
    assert check(corrupt, 2) == "checksum mismatch"
    corrupt = bytearray(maced)
    corrupt[0] ^= 1
    assert check(corrupt, 2, key=KEY) == "MAC mismatch"
    assert check(tagged, 2, tag=1) == "key or layout tag mismatch"


def test_the_mac_uses_all_64_bits():
    tops = {trailer_of(sealed(bytes([i]) * 8, key=KEY))[1] >> 56 for i in range(16)}
    assert tops != {0}


def test_the_mac_key_comes_from_the_named_variable(monkeypatch):
    assert codec.mac_key_from_env(None) is None
    assert codec.mac_key_from_env("") is None
    monkeypatch.setenv("KV_TEST_MAC_ENV", SECRET)
    from_env = codec.mac_key_from_env("KV_TEST_MAC_ENV")
    assert from_env == KEY and len(from_env) == 32
    assert codec.mac_key_from_env("KV_TEST_MAC_ENV", {"KV_TEST_MAC_ENV": "x" * 16}) != KEY
    with pytest.raises(ValueError, match="not set"):
        codec.mac_key_from_env("KV_TEST_MAC_ENV", {})


def test_the_mac_secret_needs_16_bytes():
    assert codec.mac_key_from_env("V", {"V": "s" * 16}) is not None
    with pytest.raises(ValueError, match="15 bytes, at least 16"):
        codec.mac_key_from_env("V", {"V": "s" * 15})
