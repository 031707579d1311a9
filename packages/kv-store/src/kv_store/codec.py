"""Value framing: the block payload followed by a 16-byte trailer (magic, check, payload length).

The trailer turns a truncated, resized, corrupted or moved value into a detected load error
instead of silently wrong KV. Kinds of check (the magic says which one a value carries):

- ``KVB3``: xxh3-64 of the payload (``xxhash``): about 30 GB/s on the development machines for
  blocks in cache, against 1.8 for zlib's crc32 and 12 for ISA-L's, so the check stays off the
  critical path of a multi-GB/s store. Detects corruption and moved values, not tampering.
- ``KVBM``: keyed BLAKE2b (64-bit tag) with a deployment secret, for a store shared between users
  who must not be able to plant KV: with a key configured only ``KVBM`` values with a valid tag are
  accepted (a value without a tag is refused too). About 0.3-1 GB/s: it costs real time.
- ``KVBL``: no check (``checksum=False``); the length and the binding (below) stay.

Any other magic (a foreign value, or an older format: ``KVS3`` / ``KVSM`` / ``KVSL`` were sealed
without their key) is refused: a miss, recomputed.

The binding: every value is sealed for the one store key it is stored under (``kv/<namespace>/
<rank tag>/<block hash>``, which names the model layout, the rank's slice and the whole prefix)
and for the layout tag, a 64-bit digest of every setting that changes a block's bytes (the
namespace manifest's settings, ``manifest.layout_tag``). The xxh3 is seeded with a digest of both
(``bound_seed``), the MAC covers the key (framed, before the payload) and is personalised with the
tag, and a ``KVBL`` trailer stores the seed as is. So a value copied to another key (another
prompt's block hash, another rank tag, another namespace), or written by an engine of another
layout, fails its check even when the sizes agree and the namespace manifest was evicted or never
reachable: a miss (recomputed), never another prefix's or another layout's KV. Without a MAC key
this stops accidents and naive copies, not a writer who recomputes the seed: that takes the MAC.
It costs one 64-bit hash of the key per value. Such a value reads as a "checksum mismatch" ("MAC
mismatch", "key or layout tag mismatch"): from the bytes alone, corruption, another key and
another layout look the same.

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
MAGIC_XXH3 = b"KVB3"
MAGIC_MAC = b"KVBM"
MAGIC_TAG_ONLY = b"KVBL"
# Values sealed before the key was bound (issue 23): a miss, never trusted.
OLD_MAGICS = (b"KVS3", b"KVSM", b"KVSL")
MAX_PAYLOAD = (1 << 32) - 1
# In the namespace manifest and the derived namespace: writers of another format share nothing.
VALUE_FORMAT = "key-bound"
MIN_KEY_BYTES = 16
MAC_BYTES = 8
MAX_TAG = (1 << 64) - 1


def bound_seed(tag: int, store_key: bytes) -> int:
    """The 64-bit seed of a value's check: the layout ``tag`` and the ``store_key`` it is stored
    under, so that the same bytes under another key or of another layout fail their check."""
    return xxhash.xxh3_64_intdigest(store_key, seed=tag)


def _key_frame(store_key: bytes) -> memoryview:
    """The store key as the MAC's first input, length-prefixed: where the key ends and the
    payload starts is part of what the MAC covers."""
    return memoryview(len(store_key).to_bytes(8, "little") + store_key)


def _digest(parts: Sequence[memoryview], key: bytes | None, tag: int) -> int:
    """MAC (``key``: the parts start with the key frame, ``tag`` personalises) or xxh3 (``tag``:
    the bound seed)."""
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


def _check_of(parts: Sequence[memoryview], key: bytes | None, tag: int, store_key: bytes) -> int:
    """The value a trailer must carry (MAC, xxh3 or the bound seed: its magic says which)."""
    if key is not None:
        return _digest([_key_frame(store_key), *parts], key, tag)
    return _digest(parts, None, bound_seed(tag, store_key))


def _seal(trailer: memoryview, offset: int, parts: Sequence[memoryview], payload_size: int,
          checksum: bool, key: bytes | None, tag: int, store_key: bytes) -> None:
    if payload_size > MAX_PAYLOAD:
        raise ValueError(f"a value payload of {payload_size} bytes exceeds the trailer's {MAX_PAYLOAD}")
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"layout tag {tag} is not a 64-bit unsigned integer")
    if key is not None:
        _TRAILER.pack_into(trailer, offset, MAGIC_MAC, _check_of(parts, key, tag, store_key), payload_size)
    elif checksum:
        _TRAILER.pack_into(trailer, offset, MAGIC_XXH3, _check_of(parts, None, tag, store_key), payload_size)
    else:
        _TRAILER.pack_into(trailer, offset, MAGIC_TAG_ONLY, bound_seed(tag, store_key), payload_size)


def _check(trailer: memoryview, offset: int, parts: Sequence[memoryview], payload_size: int,
           nbytes: int, key: bytes | None, tag: int, store_key: bytes) -> str | None:
    if nbytes != payload_size + TRAILER_SIZE:
        return f"size {nbytes} != expected {payload_size + TRAILER_SIZE}"
    magic, check, length = _TRAILER.unpack_from(trailer, offset)
    if magic not in (MAGIC_XXH3, MAGIC_MAC, MAGIC_TAG_ONLY):
        older = " (an older format, not bound to its key)" if bytes(magic) in OLD_MAGICS else ""
        return f"bad magic {magic!r}{older}"
    if length != payload_size:
        return f"trailer length {length} != {payload_size}"
    if key is not None:  # a shared store: only values sealed with our key are KV we trust
        if magic != MAGIC_MAC:
            return f"no MAC (magic {magic!r}) while a MAC key is configured"
        return None if _check_of(parts, key, tag, store_key) == check else "MAC mismatch"
    if magic == MAGIC_MAC:
        return "MAC-sealed value but no MAC key configured"
    if magic == MAGIC_XXH3:
        return None if _check_of(parts, None, tag, store_key) == check else "checksum mismatch"
    return None if check == bound_seed(tag, store_key) else "key or layout tag mismatch"  # MAGIC_TAG_ONLY


# ``store_key``: the key the value is stored under (``keys.block_key``, as bytes); a value checked
# under another key than it was sealed for fails its check.

def write_trailer(value: memoryview, payload_size: int, checksum: bool, key: bytes | None = None,
                  tag: int = 0, store_key: bytes = b"") -> None:
    """``value`` is payload_size + TRAILER_SIZE bytes; fills in the trailer."""
    _seal(value, payload_size, [value[:payload_size]], payload_size, checksum, key, tag, store_key)


def check_value(value: memoryview, payload_size: int, nbytes: int, key: bytes | None = None,
                tag: int = 0, store_key: bytes = b"") -> str | None:
    """None when ``value`` (``nbytes`` read) is intact, of layout ``tag`` and sealed for
    ``store_key``; otherwise why not."""
    if nbytes != payload_size + TRAILER_SIZE:
        return f"size {nbytes} != expected {payload_size + TRAILER_SIZE}"
    return _check(value, payload_size, [value[:payload_size]], payload_size, nbytes, key, tag, store_key)


def seal_parts(parts: Sequence[memoryview], trailer: memoryview, checksum: bool, key: bytes | None = None,
               tag: int = 0, store_key: bytes = b"") -> None:
    """``parts`` hold the payload in order; fills the 16-byte ``trailer`` (as ``write_trailer``)."""
    _seal(trailer, 0, parts, sum(len(p) for p in parts), checksum, key, tag, store_key)


def check_parts(parts: Sequence[memoryview], trailer: memoryview, nbytes: int, key: bytes | None = None,
                tag: int = 0, store_key: bytes = b"") -> str | None:
    """``check_value`` for a value read into ``parts`` + ``trailer`` (``nbytes`` read in all)."""
    return _check(trailer, 0, parts, sum(len(p) for p in parts), nbytes, key, tag, store_key)


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
