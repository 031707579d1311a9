"""Numpy byte ranges of a pull (``pull.byte_ranges``): layers laid out alike share one pattern; the
per-block loop of ``pull.puller.transfer_ranges`` is their oracle (``test_kv_layouts``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from kv_common.kv_layout import head_span_runs, pair_runs
from kv_mooncake.errors import PullFailed
from kv_mooncake.kv_regions import LocalCache
from kv_mooncake.pull.byte_ranges import merge_contiguous, pull_ranges
from kv_mooncake.pull.plan import HeadSpan


def _runs(lp, rp, span):
    return pair_runs(head_span_runs(lp, span.dst_head, span.num_heads), head_span_runs(rp, span.src_head, span.num_heads))


def test_merge_joins_ranges_contiguous_on_both_sides_only():
    local = np.array([0, 10, 20, 50, 60])
    remote = np.array([100, 110, 130, 150, 160])
    lengths = np.array([10, 10, 10, 10, 5])
    got = [a.tolist() for a in merge_contiguous(local, remote, lengths)]
    assert got == [[0, 20, 50], [100, 130, 150], [20, 10, 15]]


def test_layers_laid_out_otherwise_are_not_shifted_copies_of_the_first():
    """Alternating layers of two layouts (other heads, other block sizes): the grouped computation
    equals each layer computed alone, in order, then merged."""
    a = LocalCache(["x"] * 1, [1 << 20], [4 * 256], 32, 4).layer_parts(0)  # 4 heads of 256 bytes a block
    b = LocalCache(["x"] * 1, [1 << 24], [2 * 512], 32, 2).layer_parts(0)  # 2 heads of 512 bytes
    layers = []
    for i in range(6):
        lp, rp = (a, a) if i % 3 else (b, b)
        shift = (i + 1) << 28  # each layer its own tensors
        layers.append([(dataclasses.replace(lp[0], base=lp[0].base + shift),
                        dataclasses.replace(rp[0], base=rp[0].base + 2 * shift))])
    spans = [HeadSpan(0, 0, 1)]
    local_blocks, remote_blocks = [3, 4, 5, 9, 1], [7, 8, 9, 2, 30]
    whole = pull_ranges(layers, local_blocks, remote_blocks, spans, 1, _runs)
    alone = [pull_ranges([layer], local_blocks, remote_blocks, spans, 1, _runs) for layer in layers]
    parts = [np.array([x for one in alone for x in one[i]], dtype=np.int64) for i in range(3)]
    assert list(whole) == [p.tolist() for p in merge_contiguous(*parts)]
    with pytest.raises(PullFailed):
        pull_ranges(layers, [3, 32], [7, 8], spans, 1, _runs)  # block 32 of 32
