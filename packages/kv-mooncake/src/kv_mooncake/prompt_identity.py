"""A digest of a prompt's token ids: the decode pulls a prefill's KV only for the prompt it computed.

Pure functions, no torch. The prefill sends the digest in ``kv_transfer_params``; the decode
computes it over its own prompt and pulls nothing when the two differ (a proxy or chat-template
difference with the same number of blocks would otherwise load the wrong KV, silently).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable

PARAM_KEY = "prompt_digest"
_VERSION = "t1"  # bump when the encoding changes: an old peer's digest then never matches


def prompt_digest(token_ids: Iterable[int]) -> str:
    """``t1:`` + 32 hex digits of BLAKE2b over the token ids as little-endian int64."""
    data = array("q", (int(t) for t in token_ids))
    if sys.byteorder != "little":
        data.byteswap()
    return f"{_VERSION}:{hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()}"


def same_prompt(sent: str | None, token_ids: Iterable[int] | None) -> bool:
    """``sent``: the digest in the prefill's params. False also when the prefill sent none: an
    unverifiable source is not trusted."""
    return isinstance(sent, str) and token_ids is not None and sent == prompt_digest(token_ids)
