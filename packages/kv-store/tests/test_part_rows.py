"""Parts by address: ``KVBlockView.part_rows`` names exactly the bytes ``block_parts`` names, and
never an address outside the KV cache or the trailer area."""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")

from kv_store import codec  # noqa: E402
from kv_store.kv_view import KVBlockView  # noqa: E402
from kv_store.metadata import BlockTransfer  # noqa: E402
from kv_store.staging import TrailerArea  # noqa: E402

BLOCKS = 16


def address_of(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def hybrid_view() -> KVBlockView:
    """Three layers in two KV cache groups (a hybrid model's layout: block ids per group)."""
    caches = {f"layer{i}": torch.zeros(BLOCKS, 2, 4, 8) for i in range(3)}
    return KVBlockView.of(caches, layer_groups={"layer0": 0, "layer1": 1, "layer2": 0}, host_kv=None, heads=None)


def test_part_rows_name_the_bytes_block_parts_names():
    view = hybrid_view()
    trailers = TrailerArea(memoryview(bytearray(8 * codec.TRAILER_SIZE)))
    transfer = BlockTransfer(request_id="r", block_hashes=[b"h"] * 5, block_ids=[[3, 4, 9, 0, 15], [7, 2, 2, 11, 5]])
    for lo, hi, first in ((0, 5, 0), (1, 4, 4), (2, 2, 0)):
        addresses, sizes = view.part_rows(transfer, lo, hi, trailers.addresses(first, hi - lo))
        assert len(addresses) == len(sizes) == hi - lo
        for k, i in enumerate(range(lo, hi)):
            parts = view.block_parts(transfer, i, trailers[first + k])
            assert addresses[k] == [address_of(p) for p in parts]
            assert sizes[k] == [len(p) for p in parts]


@pytest.mark.parametrize("bad", [BLOCKS, -1, 10 * BLOCKS])
def test_part_rows_refuse_block_ids_outside_the_cache(bad):
    view = hybrid_view()
    trailers = TrailerArea(memoryview(bytearray(4 * codec.TRAILER_SIZE)))
    transfer = BlockTransfer(request_id="r", block_hashes=[b"h"] * 2, block_ids=[[1, 2], [3, bad]])
    with pytest.raises(IndexError):
        view.part_rows(transfer, 0, 2, trailers.addresses(0, 2))
    # the blocks before it are fine on their own
    assert len(view.part_rows(transfer, 0, 1, trailers.addresses(0, 1))[0]) == 1


def test_part_rows_need_one_trailer_per_block_and_host_kv():
    view = hybrid_view()
    transfer = BlockTransfer(request_id="r", block_hashes=[b"h"] * 2, block_ids=[[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="trailer"):
        view.part_rows(transfer, 0, 2, [0])
    device_path = KVBlockView.of({"layer0": torch.zeros(BLOCKS, 2, 4, 8)}, layer_groups={}, host_kv=False, heads=None)
    with pytest.raises(ValueError, match="host KV"):
        device_path.part_rows(transfer, 0, 1, [0])


def test_trailer_addresses_stay_inside_the_area():
    area = TrailerArea(memoryview(bytearray(4 * codec.TRAILER_SIZE)))
    assert area.addresses(1, 3) == [address_of(area[i]) for i in (1, 2, 3)]
    for first, n in ((3, 2), (-1, 1), (4, 1)):
        with pytest.raises(ValueError, match="outside"):
            area.addresses(first, n)
    assert area.addresses(4, 0) == []
