"""The one KV-cache layout model: byte ranges of KV blocks in the tensors vLLM and vllm-ascend hand
a connector. Pure, no torch; used by kv-mooncake's pulls and kv-store's block view alike.

A layer's KV cache is one or more *parts* (one tensor; vllm-ascend hands K and V as two). Each
part is described by its shape, its strides (in elements) and the role of every dimension:

* ``block``  the paged block (kernel block: vLLM may split a logical block into several),
* ``kv``     K or V (size 2) when both live in one tensor on its own axis (vLLM before 0.30),
* ``token``  position inside the block,
* ``head``   KV head held by this rank (absent for MLA: one latent vector per token),
* ``dim``    the head's elements (vLLM 0.32 packs K and V here: ``2*head_size``).

What each engine hands over (checked in vLLM 0.32's ``v1/attention/backends`` and
``v1/kv_cache_layout.py``; vllm-ascend's ``distributed/`` connectors):

=================================  ======================================  =======================
who                                logical shape                           roles
=================================  ======================================  =======================
vLLM 0.32, every attention         ``[blocks, heads, block, 2*head]``      block, head, token, dim
backend (CPU, FlashAttention,      (physical order from ``KVCacheLayout``:
FlashInfer, Triton, FlexAttention) LBHNC as is, LBNHC heads inside tokens;
                                   the strides say which)
vllm-ascend (separate K and V)     two ``[blocks, block, heads, head]``    block, token, head, dim
MLA (vLLM and vllm-ascend)         ``[blocks, block, latent]``             block, token, dim
older vLLM, CUDA flash-attention   ``[2, blocks, block, heads, head]``     kv, block, token, head, dim
older vLLM, FlashInfer             ``[blocks, 2, block, heads, head]``     block, kv, token, head, dim
=================================  ======================================  =======================

Both instances must have the same layout (the handshake compares ``layout_name``), so iterating the
non-block dimensions in physical order enumerates the same logical elements on both sides, even
when they hold different numbers of heads (TP). ``head_span_runs`` turns one (block, head span)
into contiguous byte runs; ``pair_runs`` cuts a local and a remote run list into transfers;
``whole_block_bytes`` says whether a block is one contiguous run (what a store value copies).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

ROLES = ("kv", "block", "token", "head", "dim")


class LayoutError(ValueError):
    """A KV tensor whose layout this connector cannot address (refused at registration)."""


@dataclass(frozen=True)
class KVPart:
    base: int  # address of element [0, 0, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements, all >= 0
    element_size: int
    roles: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.strides) or len(self.shape) != len(self.roles):
            raise LayoutError(f"shape {self.shape}, strides {self.strides} and roles {self.roles} differ in rank")
        if sorted(self.roles) != sorted(set(self.roles)) or not set(self.roles) <= set(ROLES) \
                or "block" not in self.roles:
            raise LayoutError(f"roles {self.roles}: each of {ROLES} at most once, block required")
        if any(s < 0 for s in self.strides):
            raise LayoutError(f"negative strides {self.strides}")

    def size(self, role: str) -> int:
        return self.shape[self.roles.index(role)] if role in self.roles else 1

    def stride(self, role: str) -> int:
        return self.strides[self.roles.index(role)] if role in self.roles else 0

    @property
    def num_blocks(self) -> int:
        return self.size("block")

    @property
    def heads(self) -> int:
        return self.size("head")

    @property
    def block_stride_bytes(self) -> int:
        return self.stride("block") * self.element_size

    def physical_roles(self) -> tuple[str, ...]:
        """Non-block roles, outermost first (largest stride first; ties keep the logical order)."""
        dims = [(self.strides[i], -i, r) for i, r in enumerate(self.roles) if r != "block"]
        return tuple(r for _, _, r in sorted(dims, reverse=True))

    def span_bytes(self) -> int:
        """Bytes from ``base`` to the end of the last element (what to register for transfers)."""
        return (sum((n - 1) * s for n, s in zip(self.shape, self.strides)) + 1) * self.element_size


def layout_name(parts: list[KVPart]) -> str:
    """What the handshake compares: roles in physical order per part (the stride order)."""
    return "|".join("block," + ",".join(p.physical_roles()) for p in parts)


def head_span_runs(part: KVPart, head0: int, num_heads: int) -> list[tuple[int, int]]:
    """(byte offset from the block's start, byte length) of heads ``[head0, head0+num_heads)`` of one
    block, in the logical order shared by both instances, adjacent runs merged."""
    if head0 < 0 or head0 + num_heads > part.heads:
        raise LayoutError(f"heads {head0}..{head0 + num_heads} outside the {part.heads} of this part")
    order = list(part.physical_roles())
    sizes = [num_heads if r == "head" else part.size(r) for r in order]
    strides = [part.stride(r) for r in order]
    # Longest suffix of dimensions that is contiguous in memory: one run.
    run, cut = 1, len(order)
    while cut > 0 and (strides[cut - 1] == run or sizes[cut - 1] == 1):
        run *= sizes[cut - 1]
        cut -= 1
    start = head0 * part.stride("head")
    runs: list[tuple[int, int]] = []
    el = part.element_size
    for idx in itertools.product(*(range(n) for n in sizes[:cut])):
        off = (start + sum(i * s for i, s in zip(idx, strides[:cut]))) * el
        if runs and runs[-1][0] + runs[-1][1] == off:
            runs[-1] = (runs[-1][0], runs[-1][1] + run * el)
        else:
            runs.append((off, run * el))
    return runs


def pair_runs(local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(local offset, remote offset, length): both run lists cut at each other's boundaries."""
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise LayoutError(f"{sum(n for _, n in local)} local bytes vs {sum(n for _, n in remote)} remote "
                          "for the same heads: the layouts differ")
    out: list[tuple[int, int, int]] = []
    i = j = 0
    lo = ro = 0  # bytes consumed of local[i], remote[j]
    while i < len(local) and j < len(remote):
        n = min(local[i][1] - lo, remote[j][1] - ro)
        out.append((local[i][0] + lo, remote[j][0] + ro, n))
        lo += n
        ro += n
        if lo == local[i][1]:
            i, lo = i + 1, 0
        if ro == remote[j][1]:
            j, ro = j + 1, 0
    return out


def infer_roles(shape: tuple[int, ...], heads: int, head_size: int, use_mla: bool) -> tuple[str, ...]:
    """Roles of one KV tensor from its shape, for the layouts vLLM 0.32 and vllm-ascend allocate.

    The logical shape is read (vLLM may permute the physical order: the strides say that), so
    CUDA's ``[2, blocks, block, heads, dim]`` is recognised whatever its stride order."""
    n = len(shape)
    if use_mla:
        if n == 3 and shape[2] >= 1:
            return ("block", "token", "dim")  # [blocks, block_size, kv_lora_rank + rope_dim]
    elif n == 4 and shape[1] == heads and shape[3] == 2 * head_size:
        return ("block", "head", "token", "dim")  # vLLM CPU: K and V rows per (block, head)
    elif n == 4 and shape[2] == heads and shape[3] == head_size:
        return ("block", "token", "head", "dim")  # one of separate K / V tensors (vllm-ascend)
    elif n == 5 and shape[0] == 2 and shape[3] == heads and shape[4] == head_size:
        return ("kv", "block", "token", "head", "dim")  # CUDA flash-attention and most GPU backends
    elif n == 5 and shape[1] == 2 and shape[3] == heads and shape[4] == head_size:
        return ("block", "kv", "token", "head", "dim")  # FlashInfer
    raise LayoutError(
        f"KV cache shape {tuple(shape)} is not a known layout "
        f"({heads} KV heads of size {head_size} on this rank, MLA={use_mla}); known: vLLM 0.32 "
        "[blocks, heads, block, 2*head], separate K and V [blocks, block, heads, head], MLA [blocks, block, dim], "
        "older vLLM [2, blocks, block, heads, head] and FlashInfer [blocks, 2, block, heads, head]"
    )


def whole_block_bytes(part: KVPart) -> int:
    """Bytes of one block when each block is one contiguous run and blocks are the outermost
    dimension (``[blocks, bytes]`` is then a view of the tensor, what a store value copies);
    ``LayoutError`` otherwise (a copy would be read or written instead of the cache)."""
    inner = 1
    for role in part.physical_roles()[::-1]:  # innermost first
        if part.size(role) > 1 and part.stride(role) != inner:
            raise LayoutError(
                f"KV tensor of shape {part.shape}, strides {part.strides} ({','.join(part.roles)}): a block's "
                "bytes are not one contiguous run"
            )
        inner *= part.size(role)
    if part.num_blocks > 1 and part.stride("block") != inner:
        raise LayoutError(
            f"KV tensor of shape {part.shape}, strides {part.strides} ({','.join(part.roles)}): blocks are not "
            "the outermost dimension (each block's bytes are spread over the tensor)"
        )
    return inner * part.element_size
