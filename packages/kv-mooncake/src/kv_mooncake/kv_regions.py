"""This rank's KV cache as the transfers see it: layers, their tensors' byte layout, block counts.

Pure descriptions and address arithmetic (no sockets, no engine): the prefill holder and the decode
puller both address the same ``LocalCache``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kv_common.kv_cache_groups import KVGroup, UnsupportedKVGroup, kv_groups, refuse_state_groups
from kv_common.kv_layout import KVPart, LayoutError, head_span_runs, infer_roles, layout_name


@dataclass
class LocalCache:
    """This rank's registered KV cache, as the pull arithmetic needs it.

    ``parts``: per layer, its KV tensors (``kv_common.kv_layout``); without it (raw regions, tests and
    benchmarks) each layer is one region of ``num_blocks`` blocks of ``block_bytes``, heads
    contiguous inside a block. ``num_blocks`` counts the tensor's (kernel) blocks; a logical block
    id ``b`` is kernel blocks ``b*kernel_blocks_per_block ...`` (vLLM may split a block for its
    attention kernel).
    """

    layer_names: list[str]
    base_addresses: list[int]
    block_bytes: list[int]
    num_blocks: int
    heads_on_rank: int
    parts: list[list[KVPart]] | None = None
    kernel_blocks_per_block: int = 1
    layout: str = "raw:[blocks,heads,bytes]"
    # KV-cache group of each layer (vLLM's hybrid manager: a group per attention kind, each with its
    # own block table); None: every layer in group 0.
    layer_groups: list[int] | None = None

    def group_of(self, li: int) -> int:
        return self.layer_groups[li] if self.layer_groups is not None else 0

    def layer_parts(self, li: int) -> list[KVPart]:
        if self.parts is not None:
            return self.parts[li]
        per_head = self.block_bytes[li] // self.heads_on_rank
        return [KVPart(base=self.base_addresses[li], shape=(self.num_blocks, self.heads_on_rank, per_head),
                       strides=(self.block_bytes[li], per_head, 1), element_size=1,
                       roles=("block", "head", "dim"))]

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) to register with the TransferEngine, each region once: vLLM's hybrid
        manager lets one layer of each KV-cache group share a tensor."""
        spans: dict[int, int] = {}
        for li in range(len(self.layer_names)):
            for part in self.layer_parts(li):
                spans[part.base] = max(spans.get(part.base, 0), part.span_bytes())
        return list(spans.items())


def _parts_of(name: str, value: Any, heads: int, head_size: int, use_mla: bool) -> list[KVPart]:
    tensors = list(value) if isinstance(value, (list, tuple)) else [value]
    parts = []
    for t in tensors:
        roles = infer_roles(tuple(int(x) for x in t.shape), heads, head_size, use_mla)
        parts.append(KVPart(base=int(t.data_ptr()), shape=tuple(int(x) for x in t.shape),
                            strides=tuple(int(x) for x in t.stride()), element_size=int(t.element_size()),
                            roles=roles))
    return parts


