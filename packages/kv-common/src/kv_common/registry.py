"""Connector discovery (entry-point group ``kv_common.connectors``) and the one bridge into vLLM.

This module is import-light on purpose: vLLM imports each package's ``vllm.general_plugins``
entry point in every process (front-end, EngineCore, workers), so nothing heavy may load here.

Names (the co-installation policy, README "Connector names"):

- every connector has a name of its own that always selects ours: ``Kv`` + the vllm-ascend name
  (``KvMooncakeConnectorV1``), a subclass of that name. A registered name is always the
  ``__name__`` of its class: vLLM's MultiConnector keys its children's stats by class name and looks
  the class up in the registry by that name (``multi_connector.py``, ``build_kv_connector_stats``),
  so a name that is not a class name (``kv_mooncake.MooncakeConnectorV1``) crashes a
  multiprocess engine at its first stats report;
- the names users already have in their configs (vllm-ascend's ``MooncakeConnectorV1`` ...) are
  *shared names*: registered when free, left alone (with one warning) when another package owns
  them or is about to register them;
- registering never raises because a name is taken: vLLM calls general plugins unguarded, so a
  raise here (or in the other package's plugin, if we took its name first) stops vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata as importlib_metadata

from kv_common.logging_utils import get_logger

logger = get_logger(__name__)

ENTRY_POINT_GROUP = "kv_common.connectors"
VLLM_PLUGIN_GROUP = "vllm.general_plugins"
# "0": register our own names only (the way out when a package we do not know registers a
# shared name after us with vLLM's raising ``register_connector``).
SHARED_NAMES_ENV = "KV_COMMON_SHARED_NAMES"

# Other projects' general plugins that register some of our shared names with vLLM's raising
# ``register_connector`` (top-level module of the plugin -> distribution, names). When such a
# plugin will run in this process we leave those names to it whatever the load order: if we took
# them first, *its* plugin would raise and vLLM would not start.
# vllm-ascend: vllm_ascend/distributed/kv_transfer/__init__.py::register_connector.
KNOWN_NAME_OWNERS: dict[str, tuple[str, frozenset[str]]] = {
    "vllm_ascend": (
        "vllm-ascend",
        frozenset({"MooncakeConnectorV1", "MooncakeConnectorStoreV1", "AscendStoreConnector", "UCMConnector"}),
    ),
}


class ConnectorRegistryError(RuntimeError):
    """A connector entry point is broken or declares a name twice (discovery only; never raised
    by ``register_with_vllm`` because a name is taken)."""


@dataclass(frozen=True)
class ConnectorSpec:
    """Where vLLM finds a connector class: resolved lazily, so only the chosen one is imported."""

    name: str  # our own name (``Kv`` + the vllm-ascend name): always selects this class
    module: str
    class_name: str  # == name: vLLM's MultiConnector finds a child's class by its __name__
    # The distribution that ships it; filled in by discovery, used by ``python -m kv_common list``.
    package: str = ""
    package_version: str = ""
    # Names other projects use too (vllm-ascend's): registered only when free, each for the class of
    # that name in ``module``.
    shared_names: tuple[str, ...] = ()
    # "module:function" that parses this connector's kv_connector_extra_config exactly as the
    # connector does at start-up, without vLLM: ``function(extra, connector_name) -> config``
    # (used by ``python -m kv_common doctor``; the module must be import-light).
    config_parser: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.shared_names)

    @property
    def target(self) -> tuple[str, str]:
        return (self.module, self.class_name)

    def target_of(self, name: str) -> tuple[str, str]:
        """(module, class) that ``name`` selects: the class of that very name."""
        return (self.module, name) if name in self.shared_names else self.target


# name -> spec that this process registered into vLLM's factory (or found already registered).
_registered: dict[str, ConnectorSpec] = {}
# names already warned about in this process: one warning per name, however often plugins load.
_warned: set[str] = set()


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
            for name in spec.names:
                previous = found.get(name)
                if previous is not None and previous.target_of(name) != spec.target_of(name):
                    raise ConnectorRegistryError(
                        f"connector name {name!r} is declared twice: by {previous.package} "
                        f"({'.'.join(previous.target_of(name))}) and by {spec.package} "
                        f"({'.'.join(spec.target_of(name))})"
                    )
                found[name] = spec
    return sorted({s.name: s for s in found.values()}.values(), key=lambda s: s.name)


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


def _plugin_allowed(name: str) -> bool:
    """vLLM's own rule (``vllm.plugins.load_plugins_by_group``): VLLM_PLUGINS is an allowlist."""
    allowed = os.environ.get("VLLM_PLUGINS")
    return allowed is None or name in allowed.split(",")


