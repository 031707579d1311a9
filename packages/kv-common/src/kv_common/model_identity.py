"""Which weights a model path holds: a short digest that changes when the model is changed in place.

The fingerprints name a model by path, revision, dtype and shapes; a model directory re-written
with new weights (a new checkpoint of the same architecture copied over the old one) keeps all of
those, and stores that outlive the engine (the embedded store's spill directory, a shared pool)
would serve the old model's KV to the new one. ``weights_identity`` gives the weights a name of
their own, read from the files in bounded time (headers and small samples, never whole tensors):

Local directory (vLLM loads the top-level files; so does this):

- ``config.json`` and the other small configs that change the computation (``params.json``, the
  quantization configs) and every ``*.index.json``: whole content;
- every ``*.safetensors``: its size, its JSON header (tensor names, dtypes, shapes, offsets) and the
  first ``TENSOR_SAMPLE_BYTES`` of each tensor's data. The header alone does not tell a new
  checkpoint of the same architecture from the old one (same names, shapes, offsets and size);
  training or merging an adapter changes every element of a tensor it touches, its first bytes
  included. Above ``TENSOR_SAMPLE_BUDGET`` tensors in all, an evenly spread subset per file;
- other weight files (``*.bin``, ``*.pt``, ``*.gguf``, ...): size, first and last
  ``FILE_SAMPLE_BYTES`` (a PyTorch zip ends with its directory, which holds a CRC-32 per tensor;
  a GGUF file starts with its metadata and tensor table).

Never the modification time: a copy changes it, ``cp -p`` / ``rsync -t`` keep it over new bytes.
It only decides, with size, inode and ctime, when the cached digest of a path must be recomputed.

A model path that is a file (GGUF): that file's size and samples.

A Hugging Face hub id (not a local path): the snapshot commit the local hub cache resolves the
revision to (content-addressed: a commit names the files), else a revision that is itself a full
commit hash. Not covered, ``UNVERIFIED`` (the fingerprint then names the model by id and revision
only, as before): a hub id not yet in the local cache under a branch name, object-storage models
(vLLM's ``model_weights``), ModelScope. Nor covered on disk: weights in subdirectories (vLLM does not
load them by default), a change that leaves the first bytes of every sampled tensor as they were
(an edit of a few rows), and a file rewritten between the scheduler's and a worker's start.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from kv_common.logging_utils import get_logger

logger = get_logger(__name__)

UNVERIFIED = "unverified"
DIGEST_CHARS = 16  # 64 bits: names weights, not an integrity check
TENSOR_SAMPLE_BYTES = 64
TENSOR_SAMPLE_BUDGET = 4096  # sampled tensors over all safetensors files (at least MIN_SAMPLES_PER_FILE each)
MIN_SAMPLES_PER_FILE = 16
FILE_SAMPLE_BYTES = 1 << 20
MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors format's own limit
MAX_CONFIG_BYTES = 64 << 20
CONFIG_FILES = frozenset({"config.json", "params.json", "quantize_config.json", "quant_config.json",
                          "hf_quant_config.json"})
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".gguf", ".ckpt", ".tensors", ".npz", ".msgpack", ".h5")
_CACHE_ENTRIES = 32
_COMMIT = re.compile(r"[0-9a-f]{40}")


def weights_identity(model: str, *, revision: str | None = None, download_dir: str | None = None) -> str:
    """``sha256:<16 hex>`` for a local directory or file, ``hub:<16 hex of the commit>`` for a hub
    id the local cache resolves, else ``UNVERIFIED``. Never raises: an unreadable file is named as
    unreadable, so both ends of a comparison still agree on the same files."""
    if not model:
        return UNVERIFIED
    path = Path(model).expanduser()
    try:
        if path.is_dir() or path.is_file():
            return _local_identity(path)
    except Exception as exc:  # noqa: BLE001 - start-up must not fail on a file vLLM itself may not read
        logger.warning("weights of %s not identified (%s: %s): stored KV is matched by path and revision only",
                       model, type(exc).__name__, exc)
        return UNVERIFIED
    return _hub_identity(model, revision, download_dir)


# ---- local files --------------------------------------------------------------------------------

_cache: OrderedDict[tuple[object, ...], str] = OrderedDict()
_cache_lock = threading.Lock()


def _selected(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    chosen = []
    for entry in os.scandir(path):
        name = entry.name
        if (name in CONFIG_FILES or name.endswith((".index.json", ".safetensors"))
                or name.endswith(OTHER_WEIGHT_SUFFIXES)) and entry.is_file():
            chosen.append(Path(entry.path))
    return sorted(chosen)


def _signature(files: Iterable[Path]) -> tuple[object, ...]:
    """What must stay the same for a cached digest to stay valid (ctime: a write or ``utime`` that
    restores the mtime still moves it)."""
    out: list[object] = []
    for f in files:
        try:
            st = f.stat()
            out.append((f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))
        except OSError:
            out.append((f.name, None))
    return tuple(out)


def _local_identity(path: Path) -> str:
    files = _selected(path)
    key = (str(path.resolve()), _signature(files))
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    identity = "sha256:" + _digest_files(files)[:DIGEST_CHARS]
    with _cache_lock:
        _cache[key] = identity
        while len(_cache) > _CACHE_ENTRIES:
            _cache.popitem(last=False)
    return identity


class _Digest:
    """SHA-256 over length-prefixed fields (no two sequences of fields feed the same bytes)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(b"kv-common weights identity 1")

    def add(self, *fields: bytes | str | int) -> None:
        for field in fields:
            raw = field.encode() if isinstance(field, str) else str(field).encode() if isinstance(field, int) else field
            self._h.update(struct.pack("<Q", len(raw)) + raw)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _digest_files(files: list[Path]) -> str:
    digest = _Digest()
    tensor_files = [f for f in files if f.name.endswith(".safetensors")]
    per_file = max(MIN_SAMPLES_PER_FILE, TENSOR_SAMPLE_BUDGET // max(1, len(tensor_files)))
    for f in files:
        digest.add("file", f.name)
        try:
            with open(f, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                digest.add(size)
                if f.name.endswith(".json") and size <= MAX_CONFIG_BYTES:
                    digest.add("content", fh.read(MAX_CONFIG_BYTES + 1))
                elif not (f.name.endswith(".safetensors") and _add_safetensors(digest, fh.fileno(), size, per_file)):
                    _add_head_and_tail(digest, fh.fileno(), size)
        except OSError as exc:
            digest.add("unreadable", type(exc).__name__)
    return digest.hexdigest()


def _pread(fd: int, length: int, offset: int) -> bytes:
    out = b""
    while len(out) < length:
        chunk = os.pread(fd, length - len(out), offset + len(out))
        if not chunk:
            raise OSError(f"short read at {offset + len(out)}")
        out += chunk
    return out


def _add_head_and_tail(digest: _Digest, fd: int, size: int) -> None:
    digest.add("head", _pread(fd, min(size, FILE_SAMPLE_BYTES), 0))
    tail_start = max(FILE_SAMPLE_BYTES, size - FILE_SAMPLE_BYTES)
    digest.add("tail", _pread(fd, max(0, size - tail_start), tail_start))


def _add_safetensors(digest: _Digest, fd: int, size: int, samples: int) -> bool:
    """Header and per-tensor samples; False when the file is not readable as safetensors (the
    caller then samples it as an opaque file)."""
    tensors = safetensors_tensors(fd, size)
    if tensors is None:
        return False
    header, spans = tensors
    digest.add("safetensors header", header)
    data_start = 8 + len(header)
    names = sorted(spans)
    if len(names) > samples:  # evenly spread, the same subset for the same header
        names = [names[i * len(names) // samples] for i in range(samples)]
    for name in names:
        begin, end = spans[name]
        digest.add(name, _pread(fd, min(end - begin, TENSOR_SAMPLE_BYTES), data_start + begin))
    return True


def safetensors_tensors(fd: int, size: int) -> tuple[bytes, dict[str, tuple[int, int]]] | None:
    """(raw JSON header, tensor name -> data offsets) of a safetensors file, bounded and checked
    before use; None when it is not one."""
    if size < 8:
        return None
    (length,) = struct.unpack("<Q", _pread(fd, 8, 0))
    if length > MAX_SAFETENSORS_HEADER or 8 + length > size:
        return None
    header = _pread(fd, length, 8)
    try:
        parsed = json.loads(header)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    data_size = size - 8 - length
    spans: dict[str, tuple[int, int]] = {}
    for name, info in parsed.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            return None
        spans[name] = (offsets[0], offsets[1])
    return header, spans


# ---- hub ids ------------------------------------------------------------------------------------


def _hub_identity(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    commit = _cached_commit(repo_id, revision, download_dir)
    if commit is None and revision and _COMMIT.fullmatch(revision):
        commit = revision
    return f"hub:{commit[:DIGEST_CHARS]}" if commit else UNVERIFIED


def _cached_commit(repo_id: str, revision: str | None, download_dir: str | None) -> str | None:
    """The commit the local hub cache holds ``config.json`` under for this revision (vLLM reads
    the config first, so it is there once the engine starts); None when not cached."""
    try:
        from huggingface_hub import try_to_load_from_cache

        for cache_dir in dict.fromkeys((download_dir, None)):
            found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
            if isinstance(found, str):
                commit = Path(found).parent.name
                if _COMMIT.fullmatch(commit):
                    return commit
    except Exception:  # noqa: BLE001 - no huggingface_hub, or an id it refuses: not a cached hub model
        return None
    return None
