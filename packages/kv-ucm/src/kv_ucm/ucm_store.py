"""A thin adapter over UCM's v1 store API (``UcmKVStoreBaseV1``).

What it adds on top of UCM:

* configuration in UCM's own vocabulary (``ucm_connector_config`` dicts and the YAML file UCM
  users write), with the sizes the native stores need derived from the KV block layout;
* synchronous, per-block results: ``dump``/``load`` return one ``bool`` per block, so a miss or
  a damaged block costs that block only (UCM itself fails a whole task and raises in ``wait``);
* one exception type, ``UcmError(operation, code)``, for everything UCM reports as an error
  that is not an ordinary per-block miss;
* a check of the installation first (``kv_ucm.installation``), which explains the ways a
  ``ucm`` import goes wrong.

``ucm`` is imported lazily: this module imports on Python 3.11, where no UCM wheel exists.
On a CPU host only the ``Posix`` pipeline (local disk / NFS) moves data; the device tiers
(``Cache|...``, PcStore) need CUDA or Ascend.
"""

from __future__ import annotations

import ctypes
import importlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kv_common.backend import BackendError

from kv_ucm.block_ids import UCM_BLOCK_ID_SIZE
from kv_ucm.installation import UcmInstallationError, check_ucm_installation

__all__ = [
    "UcmError",
    "UcmInstallationError",
    "UcmStore",
    "check_ucm_installation",
    "load_ucm_yaml",
]

DEFAULT_CONNECTOR_NAME = "UcmPipelineStore"

# Status codes UCM 0.8.1 reports; the native layer raises RuntimeError (or its subclasses
# StoreNotFoundError / StoreUnhealthyError) whose message starts with the code:
# "-50000, invalid size(4096,3000,4096)", "-50002, 2" (errno 2 on the storage backend),
# "-50005" (block or task not found), "-1, transfer is not enable".
CODE_INVALID_PARAM = -50000
CODE_OS_ERROR = -50002
CODE_NOT_FOUND = -50005
CODE_UNHEALTHY = -50011
CODE_UNKNOWN = -1

_CODE_RE = re.compile(r"^\s*\(?\s*(-?\d+)")


class UcmError(BackendError):
    """A UCM call failed. ``code`` is UCM's status code when it reported one, else -1."""

    def __init__(self, operation: str, code: int | None = None, detail: str = ""):
        super().__init__("ucm", operation, CODE_UNKNOWN if code is None else code, detail)


class _SubmitError(UcmError):
    """UCM refused to start a task at all: a store-level problem, never a per-block miss."""


# --------------------------------------------------------------------------------------------
# configuration


def load_ucm_yaml(path: str | Path) -> dict[str, Any]:
    """Parse the YAML file UCM users write (``UCM_CONFIG_FILE``).

    Returns the whole document as a dict after checking its shape: ``ucm_connectors`` is a
    non-empty list of ``{ucm_connector_name: str, ucm_connector_config: dict}``. Use
    ``UcmStore.from_config(doc["ucm_connectors"][0])`` (or just the inner config) to open it.
    """
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - PyYAML ships with UCM and vLLM
        raise UcmInstallationError("PyYAML is needed to read UCM config files") from exc
    text = Path(path).read_text()
    doc = yaml.safe_load(text)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    connectors = doc.get("ucm_connectors")
    if not isinstance(connectors, list) or not connectors:
        raise ValueError(f"{path}: 'ucm_connectors' must be a non-empty list")
    for i, entry in enumerate(connectors):
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: ucm_connectors[{i}] must be a mapping")
        name = entry.get("ucm_connector_name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{path}: ucm_connectors[{i}].ucm_connector_name must be a string")
        cfg = entry.setdefault("ucm_connector_config", {})
        if cfg is None:
            entry["ucm_connector_config"] = {}
        elif not isinstance(cfg, dict):
            raise ValueError(f"{path}: ucm_connectors[{i}].ucm_connector_config must be a mapping")
    return doc


def _split_backends(value: Any) -> list[str]:
    if isinstance(value, (str, Path)):
        parts = [p for p in str(value).split(":") if p]
    elif isinstance(value, Sequence):
        parts = [str(p) for p in value]
    else:
        raise ValueError(f"storage_backends must be a path string or a list, got {value!r}")
    if not parts:
        raise ValueError("storage_backends is empty")
    return parts


