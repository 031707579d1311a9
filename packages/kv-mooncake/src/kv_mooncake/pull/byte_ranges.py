"""Which byte ranges a pull reads: the peer's parts against this rank's, pair by pair, merged into
runs, in Python or (from ``ARRAY_MIN_BLOCK_LAYERS`` blocks x layers) with numpy arrays.

The byte ranges of a large pull as numpy arrays: pure arithmetic, no torch, no sockets.

``transfer_ranges`` walks every layer, block, KV tensor, head span, kernel block and
byte run in Python: about 2.9 us per transfer (issue 25), milliseconds for a pull of many layers
and blocks. Here the same ranges, in the same order and merged the same way (a range contiguous
with the one before it on both sides becomes one transfer), are computed a layer and a head span
at a time over all blocks at once. ``transfer_ranges`` stays the definition (and the path for
small pulls, where numpy's per-call cost is larger than the loop); tests hold this one to it.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

from kv_common.kv_cache_groups import NULL_BLOCK_ID
from kv_common.kv_layout import KVPart, LayoutError

from kv_mooncake.errors import PlanError, PullFailed
from kv_mooncake.kv_regions import LocalCache
from kv_mooncake.params import RemoteSource
from kv_mooncake.step import PullRequest
from kv_mooncake.wire import messages as P

try:
    import numpy as np
except ImportError:  # vLLM brings numpy; without it the Python path serves
    np = None  # type: ignore[assignment]

ARRAY_MIN_BLOCK_LAYERS = 64  # blocks x layers from which numpy computes a pull's ranges


# ---- byte ranges of a pull (pure: the handshake and this rank's cache in, addresses out) ----------
def remote_parts(hs: P.HandshakeReply) -> list[list[KVPart]]:
    """The prefill rank's KV tensors per layer, as its handshake describes them."""
    if not hs.parts:  # raw regions (tests, benchmarks): heads contiguous inside a block
        raw = LocalCache(hs.layer_names, hs.base_addresses, hs.block_bytes, hs.num_blocks, hs.heads_on_rank)
        return [raw.layer_parts(i) for i in range(len(hs.layer_names))]
    try:
        return [[KVPart(base=p.base, shape=tuple(p.shape), strides=tuple(p.strides),
                        element_size=p.element_size, roles=tuple(p.roles)) for p in layer]
                for layer in hs.parts]
    except LayoutError as exc:
        raise PullFailed(f"malformed KV layout from the prefill: {exc}") from exc


def check_peer(cache: LocalCache, source: RemoteSource, hs: P.HandshakeReply) -> None:
    """The plan was made from kv_transfer_params: the prefill must really be laid out that way."""
    said = (source.tp_size, source.pcp_size, source.dcp_size, source.pp_size)
    has = (hs.tp_size, hs.pcp_size, hs.dcp_size, hs.pp_size or 1)  # no pp_size: a peer from before PP
    if said != has:
        raise PullFailed(f"kv_transfer_params say the prefill runs TP/PCP/DCP/PP {said}, it runs {has}")
    if hs.kernel_blocks_per_block != cache.kernel_blocks_per_block or len(hs.parts or hs.layer_names) \
            != len(hs.layer_names):
        raise PullFailed(f"kernel blocks per block: decode {cache.kernel_blocks_per_block}, "
                         f"prefill {hs.kernel_blocks_per_block}")


def no_null_blocks(req: PullRequest) -> None:
    """With several KV-cache groups, vLLM's null block (id 0) stands for a sliding window's dropped
    blocks: a block to pull must be a real one on both sides, else its KV is gone (or would land in
    the null block, which every request shares)."""
    groups, remote = req.blocks_by_group, req.source.block_ids_by_group
    if not (len(groups) == len(remote) == len(req.local_block_ids)):
        raise PlanError(f"KV-cache groups: {len(groups)} planned, the decode has {len(req.local_block_ids)} "
                        f"block lists, the prefill sent {len(remote)}")
    for g, blocks in enumerate(groups):
        for side, ids in (("prefill", remote[g]), ("decode", req.local_block_ids[g])):
            if len(ids) < blocks.end:
                raise PlanError(f"KV-cache group {g}: the {side} has {len(ids)} blocks, {blocks.end} needed")
            if NULL_BLOCK_ID in ids[max(0, blocks.first):blocks.end]:
                raise PlanError(f"KV-cache group {g}: the {side}'s blocks {blocks.first}..{blocks.end - 1} "
                                "include vLLM's null block (a block its sliding window dropped)")


