"""Connector discovery (entry-point group ``kv_common.connectors``) and the one bridge into vLLM.

This module is import-light on purpose: vLLM imports each package's ``vllm.general_plugins``
entry point in every process (front-end, EngineCore, workers), so nothing heavy may load here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata as importlib_metadata

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kv_common.connectors"


class ConnectorRegistryError(RuntimeError):
    """A connector name cannot be registered (owned by someone else, or a broken entry point)."""


@dataclass(frozen=True)
class ConnectorSpec:
    """Where vLLM finds a connector class: resolved lazily, so only the chosen one is imported."""

    name: str
    module: str
    class_name: str
    # The distribution that ships it; filled in by discovery, used by ``python -m kv_common list``.
    package: str = ""
    package_version: str = ""
    # "module:function" that parses this connector's kv_connector_extra_config exactly as the
    # connector does at start-up, without vLLM: ``function(extra, connector_name) -> config``
    # (used by ``python -m kv_common doctor``; the module must be import-light).
    config_parser: str = ""


# name -> spec that this process registered into vLLM's factory.
_registered: dict[str, ConnectorSpec] = {}


def _specs_from_entry_point(ep: importlib_metadata.EntryPoint) -> list[ConnectorSpec]:
    try:
        loaded = ep.load()
    except Exception as exc:  # a broken plugin must not hide the others
        raise ConnectorRegistryError(f"entry point {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
    specs = list(loaded) if isinstance(loaded, (list, tuple)) else [loaded]
    dist = getattr(ep, "dist", None)
    package = dist.metadata["Name"] if dist is not None else ""
    version = dist.version if dist is not None else ""
    out = []
    for spec in specs:
        if not isinstance(spec, ConnectorSpec):
            raise ConnectorRegistryError(
                f"entry point {ep.name!r} ({ep.value}) must give a ConnectorSpec, got {type(spec).__name__}"
            )
        out.append(dataclasses.replace(spec, package=package, package_version=version))
    return out


def discover_connectors() -> list[ConnectorSpec]:
    """All connectors installed in this environment, sorted by name. Works without vLLM."""
    found: dict[str, ConnectorSpec] = {}
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        for spec in _specs_from_entry_point(ep):
            previous = found.get(spec.name)
            if previous is not None and (previous.module, previous.class_name) != (spec.module, spec.class_name):
                raise ConnectorRegistryError(
                    f"connector name {spec.name!r} is declared twice: by {previous.package} "
                    f"({previous.module}.{previous.class_name}) and by {spec.package} "
                    f"({spec.module}.{spec.class_name})"
                )
            found[spec.name] = spec
    return sorted(found.values(), key=lambda s: s.name)


def _registered_target(loader: object) -> tuple[str, str] | None:
    """(module, class) behind a factory loader closure, when it can be read."""
    cells = getattr(loader, "__closure__", None) or ()
    names = getattr(getattr(loader, "__code__", None), "co_freevars", ())
    # By variable name: CPython orders closure cells alphabetically (class_name before module_path).
    values = {name: getattr(c, "cell_contents", None) for name, c in zip(names, cells, strict=False)}
    module, class_name = values.get("module_path"), values.get("class_name")
    if isinstance(module, str) and isinstance(class_name, str):
        return module, class_name
    return None


def register_with_vllm(specs: Iterable[ConnectorSpec] | None = None) -> list[str]:
    """Register connectors with vLLM's ``KVConnectorFactory``; the only function that touches it.

    Idempotent: vLLM loads plugins in every process, sometimes twice. A name that vLLM already
    maps to a different class raises ``ConnectorRegistryError``. Returns the names newly added.
    """
    from kv_common.vllm_compat import connector_factory

    factory = connector_factory()
    registry = factory._registry  # noqa: SLF001 - vLLM exposes no "is registered" query
    added = []
    for spec in discover_connectors() if specs is None else specs:
        ours = _registered.get(spec.name)
        if ours is not None and (ours.module, ours.class_name) == (spec.module, spec.class_name):
            continue
        if spec.name in registry:
            target = _registered_target(registry[spec.name])
            if target == (spec.module, spec.class_name):
                _registered[spec.name] = spec
                continue
            owner = f"{target[0]}.{target[1]}" if target else "another class"
            raise ConnectorRegistryError(
                f"cannot register KV connector {spec.name!r} -> {spec.module}.{spec.class_name}: "
                f"vLLM already maps that name to {owner}. Pick another name."
            )
        factory.register_connector(spec.name, spec.module, spec.class_name)
        _registered[spec.name] = spec
        added.append(spec.name)
        logger.debug("registered KV connector %s -> %s.%s", spec.name, spec.module, spec.class_name)
    return added