def _native_config(
    config: Mapping[str, Any],
    tensor_size: int | None,
    tensors_per_block: int,
    lookup_only: bool = False,
) -> dict[str, Any]:
    cfg = dict(config)
    if "store_pipeline" not in cfg:
        raise ValueError("ucm_connector_config needs 'store_pipeline' (e.g. 'Posix')")
    if "storage_backends" in cfg:
        cfg["storage_backends"] = _split_backends(cfg["storage_backends"])
    if tensor_size is not None:
        if tensor_size <= 0 or tensors_per_block <= 0:
            raise ValueError("tensor_size and tensors_per_block must be positive")
        cfg.setdefault("tensor_size", tensor_size)
        cfg.setdefault("shard_size", tensor_size * tensors_per_block)
        cfg.setdefault("block_size", cfg["shard_size"])
    if "tensor_size" in cfg:
        t, s, b = (int(cfg[k]) for k in ("tensor_size", "shard_size", "block_size"))
        if t <= 0 or s % t or b % s:
            raise ValueError(f"UCM needs tensor_size | shard_size | block_size, got {t}, {s}, {b}")
        # device_id >= 0 makes the native store a "worker" that moves data; on the Posix
        # pipeline no device is touched, the pointers are host memory. A lookup-only store
        # still carries block_size: every Posix instance on one backend directory must publish
        # the same GC config (block_size included) or UCM refuses to open it (-50000).
        cfg.setdefault("device_id", -1 if lookup_only else 0)
    else:
        cfg.setdefault("device_id", -1)  # lookup only
    cfg.setdefault("posix_io_engine", "psync")
    cfg.setdefault("io_direct", False)
    return cfg


# --------------------------------------------------------------------------------------------
# buffers