def describe_kv_caches(
    kv_caches: dict[str, Any],
    *,
    heads_on_rank: int | None = None,
    head_size: int | None = None,
    use_mla: bool = False,
    block_size: int | None = None,
) -> tuple[LocalCache, dict[str, int]]:
    """Describe each layer's KV tensor(s) in any layout ``kv_common.kv_layout.infer_roles`` knows (the CPU
    ``[num_blocks, heads, block_size, 2*head_size]``, CUDA, FlashInfer, separate K and V, MLA).

    ``block_size`` is the logical (scheduler) block size per rank; the tensor's block may be
    smaller (vLLM's kernel block), never larger. Without ``heads_on_rank`` / ``head_size`` only the
    CPU layout is read (heads and head size from its shape)."""
    names = list(kv_caches)
    if not names:
        raise ValueError("MooncakeConnectorV1: no KV cache tensors to register")
    first = kv_caches[names[0]]
    first = first[0] if isinstance(first, (list, tuple)) else first
    if heads_on_rank is None or head_size is None:
        if first.dim() != 4 or use_mla:
            raise ValueError(
                f"MooncakeConnectorV1: unsupported KV cache shape {tuple(first.shape)} for layer {names[0]} "
                "(expected [num_blocks, kv_heads, block_size, 2*head_size])"
            )
        heads_on_rank, head_size = int(first.shape[1]), int(first.shape[3]) // 2
    try:
        parts = [_parts_of(n, kv_caches[n], heads_on_rank, head_size, use_mla) for n in names]
    except LayoutError as exc:
        raise ValueError(f"MooncakeConnectorV1: {exc}") from exc
    ref = parts[0]
    for name, layer in zip(names, parts):
        if [(p.shape, p.strides, p.roles, p.element_size) for p in layer] != \
                [(p.shape, p.strides, p.roles, p.element_size) for p in ref]:
            raise ValueError(f"MooncakeConnectorV1: layer {name} differs in KV layout from layer {names[0]}")
        if any(p.num_blocks != ref[0].num_blocks for p in layer):
            raise ValueError(f"MooncakeConnectorV1: layer {name}: its K and V tensors differ in blocks")
    kernel_block = ref[0].size("token")
    logical = block_size or kernel_block
    if logical % kernel_block or ref[0].num_blocks % (logical // kernel_block):
        raise ValueError(
            f"MooncakeConnectorV1: KV tensor blocks of {kernel_block} tokens ({ref[0].num_blocks} of them) do "
            f"not tile logical blocks of block_size={logical}"
        )
    cache = LocalCache(
        layer_names=names,
        base_addresses=[layer[0].base for layer in parts],
        block_bytes=[layer[0].block_stride_bytes for layer in parts],
        num_blocks=ref[0].num_blocks,
        heads_on_rank=1 if use_mla else heads_on_rank,
        parts=parts,
        kernel_blocks_per_block=logical // kernel_block,
        layout=layout_name(ref),
    )
    return cache, {"block_size": logical, "kernel_block_size": kernel_block, "head_size": head_size,
                   "num_layers": len(names)}


SERVED_GROUP_KINDS = ("full", "sliding_window", "chunked_local")


def check_kv_cache_groups(kv_cache_config: Any) -> tuple[KVGroup, ...]:
    """The KV-cache groups this connector moves (empty without a config: one group, every layer).

    Full-attention, sliding-window and chunked-local groups are served, each layer through its own group's block
    ids. State groups (Mamba and kin: a request's state, not token blocks) are refused at start-up,
    as are groups the pull plan has no rule for, and groups of different block sizes (one block
    count covers a prompt in every group)."""
    if kv_cache_config is None:
        return ()
    groups = kv_groups(kv_cache_config)
    refuse_state_groups(groups, "MooncakeConnectorV1")
    configured = len(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) != configured:  # vLLM's block-id tuples still count every group: positions would shift
        raise UnsupportedKVGroup(f"MooncakeConnectorV1: {configured - len(groups)} of {configured} KV-cache "
                                 "groups are not transferable (enable_kv_transfer=False)")
    for group in groups:
        if group.kind not in SERVED_GROUP_KINDS:
            raise UnsupportedKVGroup(
                f"MooncakeConnectorV1: KV-cache group {group.index} is {group.kind} ({group.spec_name}, layers "
                f"{', '.join(group.layer_names)}); it moves {' and '.join(SERVED_GROUP_KINDS)} groups only")
    sizes = {group.block_size for group in groups}
    if len(sizes) > 1:
        raise UnsupportedKVGroup(
            "MooncakeConnectorV1: KV-cache groups of different block sizes ("
            + ", ".join(f"group {g.index} {g.kind}: {g.block_size}" for g in groups)
            + "); it moves groups of one block size")
    return groups


def head_ranges(cache: LocalCache, li: int, block: int, head: int) -> list[tuple[int, int]]:
    """(address, length) runs of one KV head of logical ``block`` in layer ``li`` of ``cache``."""
    k = cache.kernel_blocks_per_block
    out: list[tuple[int, int]] = []
    for part in cache.layer_parts(li):
        step = part.stride("block") * part.element_size
        runs = head_span_runs(part, head, 1)
        for kernel_block in range(block * k, (block + 1) * k):
            start = part.base + kernel_block * step
            out.extend((start + offset, length) for offset, length in runs)
    return out
