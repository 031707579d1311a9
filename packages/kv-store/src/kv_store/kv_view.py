"""The paged KV cache as whole blocks: which bytes of each layer a block id names, and block copies
between the cache and staging rows (``CacheBuffers``: the cache with one role's staging rows and
trailers).

- Layout: a value copies whole blocks, so each block must be one contiguous run of bytes with
  blocks outermost (``kv_common.kv_layout.whole_block_bytes``). The block dimension is found by
  ``infer_roles`` from the KV heads on this rank and the head size (vLLM 0.32's CPU layout
  ``[num_blocks, num_kv_heads, block_size, 2*head_size]``, FlashInfer's, MLA's ...); without them,
  by its stride (the largest). Older vLLM's CUDA ``[2, num_blocks, ...]`` is refused: there a
  block's K and V lie half a tensor apart, and ``shape[0]`` would count 2 "blocks".
- Devices: every access to KV memory goes through ``kv_common.device``. KV caches in host memory
  (CPU) are read and written in place as bytes; on cuda / npu the blocks are gathered into pinned
  host staging (and scattered back) by the device's copy engine, and the copy's event is waited
  for before a host buffer is read, reused or handed to a backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from kv_common import device
from kv_common.kv_layout import ROLES, KVPart, LayoutError, infer_roles, whole_block_bytes

from kv_store import codec
from kv_store.metadata import BlockTransfer
from kv_store.staging import Staging, TrailerArea

# Host KV: a run of at least this many consecutive block ids moves as one torch copy per layer (its
# intra-op threads share it, no Python per block); a shorter run a block at a time (a torch call
# costs more than one block's copy). Measured, 64 MiB of 128 KiB values on 2 cores, per-block
# copies 5.7-6.5 ms against torch copies of runs of 1 / 2 / 4 / 16 / 512 blocks: 12.3 / 7.6 / 5.3 /
# 3.7 / 3.1 ms.
MIN_RUN_BLOCKS = 4


def id_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``ids`` cut into runs of consecutive block ids: (position in ``ids``, first id, length)."""
    runs = []
    start = 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or ids[j] != ids[j - 1] + 1:
            runs.append((start, ids[start], j - start))
            start = j
    return runs


@dataclass(frozen=True)
class KVHeads:
    """What ``infer_roles`` needs to name a KV tensor's dimensions (from vLLM's model config)."""

    kv_heads: int  # on this rank
    head_size: int
    use_mla: bool = False


@dataclass
class KVLayer:
    name: str
    blocks: torch.Tensor  # uint8 view [num_blocks, bytes_per_block]
    offset: int  # where this layer's bytes start inside a value
    nbytes: int
    group: int
    flat: memoryview | None = None  # the layer's whole KV tensor as bytes (host KV only)
    address: int = 0  # where ``flat`` starts in host memory (host KV only)

    def block(self, block_id: int) -> memoryview:
        assert self.flat is not None
        return self.flat[block_id * self.nbytes : (block_id + 1) * self.nbytes]


def _roles_by_stride(strides: Sequence[int]) -> tuple[str, ...]:
    """Heads unknown: the largest-stride dimension is the block (the first on a tie); the others
    only need distinct names for ``whole_block_bytes``."""
    block = max(range(len(strides)), key=lambda i: (strides[i], -i))
    others = iter(r for r in ROLES if r != "block")
    try:
        return tuple("block" if i == block else next(others) for i in range(len(strides)))
    except StopIteration:
        raise LayoutError(f"KV tensor with strides {tuple(strides)}: more dimensions than {ROLES}") from None