def _address_and_size(buf: Any, writable: bool, keep: list[Any]) -> tuple[int, int]:
    """Host address and byte size of one contiguous buffer (torch tensor or buffer object)."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # torch.Tensor, duck-typed
        if not buf.is_contiguous():
            raise ValueError("tensor buffers must be contiguous")
        keep.append(buf)
        from kv_common import device  # every tensor address goes through the device shim

        return device.data_ptr(buf), device.nbytes(buf)
    view = memoryview(buf)
    if writable and view.readonly:
        raise ValueError("load needs writable buffers")
    if not view.c_contiguous:
        raise ValueError("buffers must be C-contiguous")
    flat = view if view.ndim == 1 and view.format == "B" else view.cast("B")
    if not flat.readonly and flat.nbytes:
        # ctypes takes a writable buffer's address in ~0.3 us, numpy in ~1.6 (once per block)
        char = ctypes.c_char.from_buffer(flat)
        keep.append(char)
        return ctypes.addressof(char), flat.nbytes
    import numpy as np  # UCM needs numpy anyway

    arr = np.frombuffer(flat, np.uint8)
    keep.append(arr)
    return int(arr.ctypes.data), int(arr.nbytes)


def _exception_code(exc: BaseException) -> int:
    for arg in getattr(exc, "args", ()):
        if isinstance(arg, int) and not isinstance(arg, bool):
            return arg
        if isinstance(arg, str):
            match = _CODE_RE.match(arg)
            if match:
                return int(match.group(1))
    return CODE_UNKNOWN


# --------------------------------------------------------------------------------------------
# the store


class UcmStore:
    """Synchronous per-block facade over one UCM v1 store.

    Each block is ``tensors_per_block`` buffers of ``tensor_size`` bytes (for vLLM's CPU layout:
    one ``[num_kv_heads, block_size, 2*head_size]`` slice per layer). ``buffers[i]`` passed to
    ``dump``/``load`` is either one buffer (when ``tensors_per_block == 1``) or a sequence of
    them. Buffers are torch tensors or any C-contiguous buffer object (memoryview, bytearray,
    numpy array); ``load`` needs them writable.
    """

    def __init__(self, store: Any, native_config: Mapping[str, Any], connector_name: str):
        self._store = store
        self.config = dict(native_config)
        self.connector_name = connector_name
        self.tensor_size: int | None = (
            int(self.config["tensor_size"]) if "tensor_size" in self.config else None
        )
        self.tensors_per_block = int(self.config["shard_size"]) // self.tensor_size if self.tensor_size else 0
        self.shards_per_block = (
            int(self.config["block_size"]) // int(self.config["shard_size"]) if self.tensor_size else 0
        )
        self.can_transfer = self.tensor_size is not None and int(self.config["device_id"]) >= 0

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        tensor_size: int | None = None,
        tensors_per_block: int = 1,
        connector_name: str | None = None,
        lookup_only: bool = False,
    ) -> UcmStore:
        """Open a UCM store from a ``ucm_connector_config`` dict.

        ``config`` is what UCM users write, e.g. ``{"store_pipeline": "Posix",
        "storage_backends": "/mnt/kv"}`` (colon-separated paths, or a list). A whole
        ``ucm_connectors`` entry (``{"ucm_connector_name": ..., "ucm_connector_config": ...}``)
        is accepted too. ``tensor_size`` (bytes per buffer) and ``tensors_per_block`` size the
        store for transfers; native keys already in ``config`` (``tensor_size``, ``shard_size``,
        ``block_size``, ``device_id``, ``posix_io_engine``, ...) win. Without any size, or with
        ``lookup_only``, the store can only look up (UCM's scheduler role, ``device_id=-1``);
        give it the sizes anyway when writers share its directory (UCM checks they agree).
        """
        if "ucm_connector_config" in config:
            connector_name = connector_name or config.get("ucm_connector_name")
            config = config.get("ucm_connector_config") or {}
        name = connector_name or DEFAULT_CONNECTOR_NAME
        native = _native_config(config, tensor_size, tensors_per_block, lookup_only)
        check_ucm_installation()
        try:
            factory = importlib.import_module("ucm.store.factory_v1").UcmConnectorFactoryV1
        except ImportError as exc:
            raise UcmInstallationError(f"cannot import UCM's v1 store factory: {exc}") from exc
        try:
            store = factory.create_connector(name, dict(native))
        except (ValueError, KeyError, TypeError) as exc:
            raise UcmError("create", CODE_UNKNOWN, f"{name}: {exc}") from exc
        except RuntimeError as exc:
            detail = f"{name}: {exc}"
            backends = native.get("storage_backends") or []
            if len(backends) > 1 and _exception_code(exc) == CODE_NOT_FOUND:
                # UCM 0.8.1 lays out the shard directories (000..fff) in the first backend
                # only and refuses further backends that do not have them yet.
                detail += (
                    "; UCM needs every storage backend after the first to contain its shard "
                    "directories already (see UCM's log for 'Failed to add storage backend')"
                )
            raise UcmError("create", _exception_code(exc), detail) from exc
        return cls(store, native, name)

    @property
    def raw(self) -> Any:
        """The underlying ``UcmKVStoreBaseV1`` (for features this adapter does not wrap)."""
        if self._store is None:
            raise UcmError("use", CODE_UNKNOWN, "store is closed")
        return self._store

    # -- lookups -----------------------------------------------------------------------------

    @staticmethod
    def _check_ids(block_ids: Sequence[bytes]) -> list[bytes]:
        ids = []
        for i, bid in enumerate(block_ids):
            if not isinstance(bid, (bytes, bytearray)) or len(bid) != UCM_BLOCK_ID_SIZE:
                raise ValueError(
                    f"block_ids[{i}]: UCM block ids are exactly {UCM_BLOCK_ID_SIZE} bytes, got {bid!r:.60}"
                )
            ids.append(bytes(bid))
        return ids

    def lookup(self, block_ids: Sequence[bytes]) -> list[bool]:
        return self._lookup(self._check_ids(block_ids))

    def _lookup(self, ids: list[bytes]) -> list[bool]:
        """``lookup`` of ids already checked (``_check_ids``)."""
        if not ids:
            return []
        try:
            found = self.raw.lookup(ids)
        except RuntimeError as exc:
            raise UcmError("lookup", _exception_code(exc), str(exc)) from exc
        return [bool(x) for x in found]

    def lookup_on_prefix(self, block_ids: Sequence[bytes]) -> int:
        """Number of leading blocks present (UCM returns the last index, -1 for none)."""
        ids = self._check_ids(block_ids)
        if not ids:
            return 0
        try:
            last = int(self.raw.lookup_on_prefix(ids))
        except RuntimeError as exc:
            raise UcmError("lookup_on_prefix", _exception_code(exc), str(exc)) from exc
        return last + 1

    # -- transfers ---------------------------------------------------------------------------

    def _addresses(
        self, ids: list[bytes], buffers: Sequence[Any], writable: bool, keep: list[Any]
    ) -> list[list[int]]:
        if not self.can_transfer:
            raise UcmError("transfer", CODE_UNKNOWN, "store opened for lookup only (no tensor_size)")
        if len(buffers) != len(ids):
            raise ValueError(f"{len(ids)} block ids but {len(buffers)} buffers")
        rows = []
        for i, entry in enumerate(buffers):
            parts = list(entry) if isinstance(entry, (list, tuple)) else [entry]
            if len(parts) != self.tensors_per_block:
                raise ValueError(
                    f"block {i}: {len(parts)} buffers, the store expects {self.tensors_per_block} per block"
                )
            row = []
            for part in parts:
                addr, size = _address_and_size(part, writable, keep)
                if size != self.tensor_size:
                    raise ValueError(
                        f"block {i}: buffer of {size} bytes, the store expects {self.tensor_size}"
                    )
                row.append(addr)
            rows.append(row)
        return rows

    def _run(self, operation: str, ids: list[bytes], shard: int, rows: list[list[int]]) -> None:
        """Submit one task and wait for it; any UCM failure raises UcmError (_SubmitError when
        UCM refuses the task itself, e.g. -1 "transfer is not enable" on a lookup-only store)."""
        import numpy as np

        store = self.raw
        addrs = np.asarray(rows, dtype=np.uint64).reshape(len(rows), self.tensors_per_block)
        submit = store.dump_data if operation == "dump" else store.load_data
        try:
            task = submit(ids, [shard] * len(ids), addrs)
        except RuntimeError as exc:
            raise _SubmitError(operation, _exception_code(exc), str(exc)) from exc
        try:
            store.wait(task)
        except RuntimeError as exc:
            raise UcmError(operation, _exception_code(exc), str(exc)) from exc

    def _per_block(self, operation: str, ids: list[bytes], rows: list[list[int]], shard: int) -> list[bool]:
        if not ids:
            return []
        try:
            self._run(operation, ids, shard, rows)
            return [True] * len(ids)
        except UcmError as exc:
            if isinstance(exc, _SubmitError) or exc.code == CODE_UNHEALTHY:
                raise
            if len(ids) == 1:
                return [False]
        # A batch fails as a whole in UCM: retry block by block to find the bad ones.
        results = []
        for bid, row in zip(ids, rows, strict=True):
            try:
                self._run(operation, [bid], shard, [row])
                results.append(True)
            except UcmError as exc:
                if isinstance(exc, _SubmitError) or exc.code == CODE_UNHEALTHY:
                    raise
                results.append(False)
        return results

    def dump(self, block_ids: Sequence[bytes], buffers: Sequence[Any], *, shard: int = 0) -> list[bool]:
        """Write each block's buffers under its id. Per block: stored.

        UCM's Posix store overwrites a block that already exists (last writer wins); a block
        becomes visible to lookups once its last shard is written."""
        ids = self._check_ids(block_ids)
        keep: list[Any] = []
        rows = self._addresses(ids, buffers, writable=False, keep=keep)
        return self._per_block("dump", ids, rows, shard)

    def load(self, block_ids: Sequence[bytes], buffers: Sequence[Any], *, shard: int = 0) -> list[bool]:
        """Read each block into its buffers. Per block: loaded. A missing or unreadable block
        is ``False`` (its buffers may be partly overwritten); nothing raises for a miss."""
        ids = self._check_ids(block_ids)
        keep: list[Any] = []
        rows = self._addresses(ids, buffers, writable=True, keep=keep)
        present = self._lookup(ids)
        todo = [i for i, p in enumerate(present) if p]
        loaded = self._per_block("load", [ids[i] for i in todo], [rows[i] for i in todo], shard)
        results = [False] * len(ids)
        for i, ok in zip(todo, loaded, strict=True):
            results[i] = ok
        return results

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Release the native store (UCM joins its worker threads: about 3 s for Posix)."""
        store, self._store = self._store, None
        if store is not None:
            # UCM's stores have no close(); they release everything when collected.
            del store

    @property
    def closed(self) -> bool:
        return self._store is None

    def __enter__(self) -> UcmStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.config.get("store_pipeline", "?")
        return f"UcmStore({self.connector_name}, {state})"
