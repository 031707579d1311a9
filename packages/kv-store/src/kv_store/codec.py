"""Value framing: the block payload followed by a 16-byte trailer (magic, check, payload length).

The trailer turns a truncated, resized or corrupted value into a detected load error instead of
silently wrong KV. Kinds of check (the magic says which one a value carries):

- ``KVS3``: xxh3-64 of the payload (``xxhash``): about 30 GB/s on the development machines for
  blocks in cache, against 1.8 for zlib's crc32 and 12 for ISA-L's, so the check stays off the
  critical path of a multi-GB/s store. Detects corruption, not tampering.
- ``KVSM``: keyed BLAKE2b (64-bit tag) with a deployment secret, for a store shared between users
  who must not be able to plant KV: with a key configured only ``KVSM`` values with a valid tag are
  accepted (a value without a tag is refused too). About 0.3-1 GB/s: it costs real time.
- ``KVSL``: no check (``checksum=False``); the length and the layout tag (below) stay.

Any other magic (a foreign value, or an unreleased development format without the layout tag)
is refused: a miss, recomputed.

The layout tag: a 64-bit digest of every setting that changes a block's bytes (the namespace
manifest's settings, ``manifest.layout_tag``). It seeds the xxh3, personalises the MAC and is
stored as is in a ``KVSL`` trailer, so a value written by an engine of another layout fails its
check even when the sizes agree and the namespace manifest was evicted or never reachable: a miss
(recomputed), never another layout's KV. It costs nothing: the seed is part of the same hash pass.
Such a value reads as a "checksum mismatch" ("MAC mismatch", "layout tag mismatch"): from the bytes
alone, corruption and another layout look the same.

A value may live in several buffers ("parts": one slice per KV layer, then the trailer), so a
backend can move it without a gather/scatter copy: ``seal_parts`` / ``check_parts``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import xxhash

_TRAILER = struct.Struct("<4sQI")  # magic, 64-bit check (or the tag: KVSL), payload length
TRAILER_SIZE = _TRAILER.size
MAGIC_XXH3 = b"KVS3"
MAGIC_MAC = b"KVSM"
MAGIC_TAG_ONLY = b"KVSL"
MAX_PAYLOAD = (1 << 32) - 1
VALUE_FORMAT = "layout-tagged"  # in the namespace manifest: untagged writers are another format
MIN_KEY_BYTES = 16
MAC_BYTES = 8
# Bytes moved per pass when a copy and the check touch the same values: the second reads what the
# first just brought into cache (on the development VM a 4 MiB pass made copy + xxh3 ~1.3x faster
# than copying everything, then hashing everything).
CACHE_PASS_BYTES = 4 << 20


def blocks_per_pass(value_size: int, limit: int) -> int:
    """Blocks of ``value_size`` bytes per copy-and-check pass (at most ``limit``, at least 1)."""
    return max(1, min(limit, CACHE_PASS_BYTES // max(1, value_size)))


MAX_TAG = (1 << 64) - 1


def _digest(parts: Sequence[memoryview], key: bytes | None, tag: int) -> int:
    if key is not None:
        mac = hashlib.blake2b(digest_size=MAC_BYTES, key=key, person=tag.to_bytes(8, "little"))
        for part in parts:
            mac.update(part)
        return int.from_bytes(mac.digest(), "little")
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0], seed=tag)
    h = xxhash.xxh3_64(seed=tag)
    for part in parts:
        h.update(part)
    return h.intdigest()


def _seal(trailer: memoryview, offset: int, parts: Sequence[memoryview], payload_size: int,
          checksum: bool, key: bytes | None, tag: int) -> None:
    if payload_size > MAX_PAYLOAD:
        raise ValueError(f"a value payload of {payload_size} bytes exceeds the trailer's {MAX_PAYLOAD}")
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"layout tag {tag} is not a 64-bit unsigned integer")
    if key is not None:
        _TRAILER.pack_into(trailer, offset, MAGIC_MAC, _digest(parts, key, tag), payload_size)
    elif checksum:
        _TRAILER.pack_into(trailer, offset, MAGIC_XXH3, _digest(parts, None, tag), payload_size)
    else:
        _TRAILER.pack_into(trailer, offset, MAGIC_TAG_ONLY, tag, payload_size)


def _check(trailer: memoryview, offset: int, parts: Sequence[memoryview], payload_size: int,
           nbytes: int, key: bytes | None, tag: int) -> str | None:
    if nbytes != payload_size + TRAILER_SIZE:
        return f"size {nbytes} != expected {payload_size + TRAILER_SIZE}"
    magic, check, length = _TRAILER.unpack_from(trailer, offset)
    if magic not in (MAGIC_XXH3, MAGIC_MAC, MAGIC_TAG_ONLY):
        return f"bad magic {magic!r}"
    if length != payload_size:
        return f"trailer length {length} != {payload_size}"
    if key is not None:  # a shared store: only values sealed with our key are KV we trust
        if magic != MAGIC_MAC:
            return f"no MAC (magic {magic!r}) while a MAC key is configured"
        return None if _digest(parts, key, tag) == check else "MAC mismatch"
    if magic == MAGIC_MAC:
        return "MAC-sealed value but no MAC key configured"
    if magic == MAGIC_XXH3:
        return None if _digest(parts, None, tag) == check else "checksum mismatch"
    return None if check == tag else "layout tag mismatch"  # MAGIC_TAG_ONLY


def write_trailer(value: memoryview, payload_size: int, checksum: bool, key: bytes | None = None,
                  tag: int = 0) -> None:
    """``value`` is payload_size + TRAILER_SIZE bytes; fills in the trailer."""
    _seal(value, payload_size, [value[:payload_size]], payload_size, checksum, key, tag)


def check_value(value: memoryview, payload_size: int, nbytes: int, key: bytes | None = None,
                tag: int = 0) -> str | None:
    """None when ``value`` (``nbytes`` read) is intact and of layout ``tag``; otherwise why not."""
    if nbytes != payload_size + TRAILER_SIZE:
        return f"size {nbytes} != expected {payload_size + TRAILER_SIZE}"
    return _check(value, payload_size, [value[:payload_size]], payload_size, nbytes, key, tag)


def seal_parts(parts: Sequence[memoryview], trailer: memoryview, checksum: bool, key: bytes | None = None,
               tag: int = 0) -> None:
    """``parts`` hold the payload in order; fills the 16-byte ``trailer`` (as ``write_trailer``)."""
    _seal(trailer, 0, parts, sum(len(p) for p in parts), checksum, key, tag)


def check_parts(parts: Sequence[memoryview], trailer: memoryview, nbytes: int, key: bytes | None = None,
                tag: int = 0) -> str | None:
    """``check_value`` for a value read into ``parts`` + ``trailer`` (``nbytes`` read in all)."""
    return _check(trailer, 0, parts, sum(len(p) for p in parts), nbytes, key, tag)


def mac_key_from_env(variable: str | None, environ: dict[str, str] | None = None) -> bytes | None:
    """The deployment secret named by ``mac_key_env`` (None when not configured). The secret is
    read from the environment, never from the connector config (which vLLM logs)."""
    if not variable:
        return None
    import os

    env = os.environ if environ is None else environ
    secret = env.get(variable)
    if secret is None:
        raise ValueError(f"mac_key_env={variable!r}: the environment variable {variable} is not set")
    key = secret.encode("utf-8")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"mac_key_env={variable!r}: the secret has {len(key)} bytes, at least {MIN_KEY_BYTES} needed")
    return hashlib.blake2b(key, digest_size=32).digest()  # BLAKE2b keys are at most 64 bytes
