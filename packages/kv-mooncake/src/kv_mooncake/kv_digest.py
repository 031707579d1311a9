"""Opt-in integrity check of pulled KV (``verify_kv``): one xxh3-64 digest per (block, KV head),
over that head's bytes in every layer, in the prefill's layer order.

Per head, not per block: a decode rank of another TP size reads a span of a block's heads, and
checks exactly the heads it read. The prefill digests a request's blocks when it starts holding
them (the request finished: its KV is final); the decode digests its copy after each read batch. A
mismatch is a load error for that batch and the rest of the request (vLLM recomputes them).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

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
