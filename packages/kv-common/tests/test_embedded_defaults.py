"""Safe defaults of the embedded store's spill directory (issue 15 §3): a disk cap by default,
eviction by last access, and a private directory when it is the default one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from kv_common.embedded_backend import EmbeddedBackend, default_spill_capacity, key_filename


def block(i: int, size: int = 100) -> bytes:
    return bytes([i % 256]) * size


def test_spill_directory_is_capped_by_default(tmp_path: Path):
    b = EmbeddedBackend(spill_dir=tmp_path, write_through=True)
    assert b.spill_capacity_bytes == default_spill_capacity(tmp_path)
    st = os.statvfs(tmp_path)
    assert 0 < b.spill_capacity_bytes <= st.f_bavail * st.f_frsize // 2
    assert EmbeddedBackend(spill_dir=tmp_path, spill_capacity_bytes=0).spill_capacity_bytes is None  # 0: no cap


def test_spill_eviction_is_by_last_access_not_write_time(tmp_path: Path):
    file_size = 100 + 20
    b = EmbeddedBackend(capacity_bytes=0, spill_dir=tmp_path, spill_capacity_bytes=3 * file_size)
    for i in range(3):
        b.batch_put([f"k{i}"], [block(i)])
        os.utime(tmp_path / key_filename(f"k{i}"), (1000 + i, 1000 + i))  # k0 written first
    buf = bytearray(100)
    assert b.batch_get_into(["k0"], [memoryview(buf)]) == [100]  # ... but read last
    assert b.batch_get(["k1"]) == [block(1)]
    b.batch_put(["k3"], [block(3)])
    assert b.batch_exists(["k0", "k1", "k2", "k3"]) == [True, True, False, True]


def test_private_directory_is_created_0700(tmp_path: Path):
    d = tmp_path / "kv-store-me"
    EmbeddedBackend(spill_dir=d, private_dir=True)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    EmbeddedBackend(spill_dir=d, private_dir=True)  # ours and private: accepted again


@pytest.mark.parametrize("problem", ["mode", "symlink", "owner"])
def test_private_directory_that_others_can_reach_is_refused(tmp_path: Path, problem: str):
    d = tmp_path / "kv-store-me"
    if problem == "mode":
        d.mkdir(mode=0o700)
        d.chmod(0o777)  # someone else can plant or read blocks
    elif problem == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        d.symlink_to(tmp_path / "elsewhere")
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to hand a directory to another user")
        d.mkdir(mode=0o700)
        os.chown(d, 65534, 65534)
    with pytest.raises(PermissionError, match="spill_dir"):
        EmbeddedBackend(spill_dir=d, private_dir=True)


def test_a_full_spill_directory_is_not_rescanned_on_every_write(tmp_path: Path):
    """Over the cap, eviction leaves 10 % slack (caps of 64 MiB and more): a scan of the whole
    directory (~9 us per file) pays for many writes instead of one."""
    value = bytes(1 << 20)
    b = EmbeddedBackend(capacity_bytes=0, spill_dir=tmp_path, spill_capacity_bytes=64 << 20)
    scans = 0
    real = b._spill_files

    def counting():
        nonlocal scans
        scans += 1
        return real()

    b._spill_files = counting  # type: ignore[method-assign]
    for i in range(84):
        b.batch_put([f"k{i}"], [value])
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 64 << 20
    assert scans <= 3, scans
