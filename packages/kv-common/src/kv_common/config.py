"""``kv_connector_extra_config`` parsed into one typed, frozen config per connector.

A connector declares ``class MyConfig(ConnectorConfig): ...`` (a msgspec Struct that forbids
unknown fields) and calls ``parse_extra_config("MyConnector", MyConfig, extra)``. An unknown key or
a wrong type raises one ``ConnectorConfigError`` that names the key and the connector.

Values may be written as strings, the way vllm-ascend's docs write them (``"lookup_rpc_port":
"0"``, ``"load_async": "true"``): they are converted to the declared type, and a string that is no
such value fails naming the key and the value.

Two hooks on a config class:

- ``no_effect_keys`` (ClassVar ``{key: why}``): keys accepted for compatibility with another
  project's configs that do nothing here. Each one present logs one warning per process.
- ``check()``: cross-key validation after parsing; raise ``ConfigKeyError(key, problem)`` and the
  error names the connector and the key like any other.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import msgspec

from kv_common.logging_utils import get_logger

logger = get_logger(__name__)


class ConnectorConfigError(ValueError):
    def __init__(self, connector: str, key: str | None, problem: str):
        self.connector = connector
        self.key = key
        where = f"key {key!r}" if key else "config"
        super().__init__(f"{connector}: kv_connector_extra_config {where}: {problem}")


class ConfigKeyError(ValueError):
    """Raised by ``ConnectorConfig.check``: ``parse_extra_config`` adds the connector's name."""

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}")


class ConnectorConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base for typed connector configs."""

    # key -> why it has no effect here (accepted so that other projects' configs start).
    no_effect_keys: ClassVar[dict[str, str]] = {}

    def check(self) -> None:
        """Cross-key validation; raise ``ConfigKeyError``."""

    def preflight(self, kv_transfer_config: Mapping[str, Any]) -> Any:
        """What ``python -m kv_common doctor`` should check for this config: a
        ``kv_common.doctor.Preflight`` (ports, peers, directories, engines), or None.
        ``kv_transfer_config`` is the connector's kv-transfer-config (kv_role, kv_port, kv_ip)."""
        return None

    def set_in_check(self, key: str, value: Any) -> None:
        """For ``check()`` only: map another project's spelling onto our key (configs are frozen)."""
        msgspec.structs.force_setattr(self, key, value)


C = TypeVar("C", bound=ConnectorConfig)

_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_AT = re.compile(r" - at `\$\.?([^`]*)`")
_warned: set[tuple[str, str]] = set()


def _path_key(path: str) -> str:
    """``prefill.tp_size`` from msgspec's ``prefill.tp_size`` / ``sizes[1]`` (list index dropped)."""
    return re.sub(r"\[\d+\]", "", path)


def _value_at(extra: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    value: Any = extra
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        try:
            value = value[int(part[1:-1])] if part.startswith("[") else value[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return False, None
    return True, value


def _nested_type(config_type: type[ConnectorConfig], path: str) -> type[ConnectorConfig]:
    """The ConnectorConfig class found at ``path`` (for the known-keys hint of a nested key)."""
    current: Any = config_type
    for part in [p for p in _path_key(path).split(".") if p]:
        hints = msgspec.structs.fields(current) if isinstance(current, type) else ()
        field = next((f for f in hints if f.name == part), None)
        if field is None:
            return current
        nested = [t for t in _struct_types(field.type)]
        if not nested:
            return current
        current = nested[0]
    return current


def _struct_types(tp: Any) -> list[type[ConnectorConfig]]:
    if isinstance(tp, type) and issubclass(tp, ConnectorConfig):
        return [tp]
    out: list[type[ConnectorConfig]] = []
    for arg in getattr(tp, "__args__", ()) or ():
        out.extend(_struct_types(arg))
    return out


def _warn_no_effect(connector: str, config: ConnectorConfig, extra: Mapping[str, Any], prefix: str = "") -> None:
    for key, why in type(config).no_effect_keys.items():
        if key in extra and (connector, prefix + key) not in _warned:
            _warned.add((connector, prefix + key))
            logger.warning(
                "%s: kv_connector_extra_config key %r is accepted for vllm-ascend compatibility but has "
                "no effect here: %s", connector, prefix + key, why,
            )
    for field in msgspec.structs.fields(config):
        value, raw = getattr(config, field.name), extra.get(field.name)
        if isinstance(value, ConnectorConfig) and isinstance(raw, Mapping):
            _warn_no_effect(connector, value, raw, f"{prefix}{field.name}.")


def _check_all(config: ConnectorConfig, prefix: str = "") -> None:
    for field in msgspec.structs.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, ConnectorConfig):
            _check_all(value, f"{prefix}{field.name}.")
    try:
        config.check()
    except ConfigKeyError as exc:
        raise ConfigKeyError(prefix + exc.key, exc.problem) from None


def parse_extra_config(connector: str, config_type: type[C], extra: Mapping[str, Any] | None) -> C:
    extra = dict(extra or {})
    try:
        config = msgspec.convert(extra, type=config_type, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        at = _AT.search(message)
        path = at.group(1) if at else ""
        unknown = _UNKNOWN.search(message)
        if unknown:
            owner = _nested_type(config_type, path) if path else config_type
            known = ", ".join(sorted(owner.__struct_fields__))
            key = f"{_path_key(path)}.{unknown.group(1)}" if path else unknown.group(1)
            raise ConnectorConfigError(connector, key, f"unknown key (known keys: {known})") from None
        problem = message.split(" - at ")[0]
        if path:
            found, value = _value_at(extra, path)
            if found and not isinstance(value, (Mapping, list)):
                problem = f"{problem} ({value!r})"
        raise ConnectorConfigError(connector, _path_key(path) or None, problem) from None
    try:
        _check_all(config)
    except ConfigKeyError as exc:
        raise ConnectorConfigError(connector, exc.key, exc.problem) from None
    _warn_no_effect(connector, config, extra)
    return config


def config_to_dict(config: ConnectorConfig) -> dict[str, Any]:
    return msgspec.to_builtins(config)
