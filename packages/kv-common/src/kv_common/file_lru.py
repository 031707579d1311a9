"""Least-recently-used eviction over files on disk, shared by the embedded backend's spill
directory and kv-ucm's cap on UCM's Posix store.

Recency is the file's mtime: a write sets it and a load hit touches it. Several processes may
evict in the same directories at once, so a file already gone counts as evicted (its bytes are
gone either way), and one that cannot be removed is logged and skipped rather than failing the
write that triggered the eviction.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kv_common.logging_utils import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class Evicted:
    removed: int  # files this call removed
    bytes_left: int  # bytes of the listed files still there, as far as this call knows


def evict_oldest(
    files: Iterable[tuple[float, int, str | os.PathLike[str]]],
    target_bytes: int,
    *,
    keep: Callable[[str], bool] = lambda _path: False,
    unlink: Callable[[str], None] = os.unlink,
    what: str = "cache",
) -> Evicted:
    """Remove the oldest of ``files`` ((mtime, size, path)) until their total is at most
    ``target_bytes``. ``keep(path)`` spares a file (the value being written)."""
    listed = sorted(files, key=lambda f: (f[0], str(f[2])))
    total = sum(size for _, size, _ in listed)
    removed = 0
    for _, size, path in listed:
        if total <= target_bytes:
            break
        path = os.fspath(path)
        if keep(path):
            continue
        try:
            unlink(path)
        except FileNotFoundError:  # another process evicted it first
            pass
        except OSError as exc:
            logger.warning("%s: cannot remove %s: %s", what, path, exc)
            continue
        else:
            removed += 1
        total -= size
    return Evicted(removed, total)
