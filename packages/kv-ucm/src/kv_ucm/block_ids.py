"""UCM block ids for vLLM KV blocks.

UCM's stores key every block by exactly 16 bytes. A vLLM block hash only says which tokens a
block holds; the bytes stored for it also depend on the model, the tensor-parallel size, the KV
dtype and (for MHA/GQA) which TP rank's head shard it is. ``ucm_block_id`` folds all of these
into one 16-byte BLAKE2b digest over a canonical, unambiguous encoding, so two deployments that
would store different bytes never share an id.

With MLA the latent KV is identical on every TP rank, so the rank is left out: all ranks map a
block to the same id and one stored copy serves them all.
"""

from __future__ import annotations

import hashlib

UCM_BLOCK_ID_SIZE = 16

# Bump when the encoding below changes: every id changes with it.
_SCHEME = b"kv-ucm/block-id/v1"
_PERSON = b"kv-ucm-blockid"  # BLAKE2b personalisation (at most 16 bytes)


def _field(tag: bytes, payload: bytes) -> bytes:
    # tag, 8-byte big-endian length, payload: no two field sequences encode alike.
    return tag + len(payload).to_bytes(8, "big") + payload


def _hash_bytes(block_hash: bytes | int) -> bytes:
    if isinstance(block_hash, bool):
        raise TypeError("block_hash must be bytes or int, not bool")
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return _field(b"B", bytes(block_hash))
    if isinstance(block_hash, int):
        length = (block_hash.bit_length() + 8) // 8  # room for the sign bit
        return _field(b"I", block_hash.to_bytes(length, "big", signed=True))
    raise TypeError(f"block_hash must be bytes or int, not {type(block_hash).__name__}")


def _canonical_dtype(dtype: object) -> str:
    text = str(dtype).strip().lower()
    return text.removeprefix("torch.")


def ucm_block_id(
    block_hash: bytes | int,
    *,
    model: str,
    tp_size: int,
    dtype: str,
    rank: int,
    use_mla: bool,
) -> bytes:
    """The 16-byte UCM id of one KV block.

    ``dtype`` may be a torch dtype or its name (``torch.float16`` and ``"float16"`` are the same).
    ``rank`` is the TP rank whose KV shard the block holds; it must lie in ``[0, tp_size)`` and
    is ignored when ``use_mla`` is true.
    """
    if not isinstance(model, str) or not model:
        raise ValueError("model must be a non-empty string")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise ValueError(f"rank must be an int in [0, {tp_size}), got {rank!r}")
    if not isinstance(use_mla, bool):
        raise TypeError(f"use_mla must be a bool, got {type(use_mla).__name__}")
    dtype_name = _canonical_dtype(dtype)
    if not dtype_name:
        raise ValueError("dtype must not be empty")

    parts = [
        _field(b"S", _SCHEME),
        _hash_bytes(block_hash),
        _field(b"M", model.encode()),
        _field(b"T", str(tp_size).encode()),
        _field(b"D", dtype_name.encode()),
    ]
    if use_mla:
        parts.append(_field(b"L", b"mla"))
    else:
        parts.append(_field(b"L", b"mha"))
        parts.append(_field(b"R", str(rank).encode()))
    digest = hashlib.blake2b(b"".join(parts), digest_size=UCM_BLOCK_ID_SIZE, person=_PERSON)
    return digest.digest()


def ucm_block_ids(
    block_hashes: list[bytes | int],
    *,
    model: str,
    tp_size: int,
    dtype: str,
    rank: int,
    use_mla: bool,
) -> list[bytes]:
    """``ucm_block_id`` for each hash of a request, in order."""
    return [
        ucm_block_id(h, model=model, tp_size=tp_size, dtype=dtype, rank=rank, use_mla=use_mla)
        for h in block_hashes
    ]


_KEY_PERSON = b"kv-ucm-storekey"  # a different personalisation: never equal to a ucm_block_id


def ucm_key_id(key: str) -> bytes:
    """The 16-byte UCM id of a store-connector key (``kv/<namespace>/<rank tag>/<hash hex>``).

    The store core's keys already carry everything ``ucm_block_id`` folds in (model, dtype, KV
    dtype, block size, layout, parallel sizes, hash algorithm in the namespace; the head group or
    ``mla`` in the rank tag; the chained vLLM block hash), so the id is a BLAKE2b digest of the key.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string, got {key!r:.60}")
    data = key.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=UCM_BLOCK_ID_SIZE, person=_KEY_PERSON).digest()