def block_count(name: str, tensor: torch.Tensor, heads: KVHeads | None) -> int:
    """Blocks in ``tensor``; ``LayoutError`` (naming the shape) unless ``[blocks, bytes]`` is a view
    of it."""
    shape = tuple(int(x) for x in tensor.shape)
    if not tensor.is_contiguous():
        raise LayoutError(f"KV cache of layer {name} (shape {shape}) is not contiguous: cannot move whole blocks")
    strides = tuple(int(s) for s in tensor.stride())
    try:
        roles = (_roles_by_stride(strides) if heads is None
                 else infer_roles(shape, heads.kv_heads, heads.head_size, heads.use_mla))
        part = KVPart(base=0, shape=shape, strides=strides, element_size=tensor.element_size(), roles=roles)
        whole_block_bytes(part)
    except LayoutError as exc:
        raise LayoutError(f"KV cache of layer {name}: {exc}") from exc
    return part.num_blocks


class KVBlockView:
    """Each layer's KV cache as ``[num_blocks, bytes]``; a value is one block of every layer in
    registration order, then the trailer."""

    def __init__(self, layers: list[KVLayer], host_kv: bool, kv_device: object) -> None:
        self.layers = layers
        self.host_kv = host_kv
        self.kv_device = kv_device
        self.payload_size = sum(layer.nbytes for layer in layers)
        self.value_size = self.payload_size + codec.TRAILER_SIZE

    @classmethod
    def of(
        cls, kv_caches: dict[str, torch.Tensor], *, layer_groups: dict[str, int], host_kv: bool | None,
        heads: KVHeads | None,
    ) -> KVBlockView:
        """``host_kv``: whether to read the caches in place as host bytes (None: when they are host
        memory; False forces the device copy path)."""
        tensors = list(kv_caches.values())
        kv_device = tensors[0].device if tensors else "cpu"
        auto_host = all(device.is_host(t) for t in tensors)
        in_place = auto_host if host_kv is None else (host_kv and auto_host)
        layers: list[KVLayer] = []
        offset = 0
        num_blocks = None
        for name, tensor in kv_caches.items():
            n = block_count(name, tensor, heads)
            if num_blocks is None:
                num_blocks = n
            elif n != num_blocks:
                raise ValueError(f"layer {name} has {n} blocks, others {num_blocks}")
            blocks = tensor.view(torch.uint8).reshape(n, -1)
            flat = device.host_bytes(blocks) if in_place else None  # host: blocks move as memcpy
            address = device.data_ptr(blocks) if in_place else 0
            layers.append(KVLayer(name, blocks, offset, blocks.shape[1], layer_groups.get(name, 0), flat, address))
            offset += blocks.shape[1]
        return cls(layers, in_place, kv_device)

    def host_buffers(self) -> list[memoryview]:
        """Host KV: each layer's KV tensor as bytes, a tensor that layers share once (to register
        with a backend)."""
        seen: set[tuple[int, int]] = set()
        buffers = []
        for layer in self.layers:
            span = (device.data_ptr(layer.blocks), layer.blocks.numel())
            if span not in seen:  # layers may share one allocation
                seen.add(span)
                assert layer.flat is not None  # host KV: every layer has one
                buffers.append(layer.flat)
        return buffers

    def block_parts(self, transfer: BlockTransfer, i: int, trailer: memoryview) -> list[memoryview]:
        """Block ``i`` of ``transfer`` as a parts value: its slice of every layer, then ``trailer``."""
        return [layer.block(transfer.block_ids[layer.group][i]) for layer in self.layers] + [trailer]

    def part_rows(self, transfer: BlockTransfer, lo: int, hi: int,
                  trailer_addresses: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Blocks ``lo:hi`` of ``transfer`` as the addresses and sizes of their parts (the bytes
        ``block_parts`` names: each layer's slice, then the trailer at ``trailer_addresses[k]``),
        by arithmetic on each layer's start: taking a buffer's address costs ~1 us a part, 2.5 ms
        per 64 MiB of 128 KiB values in 4 layers. ``IndexError`` for a block id outside the cache:
        no address is ever derived past a layer's end."""
        import numpy as np  # a backend that takes addresses (Mooncake's extra) brings it

        if not self.host_kv:
            raise ValueError("part addresses exist for host KV only")
        if len(trailer_addresses) != hi - lo:
            raise ValueError(f"{len(trailer_addresses)} trailer addresses for {hi - lo} blocks")
        ids_of: dict[int, Any] = {}
        columns = []
        for layer in self.layers:
            ids = ids_of.get(layer.group)
            if ids is None:
                ids = ids_of[layer.group] = np.asarray(transfer.block_ids[layer.group][lo:hi], dtype=np.int64)
                if len(ids) != hi - lo:
                    raise IndexError(f"group {layer.group} has {len(ids)} block ids for blocks {lo}:{hi}")
                # every layer has the same number of blocks (``of``)
                if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= layer.blocks.shape[0]):
                    raise IndexError(f"a block id outside the cache's {layer.blocks.shape[0]} blocks")
            columns.append(layer.address + ids * layer.nbytes)
        columns.append(np.asarray(trailer_addresses, dtype=np.int64))
        sizes = [layer.nbytes for layer in self.layers] + [codec.TRAILER_SIZE]
        return np.stack(columns, axis=1).tolist(), [sizes] * (hi - lo)

    def gather(self, staging: Staging, transfer: BlockTransfer, lo: int, hi: int, row: int = 0) -> None:
        """Blocks ``lo:hi`` of ``transfer`` into staging rows ``row:row+hi-lo``; the rows are ready
        to read when this returns (a device copy is waited for)."""
        events = []
        for layer in self.layers:
            ids = transfer.block_ids[layer.group][lo:hi]
            if not self.host_kv:
                rows = staging.rows[row : row + hi - lo, layer.offset : layer.offset + layer.nbytes]
                events.append(device.gather_rows(rows, layer.blocks, list(ids)))
                continue
            _host_copies(layer, ids, staging, row, into_kv=False)
        for event in events:
            device.wait_event(event)

    def scatter(self, staging: Staging, transfer: BlockTransfer, row: int, lo: int, hi: int) -> None:
        """Blocks ``lo:hi`` of ``transfer`` from staging rows ``row+lo:row+hi`` (the rows its fetch
        used) into every layer; staging may be reused on return."""
        if hi <= lo:
            return
        for layer in self.layers:
            ids = transfer.block_ids[layer.group][lo:hi]
            if not self.host_kv:
                rows = staging.rows[row + lo : row + hi, layer.offset : layer.offset + layer.nbytes]
                device.wait_event(device.scatter_rows(layer.blocks, list(ids), rows))
                continue
            _host_copies(layer, ids, staging, row + lo, into_kv=True)


@dataclass(frozen=True)
class CacheBuffers:
    """The registered KV cache and one role's buffers: its staging rows and, on the zero-copy
    parts path, its trailer area (None: staging path)."""

    view: KVBlockView
    staging: Staging
    trailers: TrailerArea | None


def _host_copies(layer: KVLayer, ids: Sequence[int], staging: Staging, row: int, *, into_kv: bool) -> None:
    """Host KV: block ``ids[k]`` of ``layer`` to (``into_kv`` False) or from staging row ``row + k``;
    a run of ``MIN_RUN_BLOCKS`` consecutive ids or more as one torch copy, the others a block at a time."""
    rows = staging.rows[row : row + len(ids), layer.offset : layer.offset + layer.nbytes]
    view, vs = staging.view, staging.value_size
    for pos, first, count in id_runs(ids):
        if count >= MIN_RUN_BLOCKS:
            kv, staged = layer.blocks[first : first + count], rows[pos : pos + count]
            (kv if into_kv else staged).copy_(staged if into_kv else kv)
            continue
        for k in range(count):
            start = (row + pos + k) * vs + layer.offset
            if into_kv:
                layer.block(first + k)[:] = view[start : start + layer.nbytes]
            else:
                view[start : start + layer.nbytes] = layer.block(first + k)
