"""``kv_connector_extra_config`` parsed into one typed, frozen config per connector.

A connector declares ``class MyConfig(ConnectorConfig): ...`` (a msgspec Struct that forbids
unknown fields) and calls ``parse_extra_config("MyConnector", MyConfig, extra)``. An unknown key or
a wrong type raises one ``ConnectorConfigError`` that names the key and the connector.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec


class ConnectorConfigError(ValueError):
    def __init__(self, connector: str, key: str | None, problem: str):
        self.connector = connector
        self.key = key
        where = f"key {key!r}" if key else "config"
        super().__init__(f"{connector}: kv_connector_extra_config {where}: {problem}")


class ConnectorConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base for typed connector configs."""


C = TypeVar("C", bound=ConnectorConfig)

_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_AT = re.compile(r" - at `\$\.([^`\[]*)")


def parse_extra_config(connector: str, config_type: type[C], extra: Mapping[str, Any] | None) -> C:
    extra = dict(extra or {})
    try:
        return msgspec.convert(extra, type=config_type, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        unknown = _UNKNOWN.search(message)
        if unknown:
            known = ", ".join(sorted(config_type.__struct_fields__))
            raise ConnectorConfigError(connector, unknown.group(1), f"unknown key (known keys: {known})") from None
        at = _AT.search(message)
        key = at.group(1) if at else None
        problem = message.split(" - at ")[0]
        raise ConnectorConfigError(connector, key, problem) from None


def config_to_dict(config: ConnectorConfig) -> dict[str, Any]:
    return msgspec.to_builtins(config)
