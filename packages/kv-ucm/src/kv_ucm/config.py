"""``kv_connector_extra_config`` of UCMConnector.

UCM's own vocabulary, either as the YAML file UCM users already write::

    {"UCM_CONFIG_FILE": "/etc/ucm.yaml"}

    # ucm.yaml
    ucm_connectors:
      - ucm_connector_name: "UcmPipelineStore"
        ucm_connector_config:
          store_pipeline: "Posix"          # the tier that runs on CPU (local disk / NFS mount)
          storage_backends: "/mnt/kv"      # colon-separated, or a list
          io_direct: false

or the same settings inline (``"ucm_connectors": [...]``, or just ``"ucm_connector_config":
{...}`` with an optional ``"ucm_connector_name"``). Inline ``ucm_connector_config`` keys are merged
over the file's first connector, so one YAML can serve several instances with a different
``storage_backends`` each. Every generic store-connector key (``lookup_mode``, ``load_mode``,
``checksum``, ``load_failure_policy`` ...) is accepted next to these. Inline, UCM's
``use_layerwise`` is accepted with a warning and no effect (there is no layer-wise load mode; use
``load_mode: "async"``); in the YAML file UCM's connector-only top-level keys (``use_layerwise``,
``enable_event_sync`` ...) are ignored.

A disk cap is on by default for Posix pipelines (``disk_capacity_bytes``, ours, top level: None =
16 GiB or half the free space, 0 = off): the least recently used block files are removed first.

Defaults added to the UCM store config (a key given by the user wins):

* ``posix_gc_enable: false``: UCM's Posix garbage collector makes every live instance on one
  backend directory publish the same ``block_size`` and refuses a different one (-50000). Enable it
  (with ``posix_capacity_gb``) only when every instance sharing the directory has the same model
  and layout.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kv_common.config import parse_extra_config
from kv_common.logging_utils import get_logger
from kv_store.config import StoreConnectorConfig

from kv_ucm.ucm_store import DEFAULT_CONNECTOR_NAME, load_ucm_yaml

logger = get_logger(__name__)

# Top-level keys of UCM's YAML that mean something only to UCM's own (CUDA/NPU) connector.
_IGNORED_TOP_LEVEL = {
    "enable_event_sync",
    "use_layerwise",
    "load_only_first_rank",
    "metrics_config_path",
    "ucm_sparse_config",
    "hit_ratio",
    "persist_token_threshold",
}

NO_STORE_MESSAGE = (
    "no UCM store configured. Set kv_connector_extra_config "
    '{"UCM_CONFIG_FILE": "/path/ucm.yaml"} (UCM\'s YAML with a \'ucm_connectors\' list), or the same '
    'inline: {"ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": "/mnt/kv"}}'
)


class UCMConfig(StoreConnectorConfig, frozen=True):  # frozen like its base (said for mypy)
    # Path of UCM's YAML config (``ucm_connectors: [...]``).
    UCM_CONFIG_FILE: str | None = None
    # The same settings inline: a whole list, or one connector's name + config.
    ucm_connectors: list[dict[str, Any]] | None = None
    ucm_connector_name: str | None = None
    ucm_connector_config: dict[str, Any] | None = None
    # UCM's own top-level keys, accepted without effect (no_effect_keys).
    use_layerwise: bool | None = None
    # Accepted for config compatibility with UCM's connector; meaningless here (device events).
    enable_event_sync: bool | None = None
    # Cap on the block files in a Posix pipeline's storage_backends, least recently used evicted
    # first. None: 16 GiB or half the file system's free space, whichever is less; 0: no cap.
    # (Off by default when UCM's own posix_gc_enable is on.)
    disk_capacity_bytes: int | None = None

    no_effect_keys: ClassVar[dict[str, str]] = {
        "enable_event_sync": "device events of UCM's own CUDA/NPU connector; this connector copies on the host",
        "use_layerwise": "there is no layer-wise load mode (a stored value holds every layer of its block); "
                         "load_mode 'async' loads without holding up the forward",
    }

    def preflight(self, kv_transfer_config: Mapping[str, Any]) -> Any:
        return _preflight(self)

    def __post_init__(self) -> None:
        if self.UCM_CONFIG_FILE is None and self.ucm_connectors is None and self.ucm_connector_config is None:
            raise ValueError(NO_STORE_MESSAGE)
        if self.disk_capacity_bytes is not None and self.disk_capacity_bytes < 0:
            raise ValueError(f"disk_capacity_bytes must be >= 0 (0: no cap), got {self.disk_capacity_bytes}")


def _preflight(config: UCMConfig) -> Any:
    from kv_common.doctor import Preflight

    plan = Preflight(modules=[("ucm", "", "UCM")])
    try:
        spec = resolve_store_spec(config)
    except UCMConfigError as exc:
        plan.problems.append(str(exc))
        return plan
    backends = spec.connector_config.get("storage_backends")
    if spec.connector_config.get("store_pipeline") == "Posix" and backends:
        paths = backends.split(":") if isinstance(backends, str) else list(backends)
        plan.writable_dirs.extend((str(p), "UCM Posix storage_backends") for p in paths)
    return plan


def parse_config(extra: Mapping[str, Any] | None, connector: str = "UCMConnector") -> UCMConfig:
    """The connector's start-up parse (StoreConnectorBase parses ``UCMConfig`` the same way);
    also ``python -m kv_common doctor``'s. No vLLM needed."""
    return parse_extra_config(connector, UCMConfig, extra)


