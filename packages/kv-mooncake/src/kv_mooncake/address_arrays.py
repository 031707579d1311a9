"""The byte ranges of a large pull as numpy arrays: pure arithmetic, no torch, no sockets.

``decode_puller.transfer_ranges`` walks every layer, block, KV tensor, head span, kernel block and
byte run in Python: about 2.9 us per transfer (issue 25), milliseconds for a pull of many layers
and blocks. Here the same ranges, in the same order and merged the same way (a range contiguous
with the one before it on both sides becomes one transfer), are computed a layer and a head span
at a time over all blocks at once. ``transfer_ranges`` stays the definition (and the path for
small pulls, where numpy's per-call cost is larger than the loop); tests hold this one to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kv_common.kv_layout import KVPart

from kv_mooncake.pull_errors import PullFailed

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
    """``decode_puller.transfer_ranges`` of ``pull`` (its blocks are positions in ``remote_ids`` /
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
