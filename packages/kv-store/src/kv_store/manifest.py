"""The namespace manifest: the layout a store namespace holds, checked once at start-up.

The namespace (``keys.namespace``) is a digest of the settings the scheduler knows. Some settings
that change the bytes of a block are only known on the worker, once the KV cache exists (the
tensor layout per layer group, the attention kernel's block size, the layer set of this worker),
and a user may pin the namespace by name (``namespace`` in the extra config), which bypasses the
digest altogether. Without a check, an engine with another layout then finds blocks under the
same keys: either every hit fails its size check and is recomputed (a hit-then-fail loop on every
request), or, when the sizes agree, it loads KV of another layout that passes the checksum.

So the first worker of each rank tag stores a manifest under a reserved key of the namespace
(``kv/<namespace>/<rank tag>/manifest``; block keys end in a hex hash, never in ``manifest``) and
every worker compares it with its own at start-up, through the generic ``Backend`` interface:

- put-if-absent (the ``Backend`` contract: a key that exists keeps its value), then read back; the
  first writer reads again after a short pause, which narrows the window where two first writers
  race on a backend whose put-if-absent is not atomic;
- the value is a small framed JSON document (magic, format version, length; never pickle),
  at most ``MAX_MANIFEST_BYTES``, zero-padded to the block value size so that a backend storing
  one fixed value size (UCM) stores it like a block;
- a mismatch raises ``ManifestMismatch`` with ONE message naming each differing setting with
  both values: the engine refuses to start (fail closed). A stored manifest that cannot be read as
  one (corrupt, oversized, another size than this engine's values) is a mismatch too: the
  namespace holds something this engine cannot prove compatible;
- a backend that cannot answer (error, or no answer within the deadline) does not block start-up:
  the check is skipped with one warning.

The manifest names the mismatch at start-up; it is not what keeps another layout's KV out. A
manifest can be evicted (Mooncake, the embedded LRU), or unreachable at start-up, and a second
layout then writes its own. So every value also carries the layout tag (``layout_tag``, a digest
of these same settings) in its checksum seed, and a value of another layout fails its check: a
miss, recomputed, never loaded.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
from kv_common.backend import Backend
from kv_common.logging_utils import get_logger

logger = get_logger(__name__)

FORMAT_VERSION = 1
MAGIC = b"KVMF"
_HEADER = struct.Struct("<4sHHI")  # magic, format version, reserved, JSON length
MAX_MANIFEST_BYTES = 16 << 10
MAX_SETTINGS = 128
MAX_VALUE_CHARS = 512
MANIFEST_NAME = "manifest"
# Settings recorded for the reader's information only (where the manifest came from).
INFORMATIONAL = frozenset({"writer"})


class ManifestError(ValueError):
    """A stored value that is not a manifest this version can read."""


class ManifestMismatch(RuntimeError):
    """The namespace holds KV of another layout: the engine must not use it."""

    def __init__(self, message: str, differences: Sequence[tuple[str, str, str]] = ()) -> None:
        super().__init__(message)
        self.differences = list(differences)


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format: int = FORMAT_VERSION
    settings: dict[str, str]


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value) if isinstance(value, tuple) else str(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 12] + "..." + _digest(text)[:9]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def make_manifest(settings: Mapping[str, Any]) -> Manifest:
    if len(settings) > MAX_SETTINGS:
        raise ValueError(f"{len(settings)} manifest settings (at most {MAX_SETTINGS})")
    return Manifest(settings={str(k): _text(v) for k, v in sorted(settings.items())})


def encode(manifest: Manifest, size: int | None = None) -> bytes:
    """Framed JSON, zero-padded to ``size`` bytes when given (the store's value size)."""
    body = msgspec.json.encode(manifest)
    raw = _HEADER.pack(MAGIC, manifest.format, 0, len(body)) + body
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest of {len(raw)} bytes (at most {MAX_MANIFEST_BYTES})")
    if size is not None:
        if size < len(raw):
            raise ValueError(f"manifest of {len(raw)} bytes does not fit a {size}-byte value")
        raw += bytes(size - len(raw))
    return raw


def decode(raw: bytes | bytearray | memoryview) -> Manifest:
    """The manifest in a stored value; ``ManifestError`` when it is not one (bounded: the JSON
    length is checked before anything is parsed)."""
    view = memoryview(raw).cast("B")
    if len(view) < _HEADER.size:
        raise ManifestError(f"{len(view)} bytes, shorter than a manifest header")
    magic, version, _, length = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise ManifestError(f"no manifest magic (found {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise ManifestError(f"manifest format {version}, this version reads format {FORMAT_VERSION}")
    if length > MAX_MANIFEST_BYTES - _HEADER.size or _HEADER.size + length > len(view):
        raise ManifestError(f"manifest length {length} exceeds the value ({len(view)} bytes) or the limit")
    try:
        manifest = msgspec.json.decode(view[_HEADER.size : _HEADER.size + length], type=Manifest)
    except msgspec.DecodeError as exc:
        raise ManifestError(f"manifest body unreadable: {exc}") from None
    if manifest.format != version or len(manifest.settings) > MAX_SETTINGS:
        raise ManifestError("manifest body inconsistent with its header")
    return manifest


def layout_tag(manifest: Manifest) -> int:
    """64-bit digest of the settings that change a block's bytes (not the informational ones):
    sealed into every value the worker stores and checked on every load (``codec``), so the
    layout is proven per block, not only by the manifest at start-up. Never 0 (0 means untagged)."""
    settings = {k: v for k, v in manifest.settings.items() if k not in INFORMATIONAL}
    digest = hashlib.sha256(msgspec.json.encode(dict(sorted(settings.items())))).digest()
    return int.from_bytes(digest[:8], "little") or 1


def differences(stored: Manifest, mine: Manifest) -> list[tuple[str, str, str]]:
    """(setting, stored value, this engine's value) for every setting that differs."""
    absent = "(absent)"
    names = sorted((set(stored.settings) | set(mine.settings)) - INFORMATIONAL)
    return [
        (n, stored.settings.get(n, absent), mine.settings.get(n, absent))
        for n in names
        if stored.settings.get(n, absent) != mine.settings.get(n, absent)
    ]


def mismatch_message(where: str, diffs: Sequence[tuple[str, str, str]], writer: str = "") -> str:
    listed = "; ".join(f"{name}: stored {old!r}, this engine {new!r}" for name, old, new in diffs)
    source = f" (written by {writer})" if writer else ""
    return (
        f"{where} holds KV written with another layout{source}: {listed}. Refusing to start rather "
        "than load KV of another layout. Give this engine its own namespace (the 'namespace' key, or "
        "leave it unset to derive one), or clear the store."
    )


# ---- what the worker records -------------------------------------------------------------------


def layer_set(names: Sequence[str]) -> str:
    """Compact name of a worker's layers: count, first, last and a digest of all names in order."""
    if not names:
        return "0"
    return f"{len(names)}: {names[0]} .. {names[-1]} #{_digest(chr(10).join(names))[:12]}"


def layout_settings(
    kv_caches: Mapping[str, Any], layer_groups: Mapping[str, int], *, block_size: int, num_blocks: int | None
) -> dict[str, str]:
    """The worker's KV layout by name: per layer group, each distinct (dtype, per-block shape) and
    how many layers have it; the layer set; the attention kernel's block size (vLLM splits a block
    into several kernel blocks when the backend needs smaller ones: the tensor then has more rows)."""
    per_group: dict[int, dict[tuple[str, tuple[int, ...]], int]] = {}
    rows: set[int] = set()
    for name, tensor in kv_caches.items():
        shape = tuple(int(d) for d in tensor.shape)
        rows.add(shape[0] if shape else 0)
        kind = (str(tensor.dtype).removeprefix("torch."), shape[1:])
        group = per_group.setdefault(int(layer_groups.get(name, 0)), {})
        group[kind] = group.get(kind, 0) + 1
    out = {
        f"kv_layout.group{g}": ", ".join(f"{n} x {dtype}{list(shape)}" for (dtype, shape), n in sorted(kinds.items()))
        for g, kinds in sorted(per_group.items())
    }
    out["layers"] = layer_set(list(kv_caches))
    kernel = "unknown"
    if num_blocks and len(rows) == 1:
        (n_rows,) = rows
        if n_rows and n_rows % num_blocks == 0:
            kernel = str(block_size // (n_rows // num_blocks))
    out["kernel_block_size"] = kernel
    return out


# ---- the check ---------------------------------------------------------------------------------


def _read(backend: Backend, key: str, value_size: int) -> tuple[bool, bytes | memoryview | None]:
    """(present, value). ``value`` None with present True: stored, but not readable at our size."""
    (exists,) = backend.batch_exists([key])
    if not exists:
        return False, None
    try:
        (value,) = backend.batch_get([key])
    except NotImplementedError:
        buf = bytearray(value_size)
        (n,) = backend.batch_get_into([key], [memoryview(buf)])
        value = bytes(buf[:n]) if n >= 0 else None
    return True, value


def _compare(value: bytes | memoryview | None, mine: Manifest, where: str, value_size: int) -> None:
    if value is None:
        raise ManifestMismatch(
            f"{where} holds a manifest that this engine cannot read as a {value_size}-byte value: the "
            "namespace holds values of another size, i.e. another layout. Refusing to start rather than "
            "load KV of another layout. Give this engine its own namespace, or clear the store.",
            [("value_size", "other", str(value_size))],
        )
    try:
        stored = decode(value)
    except ManifestError as exc:
        raise ManifestMismatch(
            f"{where} holds an unreadable manifest ({exc}); this engine cannot prove the stored KV "
            "has its layout and refuses to start. Clear the store or give this engine its own namespace.",
            [("manifest", "unreadable", "ok")],
        ) from None
    diffs = differences(stored, mine)
    if diffs:
        raise ManifestMismatch(mismatch_message(where, diffs, stored.settings.get("writer", "")), diffs)


_READ_BACK_TRIES = 20
_READ_BACK_PAUSE_S = 0.1


def _read_settled(
    backend: Backend, key: str, value_size: int, sleep: Callable[[float], None], *, want_present: bool
) -> tuple[bool, bytes | memoryview | None]:
    """``_read``, again for a while when the answer may be a put still under way: Mooncake lists a
    key as soon as a writer starts its put, and a get returns nothing until the copy is done (two
    engines of one layout starting together). A key that stays listed but unreadable is a value of
    another size (a mismatch); one still absent after our own put means the put failed."""
    present, value = _read(backend, key, value_size)
    for _ in range(_READ_BACK_TRIES):
        settled = value is not None if present else not want_present
        if settled:
            break
        sleep(_READ_BACK_PAUSE_S)
        present, value = _read(backend, key, value_size)
    return present, value


def publish_and_check(
    backend: Backend, key: str, mine: Manifest, value_size: int, *, where: str,
    settle_s: float = 0.5, sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Store ``mine`` unless a manifest is there, then compare. Returns "written" or "matched";
    raises ``ManifestMismatch``; backend errors propagate (the caller decides)."""
    present, value = _read_settled(backend, key, value_size, sleep, want_present=False)
    if present:
        _compare(value, mine, where, value_size)
        return "matched"
    backend.batch_put([key], [encode(mine, value_size)])
    present, value = _read_settled(backend, key, value_size, sleep, want_present=True)
    if not present:
        raise OSError("the manifest was not stored (backend full or refusing values)")
    _compare(value, mine, where, value_size)
    if settle_s > 0:  # a concurrent first writer on a backend without atomic put-if-absent
        sleep(settle_s)
        _, value = _read(backend, key, value_size)
        _compare(value, mine, where, value_size)
    return "written"


def check_with_deadline(
    backend: Backend, key: str, mine: Manifest, value_size: int, *, where: str, timeout_s: float,
    settle_s: float = 0.5,
) -> str:
    """``publish_and_check`` in a daemon thread, waited for at most ``timeout_s``. A mismatch
    raises; a backend error or no answer in time returns "unverified: ..." (logged once): an
    unreachable store must not block start-up."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(publish_and_check(backend, key, mine, value_size, where=where, settle_s=settle_s))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result.append(exc)

    thread = threading.Thread(target=run, name="store-manifest", daemon=True)
    thread.start()
    thread.join(timeout_s if timeout_s > 0 else None)
    if not result:
        outcome = f"unverified: no answer from the store within {timeout_s:g} s"
    else:
        (answer,) = result
        if isinstance(answer, ManifestMismatch):
            raise answer
        if not isinstance(answer, BaseException):
            return str(answer)
        outcome = f"unverified: {type(answer).__name__}: {answer}"
    logger.warning(
        "%s: layout manifest not checked (%s); starting anyway, stored blocks are still length- and "
        "checksum-checked", where, outcome.removeprefix("unverified: "),
    )
    return outcome
