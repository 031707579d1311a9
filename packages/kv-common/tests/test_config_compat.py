"""Keys accepted for compatibility (one warning, no effect), checks that name their key, nested paths."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
from kv_common.config import ConfigKeyError, ConnectorConfig, ConnectorConfigError, parse_extra_config


class Sizes(ConnectorConfig):
    tp_size: int | None = None
    hint: str | None = None
    no_effect_keys: ClassVar[dict[str, str]] = {"hint": "hints are not used here"}


class CompatConfig(ConnectorConfig):
    port: int = 0
    flag: bool = False
    sizes: Sizes | None = None
    legacy_port: int | None = None
    no_effect_keys: ClassVar[dict[str, str]] = {"legacy_port": "no RPC between scheduler and workers"}

    def check(self) -> None:
        if self.port == 1:
            raise ConfigKeyError("port", "port 1 is reserved")


def parse(extra):
    return parse_extra_config("CompatConnector", CompatConfig, extra)


def test_strings_as_vllm_ascend_docs_write_them_are_coerced():
    cfg = parse({"port": "30000", "flag": "true", "sizes": {"tp_size": "8"}})
    assert cfg.port == 30000 and cfg.flag is True and cfg.sizes.tp_size == 8
    assert parse({"flag": "0"}).flag is False and parse({"flag": "1"}).flag is True


def test_garbage_string_names_key_and_value():
    with pytest.raises(ConnectorConfigError) as err:
        parse({"flag": "yes please"})
    assert err.value.key == "flag" and "'yes please'" in str(err.value)
    with pytest.raises(ConnectorConfigError) as err:
        parse({"sizes": {"tp_size": "eight"}})
    assert err.value.key == "sizes.tp_size" and "'eight'" in str(err.value)


def test_unknown_nested_key_names_its_path_and_the_nested_known_keys():
    with pytest.raises(ConnectorConfigError) as err:
        parse({"sizes": {"tp": 2}})
    assert err.value.key == "sizes.tp"
    assert "tp_size" in str(err.value) and "legacy_port" not in str(err.value)


def test_no_effect_key_is_accepted_with_one_warning(caplog):
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        cfg = parse({"legacy_port": "0", "sizes": {"hint": "x"}})
    assert cfg.legacy_port == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "'legacy_port'" in w]) == 1
    assert len([w for w in warnings if "'sizes.hint'" in w]) == 1
    assert all("no effect" in w and "CompatConnector" in w for w in warnings)


def test_check_errors_name_key_and_connector():
    with pytest.raises(ConnectorConfigError) as err:
        parse({"port": 1})
    assert err.value.key == "port" and err.value.connector == "CompatConnector"
    assert "port 1 is reserved" in str(err.value)
