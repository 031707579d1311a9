"""UCMConfig parsing and store resolution (no UCM, no vLLM needed: runs on Python 3.11)."""

from __future__ import annotations

import textwrap

import pytest
from kv_common.config import ConnectorConfigError, parse_extra_config
from kv_ucm.block_ids import UCM_BLOCK_ID_SIZE, ucm_block_id, ucm_key_id
from kv_ucm.config import UCMConfig, UCMConfigError, resolve_store_spec

pytest.importorskip("yaml")


def parse(**extra) -> UCMConfig:
    return parse_extra_config("UCMConnector", UCMConfig, extra)


def write_yaml(tmp_path, body: str, name: str = "ucm.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


YAML = """\
    ucm_connectors:
      - ucm_connector_name: "UcmPipelineStore"
        ucm_connector_config:
          store_pipeline: "Posix"
          storage_backends: "/mnt/a:/mnt/b"
          io_direct: false
    enable_event_sync: true
    use_layerwise: true
    """


def test_yaml_file(tmp_path):
    path = write_yaml(tmp_path, YAML)
    cfg = parse(UCM_CONFIG_FILE=str(path))
    spec = resolve_store_spec(cfg)
    assert spec.connector_name == "UcmPipelineStore"
    assert spec.connector_config["store_pipeline"] == "Posix"
    assert spec.connector_config["storage_backends"] == "/mnt/a:/mnt/b"
    assert spec.connector_config["io_direct"] is False
    assert spec.connector_config["posix_gc_enable"] is False  # our default
    assert spec.source == str(path)
    assert spec.top_level == {"enable_event_sync": True, "use_layerwise": True}
    # UCM's own connector-only keys in the file do not change this connector's behaviour
    assert cfg.load_mode == "sync"
    assert spec.as_entry() == {"ucm_connector_name": "UcmPipelineStore", "ucm_connector_config": spec.connector_config}


def test_inline_connector_config_only():
    cfg = parse(ucm_connector_config={"store_pipeline": "Posix", "storage_backends": ["/x"]})
    spec = resolve_store_spec(cfg)
    assert spec.connector_name == "UcmPipelineStore"
    assert spec.connector_config == {"store_pipeline": "Posix", "storage_backends": ["/x"], "posix_gc_enable": False}


def test_inline_connector_list_and_name_override():
    entries = [{"ucm_connector_name": "UcmPipelineStore",
                "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": "/y"}}]
    spec = resolve_store_spec(parse(ucm_connectors=entries))
    assert spec.connector_config["storage_backends"] == "/y"
    spec = resolve_store_spec(parse(ucm_connectors=entries, ucm_connector_name="MyStore"))
    assert spec.connector_name == "MyStore"


def test_inline_keys_override_the_file(tmp_path):
    path = write_yaml(tmp_path, YAML)
    spec = resolve_store_spec(
        parse(UCM_CONFIG_FILE=str(path), ucm_connector_config={"storage_backends": "/other", "posix_gc_enable": True})
    )
    assert spec.connector_config["storage_backends"] == "/other"
    assert spec.connector_config["posix_gc_enable"] is True  # the user's choice wins
    assert spec.connector_config["io_direct"] is False  # the rest comes from the file
    assert "inline" in spec.source


def test_first_of_several_connectors_is_used(tmp_path, caplog):
    path = write_yaml(
        tmp_path,
        """\
        ucm_connectors:
          - ucm_connector_name: "UcmPipelineStore"
            ucm_connector_config: {store_pipeline: "Posix", storage_backends: "/first"}
          - ucm_connector_name: "UcmNfsStore"
            ucm_connector_config: {storage_backends: "/second"}
        """,
    )
    spec = resolve_store_spec(parse(UCM_CONFIG_FILE=str(path)))
    assert spec.connector_config["storage_backends"] == "/first"
    assert "using the first" in caplog.text


def test_no_store_configured_is_a_clear_error():
    with pytest.raises(ConnectorConfigError) as info:
        parse()
    text = str(info.value)
    assert "UCMConnector" in text and "UCM_CONFIG_FILE" in text and "ucm_connector_config" in text
    with pytest.raises(ConnectorConfigError, match="no UCM store configured"):
        parse(lookup_mode="async")


