from __future__ import annotations

import msgspec
import pytest
from kv_common.config import ConnectorConfig, ConnectorConfigError, config_to_dict, parse_extra_config


class PoolConfig(ConnectorConfig):
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 5.0
    sizes: list[int] = []
    backend: str = "embedded"


def test_defaults_and_values():
    cfg = parse_extra_config("PoolConnector", PoolConfig, {"port": 5555, "sizes": [1, 2]})
    assert cfg.port == 5555 and cfg.sizes == [1, 2] and cfg.host == "127.0.0.1"
    assert parse_extra_config("PoolConnector", PoolConfig, None) == PoolConfig()


def test_lenient_strings_from_json_cli():
    # --kv-transfer-config values often arrive as strings: "5" is an acceptable port.
    assert parse_extra_config("PoolConnector", PoolConfig, {"port": "5"}).port == 5


def test_unknown_key_names_key_connector_and_known_keys():
    with pytest.raises(ConnectorConfigError) as err:
        parse_extra_config("PoolConnector", PoolConfig, {"prot": 1})
    message = str(err.value)
    assert err.value.key == "prot" and err.value.connector == "PoolConnector"
    assert "PoolConnector" in message and "'prot'" in message and "unknown key" in message
    assert "port" in message and "timeout_s" in message  # the keys it could have meant


def test_wrong_type_names_key_and_connector():
    with pytest.raises(ConnectorConfigError) as err:
        parse_extra_config("PoolConnector", PoolConfig, {"timeout_s": "soon"})
    assert err.value.key == "timeout_s"
    assert str(err.value).startswith("PoolConnector: kv_connector_extra_config key 'timeout_s'")
    assert "float" in str(err.value)


def test_wrong_type_inside_a_list():
    with pytest.raises(ConnectorConfigError, match="key 'sizes'.*int"):
        parse_extra_config("PoolConnector", PoolConfig, {"sizes": [1, "x"]})


def test_config_is_frozen_and_round_trips():
    cfg = parse_extra_config("PoolConnector", PoolConfig, {"port": 7})
    with pytest.raises(AttributeError):
        cfg.port = 8  # type: ignore[misc]
    assert parse_extra_config("PoolConnector", PoolConfig, config_to_dict(cfg)) == cfg
    assert isinstance(cfg, msgspec.Struct)


def test_config_error_is_a_value_error():
    assert issubclass(ConnectorConfigError, ValueError)
