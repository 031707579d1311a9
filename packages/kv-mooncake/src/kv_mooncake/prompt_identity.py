"""A digest of a prompt: the decode pulls a prefill's KV only for the very prompt it computed.

Pure functions, no torch, no vLLM import. The prefill sends the digest in ``kv_transfer_params`` and
keeps it with the held blocks; the decode computes it over its own request and pulls nothing when
the two differ (a proxy or chat-template difference with the same number of blocks would otherwise
load the wrong KV, silently), and sends it with ``PullStarted`` so the prefill refuses a reader of
another prompt (``kv_transfer_params`` come from the client: they can be forged).

The digest covers what vLLM's prefix-cache block hashes cover (``kv_cache_utils.
generate_block_hash_extra_keys``): the token ids, the LoRA adapter (name and path), every
multimodal item (its content hash and place) and ``cache_salt``. It is not built from
``request.block_hashes`` themselves: those are seeded per process under xxhash, depend on the hash
algorithm and the hash block size (DCP), and leave out the last partial block, so two instances
would disagree on equal prompts, or agree on prompts that differ in their last tokens' image.
A prompt given as embeddings has no digest: it is never pulled.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

PARAM_KEY = "prompt_digest"
_VERSION = "t2"  # bump when the encoding changes: an old peer's digest then never matches

IdentityKey = tuple[str | int, ...]


def prompt_digest(token_ids: Iterable[int], identity: Sequence[IdentityKey] = ()) -> str:
    """``t2:`` + 32 hex digits of BLAKE2b over the token ids (little-endian int64) and the
    request's ``identity`` keys (``request_identity``), msgpack-framed."""
    data = array("q", (int(t) for t in token_ids))
    if sys.byteorder != "little":
        data.byteswap()
    framed = msgspec.msgpack.encode([_VERSION, data.tobytes(), [list(key) for key in identity]])
    return f"{_VERSION}:{hashlib.blake2b(framed, digest_size=16).hexdigest()}"


def request_identity(request: Any) -> list[IdentityKey]:
    """What, besides its token ids, makes a vLLM request's KV its own: the keys vLLM adds to its
    block hashes, for the whole prompt. Read duck-typed: a request without these attributes has none."""
    keys: list[IdentityKey] = []
    lora = getattr(request, "lora_request", None)
    if lora:
        keys.append(("lora", str(lora.lora_name), str(getattr(lora, "lora_path", "") or "")))
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        keys.append(("mm", str(feature.identifier), int(position.offset), int(position.length)))
    salt = getattr(request, "cache_salt", None)
    if salt:
        keys.append(("cache_salt", str(salt)))
    return keys


def request_digest(request: Any) -> str | None:
    """The digest of a vLLM request's prompt; None when it cannot be told (given as embeddings)."""
    if getattr(request, "prompt_embeds", None) is not None or request.prompt_token_ids is None:
        return None
    return prompt_digest(request.prompt_token_ids, request_identity(request))


def same_prompt(sent: str | None, digest: str | None) -> bool:
    """``sent``: the digest in the prefill's params; ``digest``: this request's. False also when
    either is missing: an unverifiable source or prompt is not trusted."""
    return isinstance(sent, str) and bool(sent) and sent == digest