def test_generic_keys_and_use_layerwise():
    store = {"ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": "/z"}}
    cfg = parse(**store, lookup_mode="async", checksum=False, load_failure_policy="vllm", staging_bytes=1 << 20)
    assert (cfg.lookup_mode, cfg.checksum, cfg.load_failure_policy, cfg.staging_bytes) == ("async", False, "vllm", 1 << 20)
    # no layer-wise mode: UCM's use_layerwise is accepted without effect, load_mode "layerwise" refused
    assert parse(**store, use_layerwise=True).load_mode == "sync"
    assert parse(**store, use_layerwise=True, load_mode="async").load_mode == "async"
    with pytest.raises(ConnectorConfigError, match=r"key 'load_mode'.*'layerwise' was removed.*async"):
        parse(**store, load_mode="layerwise")
    assert parse(**store, enable_event_sync=True).load_mode == "sync"


def test_unknown_and_mistyped_keys():
    store = {"ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": "/z"}}
    with pytest.raises(ConnectorConfigError, match="storage_backend"):
        parse(**store, storage_backend="/typo")  # belongs inside ucm_connector_config
    with pytest.raises(ConnectorConfigError, match="ucm_connectors"):
        parse(ucm_connectors="not a list")


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"UCM_CONFIG_FILE": "/no/such/ucm.yaml"}, "does not exist"),
        ({"ucm_connector_config": {"storage_backends": "/z"}}, "store_pipeline"),
        ({"ucm_connector_config": {"store_pipeline": "Posix"}}, "storage_backends"),
        ({"ucm_connectors": []}, "non-empty list"),
        ({"ucm_connectors": [{"ucm_connector_name": 3}]}, "ucm_connector_name"),
        ({"ucm_connectors": [{"ucm_connector_config": [1]}]}, "must be a mapping"),
    ],
)
def test_resolution_errors(extra, match):
    with pytest.raises(UCMConfigError, match=match):
        resolve_store_spec(parse(**extra))


def test_file_and_inline_list_together_is_ambiguous(tmp_path):
    path = write_yaml(tmp_path, YAML)
    with pytest.raises(UCMConfigError, match="not both"):
        resolve_store_spec(parse(UCM_CONFIG_FILE=str(path), ucm_connectors=[{"ucm_connector_config": {}}]))


def test_malformed_yaml_file(tmp_path):
    path = write_yaml(tmp_path, "other: 1\n")
    with pytest.raises(UCMConfigError, match="ucm_connectors"):
        resolve_store_spec(parse(UCM_CONFIG_FILE=str(path)))


# -- key ids ------------------------------------------------------------------------------------


def test_key_ids():
    a = ucm_key_id("kv/ns1/hg0of1.pcp0of1.dcp0of1/ab")
    assert isinstance(a, bytes) and len(a) == UCM_BLOCK_ID_SIZE
    assert a == ucm_key_id("kv/ns1/hg0of1.pcp0of1.dcp0of1/ab")
    assert a != ucm_key_id("kv/ns2/hg0of1.pcp0of1.dcp0of1/ab")  # other model / layout
    assert a != ucm_key_id("kv/ns1/hg1of2.pcp0of1.dcp0of1/ab")  # other rank's heads
    assert a != ucm_key_id("kv/ns1/mla/ab")
    assert ucm_key_id("kv/x/mla/00") != ucm_block_id(b"\x00", model="x", tp_size=1, dtype="f", rank=0, use_mla=True)
    with pytest.raises(ValueError):
        ucm_key_id("")


def test_disk_cap_is_on_by_default_and_can_be_set_or_turned_off():
    base = {"ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": "/x"}}
    assert parse(**base).disk_capacity_bytes is None  # None: the default cap (16 GiB / half free)
    assert parse(**base, disk_capacity_bytes=0).disk_capacity_bytes == 0  # off
    assert parse(**base, disk_capacity_bytes=1 << 30).disk_capacity_bytes == 1 << 30
    with pytest.raises((ConnectorConfigError, ValueError), match="disk_capacity_bytes"):
        parse(**base, disk_capacity_bytes=-1)
