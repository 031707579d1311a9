"""PosixDiskCap on UCM's Posix file layout (``<backend>/<3 hex>/<32 hex>``), written by hand: runs
without UCM. The same cap over the real UCM store: test_ucm_backend_posix.py."""

from __future__ import annotations

import os
import time

import pytest
from kv_ucm.posix_cap import PosixDiskCap, default_posix_capacity


def write_block(root, i: int, size: int = 1000) -> bytes:
    bid = i.to_bytes(16, "big")
    name = bid.hex()
    (root / name[:3]).mkdir(exist_ok=True)
    (root / name[:3] / name).write_bytes(b"x" * size)
    # distinct mtimes even on coarse file-system clocks
    os.utime(root / name[:3] / name, (1_000_000 + i, 1_000_000 + i))
    return bid


def present(root) -> set[int]:
    return {int(f, 16) for _d, _s, files in os.walk(root) for f in files if not f.startswith(".")}


def test_evicts_least_recently_used_down_to_low_water(tmp_path):
    ids = [write_block(tmp_path, i) for i in range(10)]
    (tmp_path / ".ucm_gc.config").write_text("UCM bookkeeping: never removed")
    cap = PosixDiskCap([tmp_path], 20_000)
    assert cap.used_bytes == 10_000 and cap.evictions == 0
    cap.touch([ids[0]])  # block 0 used now: the newest
    for i in range(10, 20):
        write_block(tmp_path, i)
        cap.wrote(1000)
    assert present(tmp_path) == set(range(20))  # 20 000 bytes: at the cap, not over
    write_block(tmp_path, 20)
    cap.wrote(1000)
    assert cap.used_bytes <= 18_000
    assert present(tmp_path) == {0} | set(range(4, 21))  # 1, 2, 3 were the least recently used
    assert (tmp_path / ".ucm_gc.config").exists()
    assert cap.evictions == 3


def test_blocks_already_there_are_evicted_at_start(tmp_path):
    for i in range(10):
        write_block(tmp_path, i)
    cap = PosixDiskCap([tmp_path], 5_000)
    assert cap.used_bytes <= 4_500 and present(tmp_path) == set(range(6, 10))


def test_other_writers_are_noticed_by_the_periodic_rescan(tmp_path):
    cap = PosixDiskCap([tmp_path], 5_000, rescan_s=0.05)
    for i in range(10):  # written by another instance: this one counted nothing
        write_block(tmp_path, i)
    time.sleep(0.06)
    write_block(tmp_path, 10)
    cap.wrote(1000)
    assert present(tmp_path) == set(range(7, 11))


def test_default_capacity_and_bad_capacity(tmp_path):
    assert 0 < default_posix_capacity([tmp_path]) <= 16 << 30
    with pytest.raises(ValueError):
        PosixDiskCap([tmp_path], 0)


def test_a_block_is_touched_at_most_once_per_touch_interval(tmp_path, monkeypatch):
    """Each touch is a system call on every load hit: a block read again within ``touch_every_s``
    keeps the mtime of its last touch; after it, it is touched again."""
    ids = [write_block(tmp_path, i) for i in range(3)]
    now = [100.0]
    cap = PosixDiskCap([tmp_path], 1 << 30, touch_every_s=10.0, clock=lambda: now[0])
    touched: list[str] = []
    real_utime = os.utime
    monkeypatch.setattr(os, "utime", lambda path, *a: (touched.append(os.path.basename(path)), real_utime(path, *a)))
    cap.touch(ids[:2])
    now[0] += 5.0
    cap.touch(ids)  # 0 and 1 within the interval: only 2
    assert touched == [ids[0].hex(), ids[1].hex(), ids[2].hex()]
    now[0] += 5.0
    cap.touch([ids[0]])  # 10 s after its last touch: touched again
    assert touched[-1] == ids[0].hex() and len(touched) == 4
    assert os.stat(tmp_path / ids[0].hex()[:3] / ids[0].hex()).st_mtime > 1_000_010
