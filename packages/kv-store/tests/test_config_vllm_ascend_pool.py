"""vllm-ascend's documented AscendStoreConnector extra configs load (values as their docs write them)."""

from __future__ import annotations

import logging

import pytest
from kv_common.config import ConnectorConfigError
from kv_store.config import StoreConfig, parse_config

# docs/source/user_guide/feature_guide/kv_pool.md (vllm-ascend), verbatim extra configs
DOCUMENTED = [
    {"lookup_rpc_port": "0", "backend": "mooncake"},
    {"lookup_rpc_port": "0", "backend": "mooncake", "consumer_is_to_put": True, "prefill_pp_size": 2,
     "prefill_pp_layer_partition": "30,31"},
    # layerwise_kv_pool.md / tests (backend dropped: memcache is not installed here)
    {"use_layerwise": True, "mooncake_rpc_port": "0", "layerwise_prefetch_layers": 2,
     "layerwise_max_transfer_blocks": 0, "layerwise_max_transfer_bytes": 0, "h2d_stagger_us": 0,
     "discard_partial_chunks": False, "layerwise_num_shared_buffers": 3, "layerwise_independent_layers": [0]},
    {"register_buffer": True, "use_layerwise": False, "mooncake_rpc_port": "0", "load_async": True},
    {"consumer_is_to_load": "true", "load_async": "false"},
]


@pytest.mark.parametrize("extra", DOCUMENTED)
def test_documented_pool_configs_load(extra):
    assert isinstance(parse_config(extra, "AscendStoreConnector"), StoreConfig)


def test_honoured_keys_change_behaviour():
    assert parse_config({"load_async": "true"}).load_mode == "async"
    assert parse_config({"load_async": "false"}).load_mode == "sync"
    # no layer-wise mode: use_layerwise is accepted (vllm-ascend's configs start) without effect
    assert parse_config({"use_layerwise": "true"}).load_mode == "sync"
    assert parse_config({"use_layerwise": "true", "load_async": True}).load_mode == "async"
    assert parse_config({}).load_mode == "sync"
    assert parse_config({"consumer_is_to_put": "true"}).save is True
    assert parse_config({"consumer_is_to_put": False}).save is None
    assert parse_config({"consumer_is_to_load": True}).load is True
    assert parse_config({"consumer_is_to_load": "0"}).load is False


def test_contradicting_keys_are_refused_naming_both():
    with pytest.raises(ConnectorConfigError, match=r"key 'load_async'.*load_mode 'async'"):
        parse_config({"load_async": "false", "load_mode": "async"})


def test_layerwise_load_mode_is_refused_pointing_to_load_async():
    with pytest.raises(ConnectorConfigError, match=r"key 'load_mode'.*'layerwise' was removed.*load_async"):
        parse_config({"load_mode": "layerwise"})
    with pytest.raises(ConnectorConfigError, match=r"key 'consumer_is_to_put'.*save"):
        parse_config({"consumer_is_to_put": True, "save": False})
    with pytest.raises(ConnectorConfigError, match=r"key 'consumer_is_to_load'.*load"):
        parse_config({"consumer_is_to_load": "1", "load": "0"})


@pytest.mark.parametrize("backend", ["memcache", "yuanrong", "nosuch"])
def test_backend_not_installed_names_installed_backends(backend):
    with pytest.raises(ConnectorConfigError) as err:
        parse_config({"backend": backend, "lookup_rpc_port": "0"}, "AscendStoreConnector")
    message = str(err.value)
    assert err.value.key == "backend" and f"{backend!r}" in message
    assert "embedded" in message and "mooncake" in message


def test_unknown_key_and_garbage_name_the_key():
    with pytest.raises(ConnectorConfigError, match=r"AscendStoreConnector: .*key 'lookup_rpc_prot': unknown key"):
        parse_config({"lookup_rpc_prot": "0"}, "AscendStoreConnector")
    with pytest.raises(ConnectorConfigError, match=r"key 'load_async'.*'maybe'"):
        parse_config({"load_async": "maybe"})


def test_no_effect_keys_warn(caplog):
    caplog.set_level(logging.WARNING)
    parse_config({"register_buffer": True}, "MooncakeConnectorStoreV1")
    assert "register_buffer" in StoreConfig.no_effect_keys
    assert "lookup_rpc_port" in StoreConfig.no_effect_keys
