"""Every kv-transfer-config in vllm-ascend's docs, examples and tests loads on our connectors.

The fixtures (tests/data/vllm_ascend_configs/*.json) are vllm-ascend's configs copied verbatim as
data, each with the file and line it came from. Each connector of ours (each child of a
MultiConnector) is parsed by the connector's own start-up parser (its ConnectorSpec's
``config_parser``, the function the connector itself calls), and the top level by vLLM's
``KVTransferConfig`` (which turns ``"kv_port": "30000"`` into an int), the way vLLM builds
MultiConnector's children.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import requires_vllm
from kv_common.config import ConnectorConfigError
from kv_common.doctor import find_spec, parse_connector_config
from kv_common.registry import discover_connectors

DATA = Path(__file__).parent / "data" / "vllm_ascend_configs"
SPECS = discover_connectors()
# Configs that vLLM 0.32 itself rejects before any connector runs (vllm-ascend on vLLM 0.32 too).
VLLM_REJECTS = {
    "kv_parallel_size": "vLLM 0.32's KVTransferConfig has no kv_parallel_size / kv_rank (removed upstream)",
    "$": "an unsubstituted shell variable in kv_port",
}


def _entries(kind: str) -> list[dict]:
    return json.loads((DATA / f"{kind}.json").read_text())["configs"]


def _leaves(config: dict) -> list[dict]:
    if config["kv_connector"] == "MultiConnector":
        return [c for child in config["kv_connector_extra_config"]["connectors"] for c in _leaves(child)]
    return [config]


ALL = [(kind, e) for kind in ("p2p", "pool", "multi") for e in _entries(kind)]


def test_fixtures_cover_what_the_issue_names():
    assert len(_entries("p2p")) > 100 and len(_entries("pool")) >= 8 and len(_entries("multi")) >= 8
    keys = {k for _, e in ALL for leaf in _leaves(e["config"]) for k in leaf.get("kv_connector_extra_config") or {}}
    assert {"prefill", "decode", "use_ascend_direct", "backend", "lookup_rpc_port", "use_layerwise", "load_async",
            "consumer_is_to_put", "prefill_pp_size", "prefill_pp_layer_partition", "mooncake_rpc_port"} <= keys
    multi = [e for e in _entries("multi")
             if {leaf["kv_connector"] for leaf in _leaves(e["config"])} == {"MooncakeConnectorV1", "AscendStoreConnector"}]
    assert multi, "a MultiConnector of P2P plus pool"


@pytest.mark.parametrize(("kind", "entry"), ALL, ids=[f"{k}:{e['sources'][0]}" for k, e in ALL])
def test_documented_config_parses_with_the_connectors_start_up_parser(kind, entry):
    parsed = 0
    for leaf in _leaves(entry["config"]):
        name, extra = leaf["kv_connector"], leaf.get("kv_connector_extra_config")
        if find_spec(name, SPECS) is None:
            continue  # another project's connector in the same MultiConnector (e.g. MooncakeHybridConnector)
        backend = str((extra or {}).get("backend", ""))
        if '"$' in json.dumps(extra):  # a doc template with shell placeholders ("$tp_size"): refused by key
            with pytest.raises(ConnectorConfigError, match=r"key '[a-z_.]+'.*'\$"):
                parse_connector_config(name, extra, SPECS)
        elif backend in ("memcache", "yuanrong"):  # NPU-only backends: refused, naming what is installed
            with pytest.raises(ConnectorConfigError, match=r"key 'backend'.*installed backends: .*embedded"):
                parse_connector_config(name, extra, SPECS)
        else:
            parse_connector_config(name, extra, SPECS)
        parsed += 1
    assert parsed, f"{entry['sources'][0]}: none of its connectors is ours"


@requires_vllm
@pytest.mark.parametrize(("kind", "entry"), ALL, ids=[f"{k}:{e['sources'][0]}" for k, e in ALL])
def test_documented_top_level_is_accepted_by_vllm(kind, entry):
    from vllm.config import KVTransferConfig

    text = json.dumps(entry["config"])
    reason = next((why for marker, why in VLLM_REJECTS.items() if marker in text), None)
    configs = [entry["config"]]
    if entry["config"]["kv_connector"] == "MultiConnector":  # vLLM builds each child the same way
        configs += entry["config"]["kv_connector_extra_config"]["connectors"]
    try:
        built = [KVTransferConfig(**c) for c in configs]
    except Exception:
        if reason is None:
            raise
        return
    for config, ktc in zip(configs, built, strict=True):
        if "kv_port" in config:
            assert ktc.kv_port == int(config["kv_port"])  # "30000" as their docs write it


def test_every_connector_names_its_start_up_parser():
    from kv_common.doctor import config_parser

    ours = [s for s in SPECS if not s.module.startswith("kv_common.testing")]
    names = {name for s in ours for name in s.names}
    assert names >= {"MooncakeConnectorV1", "AscendStoreConnector", "MooncakeConnectorStoreV1", "UCMConnector"}
    for spec in ours:
        assert spec.config_parser, f"{spec.name}: no config_parser for python -m kv_common doctor"
        assert callable(config_parser(spec))


@requires_vllm
def test_store_connectors_parse_the_type_their_parser_parses():
    # StoreConnectorBase parses kv_connector_extra_config as parse_extra_config(name, config_type, extra);
    # the doctor's parser must be that very call.
    from kv_store.config import StoreConfig
    from kv_store.connector import AscendStoreConnector, MooncakeConnectorStoreV1
    from kv_ucm.config import UCMConfig
    from kv_ucm.connector import UCMConnector

    assert AscendStoreConnector.config_type is StoreConfig and MooncakeConnectorStoreV1.config_type is StoreConfig
    assert UCMConnector.config_type is UCMConfig
    for name in ("AscendStoreConnector", "MooncakeConnectorStoreV1"):
        assert isinstance(parse_connector_config(name, {"use_layerwise": "true"}, SPECS), StoreConfig)