def shared_name_claims() -> dict[str, str]:
    """shared name -> the installed package whose general plugin will register it in this process."""
    claims: dict[str, str] = {}
    for ep in importlib_metadata.entry_points(group=VLLM_PLUGIN_GROUP):
        top = ep.value.split(":", 1)[0].split(".", 1)[0]
        known = KNOWN_NAME_OWNERS.get(top)
        if known is None or not _plugin_allowed(ep.name):
            continue
        package, names = known
        for name in names:
            claims.setdefault(name, f"{package} (general plugin {ep.name} = {ep.value})")
    return claims


def shared_names_enabled() -> bool:
    return os.environ.get(SHARED_NAMES_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def describe_owner(
    target: tuple[str, str] | None, spec: ConnectorSpec | None = None, name: str | None = None
) -> str:
    """Who a registry entry belongs to: ``ours``, ``vLLM built-in (...)``, ``<package> (...)``."""
    if target is None:
        return "unknown (loader not readable)"
    if spec is not None and name is not None and target == spec.target_of(name):
        return "ours"
    where = f"{target[0]}.{target[1]}"
    top = target[0].split(".", 1)[0]
    if top == "vllm":
        return f"vLLM built-in ({where})"
    known = KNOWN_NAME_OWNERS.get(top)
    return f"{known[0]} ({where})" if known else where


def _warn_once(name: str, message: str, *args: object, level: int = logging.WARNING) -> None:
    if name in _warned:
        return
    _warned.add(name)
    logger.log(level, message, *args)


def register_with_vllm(specs: Iterable[ConnectorSpec] | None = None) -> list[str]:
    """Register connectors with vLLM's ``KVConnectorFactory``; the only function that touches it.

    Never raises because a name is taken (vLLM would not start). Idempotent: vLLM loads plugins
    in every process, sometimes twice. Returns the names newly added.
    """
    from kv_common.vllm_compat import connector_factory

    factory = connector_factory()
    registry = factory._registry  # noqa: SLF001 - vLLM exposes no "is registered" query
    use_shared = shared_names_enabled()
    claims: dict[str, str] | None = None
    added = []
    for spec in discover_connectors() if specs is None else specs:
        for name in spec.names:
            shared = name != spec.name
            if shared and not use_shared:
                continue
            module, class_name = want = spec.target_of(name)
            ours = _registered.get(name)
            if ours is not None and ours.target_of(name) == want and name in registry:
                continue
            if name in registry:
                target = _registered_target(registry[name])
                if target == want:  # an earlier import of this module registered it
                    _registered[name] = spec
                    continue
                owner = describe_owner(target)
                if shared:
                    _warn_once(
                        name,
                        "KV connector name %r is owned by %s; left to it. "
                        "Select %s.%s with kv_connector=%r.",
                        name, owner, spec.module, spec.class_name, spec.name,
                    )
                else:
                    _warn_once(
                        name,
                        "KV connector name %r is already taken by %s: %s.%s cannot be selected by "
                        "that name (another package uses our own name scheme Kv<vllm-ascend name>).",
                        name, owner, module, class_name, level=logging.ERROR,
                    )
                continue
            if shared:
                if claims is None:
                    claims = shared_name_claims()
                claimant = claims.get(name)
                if claimant is not None:
                    _warn_once(
                        name,
                        "KV connector name %r is left to %s, which registers it too. "
                        "Select %s.%s with kv_connector=%r.",
                        name, claimant, spec.module, spec.class_name, spec.name,
                    )
                    continue
            factory.register_connector(name, module, class_name)
            _registered[name] = spec
            added.append(name)
            logger.debug("registered KV connector %s -> %s.%s", name, module, class_name)
    return added


@dataclass(frozen=True)
class NameOwner:
    """One connector name and who answers to it in vLLM's factory (``python -m kv_common list``)."""

    name: str
    spec: ConnectorSpec
    shared: bool
    owner: str  # "ours", "vLLM built-in (...)", "<package> (...)", or "not registered: <why>"


def name_owners(specs: Iterable[ConnectorSpec], registry: dict | None) -> list[NameOwner]:
    """For each name of ``specs``: who owns it in ``registry`` (vLLM's ``KVConnectorFactory._registry``
    after the general plugins ran), or, with ``registry=None`` (no vLLM), what registering would do."""
    claims = shared_name_claims()
    use_shared = shared_names_enabled()
    out = []
    for spec in specs:
        for name in spec.names:
            shared = name != spec.name
            if registry is not None and name in registry:
                owner = describe_owner(_registered_target(registry[name]), spec, name)
            elif shared and not use_shared:
                owner = f"not registered: {SHARED_NAMES_ENV}=0"
            elif shared and name in claims:
                owner = f"left to {claims[name]}"
            elif registry is None:
                owner = "would be ours (free)"
            else:
                owner = "not registered"
            out.append(NameOwner(name, spec, shared, owner))
    return out
