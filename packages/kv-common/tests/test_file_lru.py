"""kv_common.file_lru: the one LRU eviction over files (embedded spill, kv-ucm's Posix cap)."""

from __future__ import annotations

import os

from kv_common.file_lru import evict_oldest


def _files(tmp_path, n, size=10):
    out = []
    for i in range(n):
        path = tmp_path / f"f{i}"
        path.write_bytes(bytes(size))
        os.utime(path, (1000 + i, 1000 + i))
        out.append((1000.0 + i, size, str(path)))
    return out


def test_oldest_go_first_until_the_target(tmp_path):
    files = _files(tmp_path, 5)
    done = evict_oldest(reversed(files), 25)
    assert (done.removed, done.bytes_left) == (3, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f3", "f4"]


def test_kept_file_survives_and_the_next_oldest_goes(tmp_path):
    files = _files(tmp_path, 3)
    done = evict_oldest(files, 20, keep=lambda path: path.endswith("f0"))
    assert (done.removed, done.bytes_left) == (1, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f0", "f2"]


def test_a_file_another_process_removed_counts_as_gone(tmp_path):
    files = _files(tmp_path, 3)
    os.unlink(files[0][2])
    done = evict_oldest(files, 20)
    assert (done.removed, done.bytes_left) == (0, 20)  # its bytes are gone all the same
    assert len(list(tmp_path.iterdir())) == 2


def test_a_file_that_cannot_be_removed_is_skipped_not_raised(tmp_path, caplog):
    files = _files(tmp_path, 3)

    def unlink(path):
        if path.endswith("f0"):
            raise PermissionError(13, "Permission denied")
        os.unlink(path)

    done = evict_oldest(files, 20, unlink=unlink, what="test cache")
    assert (done.removed, done.bytes_left) == (1, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f0", "f2"]
    assert "test cache: cannot remove" in caplog.text