@dataclass(frozen=True)
class UcmStoreSpec:
    """What the backend opens: one ``ucm_connectors`` entry, resolved."""

    connector_name: str
    connector_config: dict[str, Any]
    source: str  # where it came from, for messages
    top_level: dict[str, Any] = field(default_factory=dict)  # other keys of the YAML file

    def as_entry(self) -> dict[str, Any]:
        return {"ucm_connector_name": self.connector_name, "ucm_connector_config": dict(self.connector_config)}


class UCMConfigError(ValueError):
    pass


def _check_entries(entries: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(entries, list) or not entries:
        raise UCMConfigError(f"UCMConnector: {where}: 'ucm_connectors' must be a non-empty list")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise UCMConfigError(f"UCMConnector: {where}: ucm_connectors[{i}] must be a mapping")
        name = entry.get("ucm_connector_name", DEFAULT_CONNECTOR_NAME)
        if not isinstance(name, str) or not name:
            raise UCMConfigError(f"UCMConnector: {where}: ucm_connectors[{i}].ucm_connector_name must be a string")
        cfg = entry.get("ucm_connector_config") or {}
        if not isinstance(cfg, dict):
            raise UCMConfigError(f"UCMConnector: {where}: ucm_connectors[{i}].ucm_connector_config must be a mapping")
        out.append({"ucm_connector_name": name, "ucm_connector_config": dict(cfg)})
    return out


def resolve_store_spec(config: UCMConfig) -> UcmStoreSpec:
    """The UCM store to open, from the file and/or the inline keys. Raises ``UCMConfigError``."""
    top: dict[str, Any] = {}
    entries: list[dict[str, Any]] | None = None
    sources = []
    if config.UCM_CONFIG_FILE:
        path = os.path.expanduser(config.UCM_CONFIG_FILE)
        if not os.path.isfile(path):
            raise UCMConfigError(f"UCMConnector: UCM_CONFIG_FILE {config.UCM_CONFIG_FILE!r} does not exist")
        try:
            doc = load_ucm_yaml(path)
        except ValueError as exc:
            raise UCMConfigError(f"UCMConnector: UCM_CONFIG_FILE {exc}") from None
        entries = _check_entries(doc["ucm_connectors"], path)
        top = {k: v for k, v in doc.items() if k != "ucm_connectors"}
        sources.append(path)
        if config.ucm_connectors is not None:
            raise UCMConfigError(
                "UCMConnector: give 'ucm_connectors' either in UCM_CONFIG_FILE or inline, not both "
                "(inline 'ucm_connector_config' keys can override the file's)"
            )
    elif config.ucm_connectors is not None:
        entries = _check_entries(config.ucm_connectors, "kv_connector_extra_config")
        sources.append("inline ucm_connectors")
    if entries is None:
        if config.ucm_connector_config is None:
            raise UCMConfigError(f"UCMConnector: {NO_STORE_MESSAGE}")
        entries = [{"ucm_connector_name": DEFAULT_CONNECTOR_NAME, "ucm_connector_config": {}}]
    if len(entries) > 1:
        logger.warning(
            "UCMConnector: %d ucm_connectors configured; using the first (%s)",
            len(entries), entries[0]["ucm_connector_name"],
        )
    entry = entries[0]
    name = config.ucm_connector_name or entry["ucm_connector_name"]
    store_cfg = dict(entry["ucm_connector_config"])
    if config.ucm_connector_config is not None:
        store_cfg.update(config.ucm_connector_config)
        sources.append("inline ucm_connector_config")
    source = " + ".join(sources)
    if not store_cfg.get("store_pipeline"):
        raise UCMConfigError(
            f"UCMConnector: ucm_connector_config ({source}) needs 'store_pipeline' "
            "(on CPU: 'Posix', with 'storage_backends' = a local or NFS directory)"
        )
    if store_cfg["store_pipeline"] in ("Posix",) and not store_cfg.get("storage_backends"):
        raise UCMConfigError(
            f"UCMConnector: ucm_connector_config ({source}) with store_pipeline 'Posix' needs "
            "'storage_backends' (a directory, colon-separated directories, or a list)"
        )
    store_cfg.setdefault("posix_gc_enable", False)
    ignored = sorted(k for k in top if k in _IGNORED_TOP_LEVEL)
    if ignored:
        logger.info("UCMConnector: UCM config keys %s have no effect in this connector", ", ".join(ignored))
    return UcmStoreSpec(name, store_cfg, source, top)

