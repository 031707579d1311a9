"""Backend selection: ``backend`` names an entry point in the ``kv_store.backends`` group.

A factory is ``make(config: StoreConfig, role) -> kv_common.backend.Backend``. Third parties add
their own with ``[project.entry-points."kv_store.backends"] mine = "pkg.mod:make"``, or name the
factory directly: ``"backend": "pkg.mod:make"``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib import metadata as importlib_metadata
from typing import Any

from kv_common.backend import Backend

from kv_store.config import StoreConfig, default_spill_dir, resolve_mooncake

GROUP = "kv_store.backends"


def available_backends() -> dict[str, str]:
    return {ep.name: ep.value for ep in importlib_metadata.entry_points(group=GROUP)}


def resolve_factory(name: str) -> Callable[[StoreConfig, Any], Backend]:
    builtin = {"embedded": make_embedded_backend, "mooncake": make_mooncake_backend}
    for ep in importlib_metadata.entry_points(group=GROUP):
        if ep.name == name:
            return ep.load()
    if name in builtin:  # not installed with entry points (e.g. run from a source tree)
        return builtin[name]
    if ":" in name:  # "pkg.module:factory"
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"AscendStoreConnector: backend {name!r} cannot be loaded: {exc}") from exc
    known = sorted(set(available_backends()) | set(builtin))
    raise ValueError(f"AscendStoreConnector: unknown backend {name!r} (known: {', '.join(known)})")


def make_backend(config: StoreConfig, role: Any = None) -> Backend:
    return resolve_factory(config.backend)(config, role)


def make_embedded_backend(config: StoreConfig, role: Any = None) -> Backend:
    from kv_store.embedded import EmbeddedStoreBackend

    opts = config.embedded
    # The default directory has a predictable name in the shared temp dir: it must be ours alone.
    return EmbeddedStoreBackend(
        capacity_bytes=opts.capacity_bytes,
        spill_dir=opts.spill_dir or default_spill_dir(),
        write_through=opts.write_through,
        spill_capacity_bytes=opts.spill_capacity_bytes,  # None: capped (default_spill_capacity); 0: none
        private_dir=not opts.spill_dir,
    )


def make_mooncake_backend(config: StoreConfig, role: Any = None) -> Backend:
    from kv_store.mooncake_backend import MooncakeBackend, bound_call_timeouts

    options = resolve_mooncake(config.mooncake)
    if options.get("protocol") == "tcp":  # the only transport whose call bound was measured
        bound_call_timeouts(config.load_timeout_s)
    if role is not None and getattr(role, "name", "") == "SCHEDULER":
        # The scheduler only asks "exists?": it contributes no memory to the pool.
        options["global_segment_size"] = 0
        options["local_buffer_size"] = min(options["local_buffer_size"], 16 << 20)
    return MooncakeBackend(
        options, setup_retries=config.mooncake.setup_retries, setup_timeout_s=config.mooncake.setup_timeout_s
    )
