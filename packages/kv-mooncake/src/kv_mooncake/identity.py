"""What an instance's vLLM config says about its KV bytes, and the parallel settings we refuse.

Read with ``getattr`` only (no vLLM import, ``kv_common.vllm_compat``), so it is testable with a plain namespace. The handshake
compares the fingerprint field by field; ``unsupported_settings`` runs at start-up so that a layout
the pull plan cannot read right stops the engine with the setting to change, instead of loading the
wrong KV later.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
from kv_common.kv_byte_settings import KVByteSettings
from kv_common.kv_cache_groups import KVGroup
from kv_common.vllm_compat import kv_byte_settings

from kv_mooncake.group_blocks import plans_per_group


def config_fingerprint(vllm_config: Any) -> KVByteSettings:
    """The settings that change KV bytes (``kv_common.kv_byte_settings``), by the names the
    handshake's ``Compatibility`` gives them, with the parallel sizes ``unsupported_settings`` reads.
    ``model_weights`` names the checkpoint the model path holds: a prefill and a decode serving the
    same path with different weights refuse each other's pulls."""
    return kv_byte_settings(vllm_config)


def group_layouts(groups: Sequence[KVGroup]) -> tuple[str, ...]:
    """Each KV-cache group's layout (kind, block size, window, layers) for the handshake: a prefill and
    a decode pair only when every group matches, since each layer is read through its own group's
    block ids. Empty for one full-attention group, as peers without hybrid support send."""
    if not plans_per_group(groups):
        return ()
    return tuple(json.dumps(group.describe(), sort_keys=True, separators=(",", ":")) for group in groups)


def unsupported_settings(fp: KVByteSettings, *, is_consumer: bool) -> list[str]:
    """Why this instance's parallel layout cannot be served (empty: supported)."""
    problems = []
    pp = fp.pipeline_parallel_size
    if pp > 1 and is_consumer:
        # A prefill's stages each serve their own layers (pipeline_stages); a decode's stages would
        # each need their own part of every pull. vllm-ascend requires decode PP 1 as well.
        problems.append(f"pipeline_parallel_size={pp} on a kv_consumer: MooncakeConnectorV1 pulls into a "
                        "decode with pipeline_parallel_size=1 only (a pipeline-parallel prefill is supported: "
                        "run it with kv_role kv_producer)")
    dcp, pcp, block, interleave = fp.dcp_size, fp.pcp_size, fp.block_size, fp.cp_kv_cache_interleave_size
    if dcp > 1 and interleave != block:
        # vLLM's default (1) spreads single tokens over the DCP ranks; the plan moves whole blocks.
        problems.append(f"cp_kv_cache_interleave_size={interleave} with decode_context_parallel_size={dcp}: "
                        f"MooncakeConnectorV1 moves whole blocks; set cp_kv_cache_interleave_size={block} "
                        "(the block size)")
    if pcp > 1 and dcp > 1:
        problems.append(f"prefill_context_parallel_size={pcp} with decode_context_parallel_size={dcp}: "
                        "MooncakeConnectorV1 supports PCP only without DCP (vLLM then keeps a full KV "
                        "replica on every PCP rank)")
    if pcp > 1 and is_consumer:
        problems.append(f"prefill_context_parallel_size={pcp} on a kv_consumer: each decode PCP rank would "
                        "need its own copy; run the decode with prefill_context_parallel_size=1")
    return problems


# ---- prompt digest ----
# A digest of a prompt: the decode pulls a prefill's KV only for the very prompt it computed.
#
# Pure functions, no torch, no vLLM import. The prefill sends the digest in ``kv_transfer_params`` and
# keeps it with the held blocks; the decode computes it over its own request and pulls nothing when
# the two differ (a proxy or chat-template difference with the same number of blocks would otherwise
# load the wrong KV, silently), and sends it with ``PullStarted`` so the prefill refuses a reader of
# another prompt (``kv_transfer_params`` come from the client: they can be forged).
#
# The digest covers what vLLM's prefix-cache block hashes cover (``kv_cache_utils.
# generate_block_hash_extra_keys``): the token ids, the LoRA adapter (name and path), every
# multimodal item (its content hash and place) and ``cache_salt``. It is not built from
# ``request.block_hashes`` themselves: those are seeded per process under xxhash, depend on the hash
# algorithm and the hash block size (DCP), and leave out the last partial block, so two instances
# would disagree on equal prompts, or agree on prompts that differ in their last tokens' image.
# A prompt given as embeddings has no digest: it is never pulled.

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


# ---- KV digest ----
# Opt-in integrity check of pulled KV (``verify_kv``): one xxh3-64 digest per (block, KV head),
# over that head's bytes in every layer, in the prefill's layer order.
#
# Per head, not per block: a decode rank of another TP size reads a span of a block's heads, and
# checks exactly the heads it read. The prefill digests a request's blocks when it starts holding
# them (the request finished: its KV is final); the decode digests its copy after each read batch. A
# mismatch is a load error for that batch and the rest of the request (vLLM recomputes them).

# (layer index, block id, head) -> the (address, length) runs of that head in that block
HeadRanges = Callable[[int, int, int], Sequence[tuple[int, int]]]


def _xxh3():
    try:
        import xxhash
    except ImportError as exc:
        raise ImportError("verify_kv needs xxhash: pip install 'kv-mooncake[verify]'") from exc
    return xxhash.xxh3_64


def head_digests(ranges: HeadRanges, layers: Sequence[int], block: int, heads: Sequence[int]) -> list[int]:
    """Digest of each head in ``heads`` of ``block``, over ``layers`` in that order."""
    xxh3 = _xxh3()
    out = []
    for head in heads:
        h = xxh3()
        for li in layers:
            for address, length in ranges(li, block, head):
                h.update((ctypes.c_char * length).from_address(address))
        out.append(h.intdigest())
    return out