def transfer_ranges(cache: LocalCache, hs: P.HandshakeReply, req: PullRequest, pull: Any,
                    paired_runs: PairedRuns, layers: Sequence[str] | None = None,
                    use_arrays: bool | None = None) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths) of ``pull``: every layer (of ``layers``, the
    pipeline stage's, when given; matched by name on both sides), every KV tensor of it,
    every logical block (each of its kernel blocks), every head span; ranges contiguous on both
    sides are merged. ``paired_runs(local part, remote part, span)``: the byte runs of a head span
    inside one block, paired between the two layouts. Only the layers of the pull's KV-cache group
    move, each addressed through that group's block lists. The same with numpy (``use_arrays``; by
    default for pulls of many blocks and layers): ``pull.byte_ranges``, held to this loop by tests."""
    check_peer(cache, req.source, hs)
    rparts_by_layer = remote_parts(hs)
    remote_groups = req.source.block_ids_by_group
    if not (pull.group < len(req.local_block_ids) and pull.group < len(remote_groups)):
        raise PullFailed(f"KV-cache group {pull.group}: the decode has {len(req.local_block_ids)} block lists, "
                         f"the prefill sent {len(remote_groups)}")
    local_ids = req.local_block_ids[pull.group]
    remote_ids = remote_groups[pull.group]
    if use_arrays is None:  # numpy comes with vLLM; kv-mooncake itself does not require it
        use_arrays = len(pull.blocks) * len(cache.layer_names) >= ARRAY_MIN_BLOCK_LAYERS and _have_numpy()
    if use_arrays:
        from kv_mooncake.pull.byte_ranges import transfer_ranges_arrays

        wanted = set(cache.layer_names if layers is None else layers)
        in_group = [li for li, name in enumerate(cache.layer_names)
                    if name in wanted and cache.group_of(li) == pull.group]
        return transfer_ranges_arrays([cache.layer_names[li] for li in in_group],
                                      lambda i: cache.layer_parts(in_group[i]), hs.layer_names, rparts_by_layer,
                                      remote_ids, local_ids, pull, cache.kernel_blocks_per_block, paired_runs)
    remote_index = {name: i for i, name in enumerate(hs.layer_names)}
    ratio = cache.kernel_blocks_per_block
    local: list[int] = []
    remote: list[int] = []
    lengths: list[int] = []
    local_index = {name: i for i, name in enumerate(cache.layer_names)}
    for name in cache.layer_names if layers is None else layers:
        li, ri = local_index[name], remote_index.get(name)
        if cache.group_of(li) != pull.group:
            continue
        if ri is None:
            raise PullFailed(f"layer {name} missing on the prefill")
        lparts, rparts = cache.layer_parts(li), rparts_by_layer[ri]
        if len(lparts) != len(rparts):
            raise PullFailed(f"layer {name}: {len(lparts)} KV tensors here vs {len(rparts)} on the prefill")
        for src_pos, dst_pos in pull.blocks:
            if src_pos >= len(remote_ids) or dst_pos >= len(local_ids):
                raise PullFailed(f"block position {src_pos}/{dst_pos} outside the request's blocks")
            r_block, l_block = remote_ids[src_pos], local_ids[dst_pos]
            for lp, rp in zip(lparts, rparts):
                if not (r_block >= 0 and (r_block + 1) * ratio <= rp.num_blocks
                        and l_block >= 0 and (l_block + 1) * ratio <= lp.num_blocks):
                    raise PullFailed(f"block id {r_block}/{l_block} outside the KV cache")
                for span in pull.spans:
                    runs = paired_runs(lp, rp, span)
                    for k in range(ratio):  # kernel blocks of the logical block, in order
                        l_base = lp.base + (l_block * ratio + k) * lp.block_stride_bytes
                        r_base = rp.base + (r_block * ratio + k) * rp.block_stride_bytes
                        for lo, ro, n in runs:
                            loc, r = l_base + lo, r_base + ro
                            if lengths and remote[-1] + lengths[-1] == r and local[-1] + lengths[-1] == loc:
                                lengths[-1] += n  # contiguous on both sides: one bigger transfer
                            else:
                                remote.append(r)
                                local.append(loc)
                                lengths.append(n)
    return local, remote, lengths


@functools.cache
def _have_numpy() -> bool:
    return importlib.util.find_spec("numpy") is not None


PairedRuns = Callable[[KVPart, KVPart, Any], list[tuple[int, int, int]]]


def merge_contiguous(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranges in order, each one contiguous with the one before it on both sides joined to it."""
    if len(lengths) == 0:
        return local, remote, lengths
    joins = (local[:-1] + lengths[:-1] == local[1:]) & (remote[:-1] + lengths[:-1] == remote[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return local[starts], remote[starts], np.add.reduceat(lengths, starts)


def _check_blocks(blocks: np.ndarray, ratio: int, num_blocks: int) -> bool:
    return bool(np.all(blocks >= 0) and np.all((blocks + 1) * ratio <= num_blocks))


def _layout_key(pairs: Sequence[tuple[KVPart, KVPart]]) -> tuple:
    """What a layer's ranges depend on besides its tensors' base addresses."""
    return tuple((lp.shape, lp.strides, lp.element_size, lp.roles, rp.shape, rp.strides, rp.element_size, rp.roles)
                 for lp, rp in pairs)


def _pattern(pairs: Sequence[tuple[KVPart, KVPart]], local_blocks: np.ndarray, remote_blocks: np.ndarray,
             spans: Sequence[Any], ratio: int, paired_runs: PairedRuns
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A layer's ranges relative to its tensors' bases, ``[block, column]`` in ``transfer_ranges``'
    order (block, KV tensor, head span, kernel block, byte run), and each column's tensor."""
    count = len(local_blocks)
    kernel: np.ndarray = np.arange(ratio, dtype=np.int64)
    cols: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    for p, (lp, rp) in enumerate(pairs):
        if not (_check_blocks(remote_blocks, ratio, rp.num_blocks) and _check_blocks(local_blocks, ratio, lp.num_blocks)):
            raise PullFailed("block id outside the KV cache")
        l_off = (local_blocks[:, None] * ratio + kernel) * lp.block_stride_bytes  # [block, kernel]
        r_off = (remote_blocks[:, None] * ratio + kernel) * rp.block_stride_bytes
        for span in spans:
            runs = np.asarray(paired_runs(lp, rp, span), dtype=np.int64).reshape(-1, 3)
            shape = (count, ratio, len(runs))
            cols.append(((l_off[:, :, None] + runs[:, 0]).reshape(count, -1),
                         (r_off[:, :, None] + runs[:, 1]).reshape(count, -1),
                         np.broadcast_to(runs[:, 2], shape).reshape(count, -1),
                         np.full(ratio * len(runs), p, dtype=np.int64)))
    if not cols:
        empty: np.ndarray = np.zeros((count, 0), dtype=np.int64)
        return empty, empty, empty, np.zeros(0, dtype=np.int64)
    loc, rem, n = (np.concatenate([c[i] for c in cols], axis=1) for i in range(3))
    return loc, rem, n, np.concatenate([c[3] for c in cols])


def pull_ranges(layers: Sequence[Sequence[tuple[KVPart, KVPart]]], local_blocks: Sequence[int],
                remote_blocks: Sequence[int], spans: Sequence[Any], ratio: int, paired_runs: PairedRuns
                ) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths) of a pull: every layer (``layers``: its
    (local, remote) KV tensors) of the blocks ``local_blocks[i] <- remote_blocks[i]``, merged.
    Consecutive layers laid out alike (all of them, in most models) share one pattern, shifted by
    each layer's base addresses."""
    lb = np.asarray(local_blocks, dtype=np.int64)
    rb = np.asarray(remote_blocks, dtype=np.int64)
    out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    start = 0
    while start < len(layers):
        key = _layout_key(layers[start])
        end = start + 1
        while end < len(layers) and _layout_key(layers[end]) == key:
            end += 1
        group = layers[start:end]
        loc, rem, n, col_part = _pattern(group[0], lb, rb, spans, ratio, paired_runs)
        l_bases = np.array([[lp.base for lp, _ in pairs] for pairs in group], dtype=np.int64)[:, col_part]
        r_bases = np.array([[rp.base for _, rp in pairs] for pairs in group], dtype=np.int64)[:, col_part]
        out.append(((loc[None] + l_bases[:, None, :]).ravel(), (rem[None] + r_bases[:, None, :]).ravel(),
                    np.broadcast_to(n[None], (len(group), *n.shape)).ravel()))
        start = end
    if not out:
        return [], [], []
    local, remote, lengths = merge_contiguous(*(np.concatenate([o[i] for o in out]) for i in range(3)))
    return local.tolist(), remote.tolist(), lengths.tolist()


def transfer_ranges_arrays(local_layers: Sequence[str], local_parts: Callable[[int], list[KVPart]],
                           remote_layers: Sequence[str], remote_parts: Sequence[list[KVPart]],
                           remote_ids: Sequence[int], local_ids: Sequence[int], pull: Any, ratio: int,
                           paired_runs: PairedRuns) -> tuple[list[int], list[int], list[int]]:
    """``transfer_ranges`` of ``pull`` (its blocks are positions in ``remote_ids`` /
    ``local_ids``), checked alike: a layer or block the other side lacks fails the pull."""
    remote_index = {name: i for i, name in enumerate(remote_layers)}
    layers = []
    for li, name in enumerate(local_layers):
        ri = remote_index.get(name)
        if ri is None:
            raise PullFailed(f"layer {name} missing on the prefill")
        lparts, rparts = local_parts(li), remote_parts[ri]
        if len(lparts) != len(rparts):
            raise PullFailed(f"layer {name}: {len(lparts)} KV tensors here vs {len(rparts)} on the prefill")
        layers.append(list(zip(lparts, rparts)))
    positions = np.asarray(pull.blocks, dtype=np.int64).reshape(-1, 2)
    if len(positions) and (positions[:, 0].max() >= len(remote_ids) or positions[:, 1].max() >= len(local_ids)
                           or positions.min() < 0):
        raise PullFailed("block position outside the request's blocks")
    remote_blocks = np.asarray(remote_ids, dtype=np.int64)[positions[:, 0]]
    local_blocks = np.asarray(local_ids, dtype=np.int64)[positions[:, 1]]
    return pull_ranges(layers, local_blocks.tolist(), remote_blocks.tolist(), pull.spans, ratio, paired_runs)
