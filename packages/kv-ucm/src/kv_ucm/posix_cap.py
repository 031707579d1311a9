"""A disk cap for UCM's Posix store directories, enforced from outside UCM.

UCM's own cap is its Posix garbage collector (``posix_gc_enable`` + ``posix_capacity_gb``), which
makes every live instance on a directory publish one GC config (block size included) and refuses
the others: it cannot be on by default for a directory that instances of different models share.
This cap needs no agreement between instances:

* UCM 0.8.x lays a block out as one file ``<backend>/<first 3 hex digits>/<32 hex digits of the
  block id>`` (``data_dir_shard_bytes`` digits of directory); its bookkeeping files start with a
  dot and are never touched here.
* Bytes written by this process are counted; when the count passes the cap (or ``rescan_s`` has
  passed, to notice the other instances' writes), the directories are scanned and the least
  recently *used* block files (oldest mtime) are removed until the total is under
  ``low_water`` x cap. A load hit refreshes the file's mtime (``touch``), so a block read often
  outlives blocks written after it; at most once per ``touch_every_s`` per block (a hot prefix is
  loaded again and again, and each ``utime`` is a system call: ~3 ms of a 64 MiB load of 128 KiB
  blocks), which leaves its mtime that much older: the order of eviction among blocks used within
  seconds of each other, where a scan every ``rescan_s`` cannot tell them apart anyway.
* Removing a file is safe for concurrent readers: a reader that opened it still reads the whole
  old file (the inode lives until closed); a reader that has not opened it yet gets UCM's
  not-found, i.e. a miss. Block ids are content keys (a value's bytes never change under one id)
  and every value carries the store core's checksum trailer, so a removal can only ever turn a hit
  into a miss, never into wrong KV.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from kv_common.embedded_backend import default_spill_capacity
from kv_common.file_lru import evict_oldest
from kv_common.logging_utils import get_logger

logger = get_logger(__name__)

_HEX = frozenset("0123456789abcdef")
LOW_WATER = 0.9  # evict down to 90 % of the cap: one scan pays for many puts
RESCAN_S = 60.0
TOUCH_EVERY_S = 10.0
MAX_TOUCHED = 1 << 17  # blocks whose last touch is remembered (forgotten all at once beyond)


def default_posix_capacity(backends: Sequence[str | os.PathLike[str]]) -> int:
    """The cap when none is given: 16 GiB, or half the free space of the smallest backend's file
    system when that is less (the same rule as the embedded store's spill directory)."""
    return min(default_spill_capacity(b) for b in backends)


def _is_block_file(name: str) -> bool:
    return len(name) == 32 and not name.startswith(".") and set(name) <= _HEX


class PosixDiskCap:
    """Keeps the block files under ``backends`` at or below ``capacity_bytes``."""

    def __init__(
        self,
        backends: Sequence[str | os.PathLike[str]],
        capacity_bytes: int,
        *,
        shard_digits: int = 3,
        low_water: float = LOW_WATER,
        rescan_s: float = RESCAN_S,
        touch_every_s: float = TOUCH_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.backends = [Path(b) for b in backends]
        # As strings for ``touch``, which runs on every load hit: pathlib costs ~30 us a block
        # there (measured: most of a 128 KiB load's bookkeeping), string joins ~1 us.
        self._roots = [os.fspath(b) + os.sep for b in self.backends]
        self.capacity_bytes = int(capacity_bytes)
        self.shard_digits = shard_digits
        self.low_water = low_water
        self.rescan_s = rescan_s
        self.touch_every_s = touch_every_s
        self._clock = clock
        self._touched: dict[bytes, float] = {}  # block id -> when this process last touched it
        self.evictions = 0
        self.scans = 0
        self._lock = threading.Lock()
        self._bytes = 0
        self._last_scan = -1e18
        self.enforce()  # blocks already there count (a restart, another instance)

    @property
    def used_bytes(self) -> int:
        """Bytes this cap believes are in the directories (exact after each scan)."""
        return self._bytes

    def _files(self) -> list[tuple[float, int, str]]:
        files = []
        for root in self.backends:
            try:
                shards = [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
            except OSError:
                continue
            for shard in shards:
                try:
                    entries = list(os.scandir(shard.path))
                except OSError:  # removed meanwhile
                    continue
                for entry in entries:
                    if not _is_block_file(entry.name):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    files.append((st.st_mtime, st.st_size, entry.path))
        return files

    def enforce(self) -> None:
        """Scan now and evict down to the low-water mark when over the cap."""
        with self._lock:
            self._scan_and_evict()

    def _scan_and_evict(self) -> None:
        self.scans += 1
        self._last_scan = time.monotonic()
        files = self._files()
        total = sum(size for _, size, _ in files)
        if total > self.capacity_bytes:
            done = evict_oldest(files, int(self.capacity_bytes * self.low_water), what="UCM disk cap")
            self.evictions += done.removed
            total = done.bytes_left
            logger.debug("UCM disk cap: removed %d block file(s), %d bytes left", done.removed, total)
        self._bytes = total

    def wrote(self, nbytes: int) -> None:
        """Count ``nbytes`` written; evict when the directories may now be over the cap."""
        if nbytes <= 0:
            return
        with self._lock:
            self._bytes += nbytes
            if self._bytes > self.capacity_bytes or time.monotonic() - self._last_scan > self.rescan_s:
                self._scan_and_evict()

    def path_candidates(self, block_id: bytes) -> list[str]:
        name = block_id.hex()
        tail = name[: self.shard_digits] + os.sep + name
        return [root + tail for root in self._roots]

    def touch(self, block_ids: Iterable[bytes]) -> None:
        """Mark blocks as used now (a load hit): eviction goes by last use, not by write time. A
        block this process touched within ``touch_every_s`` is left as it is."""
        now = self._clock()
        touched = self._touched
        if len(touched) > MAX_TOUCHED:
            touched.clear()
        for bid in block_ids:
            if now - touched.get(bid, -1e18) < self.touch_every_s:
                continue
            touched[bid] = now
            for path in self.path_candidates(bid):
                try:
                    os.utime(path)
                    break
                except OSError:  # on another backend, or evicted meanwhile: nothing to keep
                    continue
