"""A store backend with no server: an LRU dict in this process, optionally spilling to a directory.

With ``spill_dir`` every process that points at the same directory sees the others' blocks: a key
missing from memory is looked up as a file there. That is how two vLLM engines in separate
processes share the embedded store (set ``write_through=True`` so puts reach the directory at once).
Files are written to a temporary name and renamed, so readers see whole files or none; each file
carries a header (magic, length, crc32) so a truncated or corrupt file reads as a miss, not as KV.

Safe defaults: the directory is capped (``spill_capacity_bytes``; None: ``default_spill_capacity``,
0: no cap), files are evicted least recently *used* first (a read hit refreshes the file's mtime),
and with ``private_dir=True`` (the connector's default directory) the directory is created 0700
and refused unless it is a real directory owned by this user that nobody else can enter.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from kv_common.backend import Backend
from kv_common.file_lru import evict_oldest
from kv_common.logging_utils import get_logger

try:  # ISA-L's crc32: the same values as zlib's (files stay compatible), several times faster
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the environment
    _crc32 = zlib.crc32

logger = get_logger(__name__)

_MAGIC = b"KVCEMB01"
_HEADER = struct.Struct("<8sQI")  # magic, payload length, crc32 of payload
_SUFFIX = ".kvb"
DEFAULT_SPILL_CAP_BYTES = 16 << 30
MAX_SPILL_FREE_FRACTION = 0.5
SPILL_SLACK_MIN_CAP = 64 << 20  # smaller caps evict exactly to the cap (tests, tiny directories)
# An embedded call waits on no other party: it copies memory and, with a spill directory, reads or
# writes local files. Its bound is generous for either (a memory copy runs at several GB/s here, a
# slow local disk at 50 MB/s), so a caller's deadline is never shorter than the real call; a fixed
# cost per call, not per second of it, since a load of many cache-sized passes sums one per pass.
MEMORY_CALL_FIXED_S, MEMORY_SLOWEST_BYTES_PER_S = 0.02, 1e9
DISK_CALL_FIXED_S, DISK_SLOWEST_BYTES_PER_S = 0.1, 50e6


def default_spill_capacity(directory: str | os.PathLike[str]) -> int:
    """The spill cap when none is given: 16 GiB, or half the free space of the file system holding
    ``directory`` when that is less (the cache must never fill the disk it shares)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return DEFAULT_SPILL_CAP_BYTES
    return max(1 << 20, min(DEFAULT_SPILL_CAP_BYTES, int(st.f_bavail * st.f_frsize * MAX_SPILL_FREE_FRACTION)))


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` 0700, or check that it is a directory (not a link) owned by this user with no
    access for group or others; PermissionError otherwise. A predictable shared-/tmp name is safe
    only this way: another user could have created it first to read or plant blocks."""
    try:
        path.mkdir(mode=0o700, parents=False)
    except FileExistsError:
        pass
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(path)
    uid = os.geteuid() if hasattr(os, "geteuid") else st.st_uid
    problem = None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "is not a plain directory (a symlink?)"
    elif st.st_uid != uid:
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    elif stat.S_IMODE(st.st_mode) & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):o}: group or others can reach it (expected 700)"
    if problem:
        raise PermissionError(
            f"embedded store: spill_dir {path} {problem}. Remove it, or set embedded.spill_dir to a "
            "directory of your own (a directory shared on purpose is never checked; use mac_key_env there)"
        )


def key_filename(key: str) -> str:
    """Keys may hold any character ('/', NUL, ...): name files by their hash instead."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest() + _SUFFIX


def _read_only(value: bytes | bytearray | None) -> bytes | memoryview | None:
    """A stored value as callers may see it: a handed-over bytearray only through a read-only view."""
    return memoryview(value).toreadonly() if isinstance(value, bytearray) else value


def _as_bytes_view(buffer: memoryview | bytes | bytearray) -> memoryview:
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class EmbeddedBackend(Backend):
    name = "embedded"

    def __init__(
        self,
        capacity_bytes: int = 1 << 30,
        spill_dir: str | os.PathLike[str] | None = None,
        write_through: bool = False,
        spill_capacity_bytes: int | None = None,
        private_dir: bool = False,
    ):
        if write_through and spill_dir is None:
            raise ValueError("write_through needs a spill_dir")
        self.capacity_bytes = capacity_bytes
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self.write_through = write_through
        if self.spill_dir is not None and private_dir:
            ensure_private_dir(self.spill_dir)
        if spill_capacity_bytes is None and self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            spill_capacity_bytes = default_spill_capacity(self.spill_dir)
        self.spill_capacity_bytes = spill_capacity_bytes or None  # 0: no cap
        self._lock = threading.RLock()
        # Least recently used first. A bytearray is a value a subclass took over without a copy
        # (``_put(owned=True)``): read-only to everyone else (``batch_get`` returns a view of it).
        self._memory: OrderedDict[str, bytes | bytearray] = OrderedDict()
        self._memory_bytes = 0
        self._counts = {
            "hits": 0,
            "misses": 0,
            "evictions": 0,
            "spills": 0,
            "corrupt": 0,
            "spill_evictions": 0,
        }
        self._spill_bytes = 0
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            self._spill_bytes = sum(size for _, size, _ in self._spill_files())

    # -- Backend API ------------------------------------------------------------------------

    # Its calls copy memory under the GIL (slice assignments, ``bytes``): a second thread beside
    # the caller's check would only add hand-offs.
    calls_release_gil = False

    def call_bound_s(self, nbytes: int) -> float | None:
        """Bounded by the copy itself: memory and local files, no peer to wait for."""
        if self.spill_dir is None:
            return MEMORY_CALL_FIXED_S + nbytes / MEMORY_SLOWEST_BYTES_PER_S
        return DISK_CALL_FIXED_S + nbytes / DISK_SLOWEST_BYTES_PER_S

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._memory or self._file_exists(key) for key in keys]

    def batch_put(self, keys: Sequence[str], values: Sequence[memoryview | bytes]) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        with self._lock:
            return [self._put(key, value) for key, value in zip(keys, values, strict=True)]

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        with self._lock:
            results = [
                self._get_into(key, _as_bytes_view(buf)) for key, buf in zip(keys, buffers, strict=True)
            ]
        return results

    def batch_get(self, keys: Sequence[str]) -> Sequence[bytes | memoryview | None]:
        with self._lock:
            return [_read_only(self._get(key)) for key in keys]

    def batch_remove(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                value = self._memory.pop(key, None)
                if value is not None:
                    self._memory_bytes -= len(value)
                self._remove_file(key)

    def close(self) -> None:
        with self._lock:
            self._memory.clear()
            self._memory_bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                **self._counts,
                "memory_bytes": self._memory_bytes,
                "memory_items": len(self._memory),
                "spill_bytes": self._spill_bytes,
            }

    # -- memory -----------------------------------------------------------------------------

    def _put(self, key: str, value: memoryview | bytes | bytearray, owned: bool = False) -> bool:
        if key in self._memory:
            self._memory.move_to_end(key)
            return True
        if self._file_exists(key):
            return True
        # copy unless handed over: the caller reuses its buffer
        data = value if owned and isinstance(value, bytearray) else bytes(value)
        if self.write_through and not self._write_file(key, data):
            return False
        if len(data) > self.capacity_bytes:
            # Cannot fit in memory at all: the directory is the only place for it.
            return self.write_through or (self.spill_dir is not None and self._write_file(key, data))
        self._memory[key] = data
        self._memory_bytes += len(data)
        self._evict_memory()
        return True

    def _evict_memory(self) -> None:
        while self._memory_bytes > self.capacity_bytes and self._memory:
            key, data = self._memory.popitem(last=False)
            self._memory_bytes -= len(data)
            self._counts["evictions"] += 1
            if self.spill_dir is not None and not self.write_through and self._write_file(key, data):
                self._counts["spills"] += 1

    def _get(self, key: str) -> bytes | bytearray | None:
        data = self._memory.get(key)
        if data is not None:
            self._memory.move_to_end(key)
            self._counts["hits"] += 1
            return data
        data = self._read_file(key)
        self._counts["hits" if data is not None else "misses"] += 1
        return data

    def _get_into(self, key: str, buffer: memoryview) -> int:
        data = self._memory.get(key)
        if data is not None:
            if len(data) != buffer.nbytes:
                self._counts["misses"] += 1
                return -1
            self._memory.move_to_end(key)
            buffer[:] = data
            self._counts["hits"] += 1
            return len(data)
        n = self._read_file_into(key, buffer)
        self._counts["hits" if n >= 0 else "misses"] += 1
        return n

    # -- spill directory --------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        assert self.spill_dir is not None
        return self.spill_dir / key_filename(key)

    def _file_exists(self, key: str) -> bool:
        return self.spill_dir is not None and self._path(key).is_file()

    def _write_file(self, key: str, data: bytes | bytearray) -> bool:
        path = self._path(key)
        # Unique per process and thread, so concurrent writers of one key never share a temp file.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, len(data), _crc32(data)))
                f.write(data)
            os.replace(tmp, path)  # atomic: other processes see the whole file or none
        except OSError as exc:
            logger.warning("embedded backend: cannot write %s: %s", path, exc)
            tmp.unlink(missing_ok=True)
            return False
        self._spill_bytes += _HEADER.size + len(data)
        if self.spill_capacity_bytes is not None and self._spill_bytes > self.spill_capacity_bytes:
            self._evict_files(keep=path.name)
        return True

    def _read_file(self, key: str) -> bytes | None:
        if self.spill_dir is None:
            return None
        try:
            with open(self._path(key), "rb") as f:
                header = self._read_header(key, f)
                if header is None:
                    return None
                data = f.read(header[0] + 1)  # one byte more reveals trailing garbage
        except FileNotFoundError:
            return None
        if len(data) != header[0] or _crc32(data) != header[1]:
            self._drop_corrupt(key, f"{len(data)} of {header[0]} bytes or crc mismatch")
            return None
        self._touch(key)
        return data

    def _touch(self, key: str) -> None:
        """A read hit makes the file the most recently used (eviction goes by mtime)."""
        try:
            os.utime(self._path(key))
        except OSError:  # removed meanwhile by another process: nothing to keep
            pass

    def _read_file_into(self, key: str, buffer: memoryview) -> int:
        if self.spill_dir is None:
            return -1
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                header = self._read_header(key, f)
                if header is None or header[0] != buffer.nbytes:
                    return -1
                n = f.readinto(buffer)
                trailing = f.read(1)
        except FileNotFoundError:
            return -1
        except OSError as exc:
            logger.warning("embedded backend: cannot read %s: %s", path, exc)
            return -1
        if n != header[0] or trailing or _crc32(buffer) != header[1]:
            self._drop_corrupt(key, f"{n} of {header[0]} bytes" if n != header[0] else "crc mismatch")
            return -1
        self._touch(key)
        return n

    def _read_header(self, key: str, f: BinaryIO) -> tuple[int, int] | None:
        """(payload length, crc32), or None when the header is bad (the file is then removed)."""
        raw = f.read(_HEADER.size)
        if len(raw) != _HEADER.size:
            self._drop_corrupt(key, "short header")
            return None
        magic, length, crc = _HEADER.unpack(raw)
        if magic != _MAGIC:
            self._drop_corrupt(key, "bad magic")
            return None
        return int(length), int(crc)

    def _drop_corrupt(self, key: str, why: str) -> None:
        logger.warning("embedded backend: %s is corrupt (%s), removing it", self._path(key), why)
        self._counts["corrupt"] += 1
        self._remove_file(key)

    def _remove_file(self, key: str) -> None:
        if self.spill_dir is None:
            return
        path = self._path(key)
        try:
            size = path.stat().st_size
            path.unlink()
            self._spill_bytes = max(0, self._spill_bytes - size)
        except FileNotFoundError:
            pass

    def _spill_files(self) -> list[tuple[float, int, Path]]:
        assert self.spill_dir is not None
        files = []
        for entry in os.scandir(self.spill_dir):
            if entry.name.endswith(_SUFFIX) and not entry.name.startswith("."):
                try:
                    st = entry.stat()
                except FileNotFoundError:  # removed by another process meanwhile
                    continue
                files.append((st.st_mtime, st.st_size, Path(entry.path)))
        return files

    def _evict_files(self, keep: str) -> None:
        """Remove the least recently used files (oldest mtime: written or last read) until the
        directory fits its budget (other processes' files too). Caps of ``SPILL_SLACK_MIN_CAP`` and
        more are evicted down to 90 %: the scan (~9 us per file) then pays for many writes."""
        cap = self.spill_capacity_bytes
        assert cap is not None
        target = cap - cap // 10 if cap >= SPILL_SLACK_MIN_CAP else cap
        files = self._spill_files()
        total = sum(size for _, size, _ in files)
        if total <= cap:
            self._spill_bytes = total
            return
        done = evict_oldest(files, target, keep=lambda path: os.path.basename(path) == keep,
                            what="embedded spill")
        self._counts["spill_evictions"] += done.removed
        self._spill_bytes = done.bytes_left
