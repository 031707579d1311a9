"""vllm-ascend's documented MooncakeConnectorV1 extra configs load; declared sizes are cross-checked."""

from __future__ import annotations

import logging

import pytest
from kv_common.config import ConnectorConfigError
from kv_mooncake.config import (
    MooncakeConfig,
    ParallelSizes,
    parse_config,
    peer_layout_contradiction,
    start_up_contradictions,
)

# docs/source/tutorials/features/pd_disaggregation_mooncake_single_node.md (vllm-ascend)
DOCUMENTED = {
    "use_ascend_direct": True,
    "prefill": {"dp_size": 1, "tp_size": 1},
    "decode": {"dp_size": 1, "tp_size": 1},
}
# docs/source/user_guide/feature_guide/pipeline_parallel.md (vllm-ascend)
DOCUMENTED_PP = {
    "prefill": {"dp_size": 1, "tp_size": 8, "pp_size": 2, "pp_layer_partition": "32,29"},
    "decode": {"dp_size": 1, "tp_size": 1, "pp_size": 1},
}


def test_documented_p2p_configs_load():
    cfg = parse_config(DOCUMENTED)
    assert cfg.prefill.tp_size == 1 and cfg.decode.dp_size == 1 and cfg.use_ascend_direct is True
    cfg = parse_config(DOCUMENTED_PP)
    assert cfg.prefill.pp_size == 2 and cfg.prefill.pp_layer_partition == "32,29"


def test_strings_coerced():
    cfg = parse_config({"prefill": {"dp_size": "2", "tp_size": "4"}, "use_ascend_direct": "true",
                        "side_channel_port": "30000"})
    assert (cfg.prefill.dp_size, cfg.prefill.tp_size, cfg.use_ascend_direct, cfg.side_channel_port) == (2, 4, True, 30000)


def test_garbage_and_unknown_keys_name_the_key():
    with pytest.raises(ConnectorConfigError, match=r"MooncakeConnectorV1: .*key 'prefill.tp_size'.*'eight'"):
        parse_config({"prefill": {"tp_size": "eight"}})
    with pytest.raises(ConnectorConfigError, match=r"key 'prefil': unknown key"):
        parse_config({"prefil": {"tp_size": 1}})
    with pytest.raises(ConnectorConfigError, match=r"key 'decode.tp': unknown key"):
        parse_config({"decode": {"tp": 1}})


@pytest.mark.parametrize("wait_ms", [-1, 101])
def test_idle_step_wait_out_of_bounds_is_refused_naming_it(wait_ms):
    with pytest.raises((ConnectorConfigError, ValueError), match="idle_step_wait_ms must be from 0 to 100"):
        parse_config({"idle_step_wait_ms": wait_ms})
    assert parse_config({"idle_step_wait_ms": 0}).idle_step_wait_ms == 0  # 0: the wait is off


def test_no_effect_keys_warn_once(caplog):
    caplog.set_level(logging.WARNING)
    parse_config(DOCUMENTED)
    parse_config(DOCUMENTED)
    hits = [r.getMessage() for r in caplog.records if "'use_ascend_direct'" in r.getMessage()]
    assert len(hits) <= 1  # once per process (another test may have warned first)
    assert "use_ascend_direct" in MooncakeConfig.no_effect_keys


def test_producer_refuses_a_declared_prefill_size_that_is_not_its_own():
    cfg = parse_config({"prefill": {"dp_size": 1, "tp_size": 2}, "decode": {"dp_size": 1, "tp_size": 1}})
    problems = start_up_contradictions(cfg, is_producer=True, is_consumer=False, tp_size=1, pp_size=1)
    assert problems == ["prefill.tp_size is 2 but this prefill instance runs tensor_parallel_size 1"]
    assert start_up_contradictions(cfg, is_producer=False, is_consumer=True, tp_size=1, pp_size=1) == []
    pp = parse_config({"decode": {"tp_size": 1, "pp_size": "2"}})
    assert start_up_contradictions(pp, is_producer=False, is_consumer=True, tp_size=1, pp_size=1) == [
        "decode.pp_size is 2 but this decode instance runs pipeline_parallel_size 1"]
    # vllm-ascend's documented PP prefill (pipeline_parallel.md): its PP 1 decode starts, and so does
    # its prefill when it places its layers as declared; another partition is refused naming both.
    assert start_up_contradictions(parse_config(DOCUMENTED_PP), is_producer=False, is_consumer=True,
                                   tp_size=1, pp_size=1) == []
    assert start_up_contradictions(parse_config(DOCUMENTED_PP), is_producer=True, is_consumer=False,
                                   tp_size=8, pp_size=2, layer_partition=(32, 29)) == []
    assert start_up_contradictions(parse_config(DOCUMENTED_PP), is_producer=True, is_consumer=False,
                                   tp_size=8, pp_size=2, layer_partition=(31, 30)) == [
        "prefill.pp_layer_partition is '32,29' but this prefill instance places its layers 31,30 "
        "(VLLM_PP_LAYER_PARTITION, else vLLM's even split)"]
    assert start_up_contradictions(parse_config({}), is_producer=True, is_consumer=True, tp_size=4, pp_size=2) == []


def test_decode_refuses_a_peer_whose_layout_contradicts_the_declared_one():
    cfg = parse_config({"prefill": {"dp_size": 1, "tp_size": 2}})
    assert peer_layout_contradiction(cfg, remote_tp_size=2) is None
    assert peer_layout_contradiction(cfg, remote_tp_size=1) == (
        "prefill.tp_size is 2 but the prefill instance reports tensor_parallel_size 1")
    assert peer_layout_contradiction(parse_config({}), remote_tp_size=1) is None
    pp = parse_config(DOCUMENTED_PP)
    assert peer_layout_contradiction(pp, remote_tp_size=8, remote_pp_size=2) is None
    assert peer_layout_contradiction(pp, remote_tp_size=8, remote_pp_size=1) == (
        "prefill.pp_size is 2 but the prefill instance reports pipeline_parallel_size 1")


def test_a_declared_layer_partition_must_parse_and_match_the_declared_stages():
    with pytest.raises(ValueError, match="prefill.pp_layer_partition.*comma-separated"):
        parse_config({"prefill": {"pp_size": 2, "pp_layer_partition": "32;29"}})
    with pytest.raises(ValueError, match="prefill.pp_layer_partition.*has 3 stages, pp_size is 2"):
        parse_config({"prefill": {"pp_size": 2, "pp_layer_partition": "20,20,21"}})
    with pytest.raises(ValueError, match="at least one layer"):
        parse_config({"prefill": {"pp_layer_partition": "0,4"}})
    assert "pp_layer_partition" not in ParallelSizes.no_effect_keys


def _decode_request(remote_tp_size: int):
    from types import SimpleNamespace

    from kv_mooncake.identity import PARAM_KEY, prompt_digest

    prompt = list(range(40))
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 1,
              "remote_request_id": "p-r", "remote_block_ids": [0, 1, 2], "remote_tp_size": remote_tp_size,
              PARAM_KEY: prompt_digest(prompt)}
    return SimpleNamespace(request_id="r", kv_transfer_params=params, prompt_token_ids=prompt)


def test_decode_scheduler_computes_locally_when_the_prefill_contradicts_the_declared_tp(caplog):
    from kv_mooncake.scheduler import MooncakeScheduler

    cfg = parse_config({"prefill": {"dp_size": 1, "tp_size": "2"}, "decode": {"dp_size": 1, "tp_size": 1}})
    sched = MooncakeScheduler(cfg, engine_id="D", block_size=16, is_producer=False, is_consumer=True,
                              side_channel_port=1)
    caplog.set_level(logging.WARNING)
    assert sched.get_num_new_matched_tokens(_decode_request(remote_tp_size=1), 0) == (0, False)
    assert any("prefill.tp_size is 2 but the prefill instance reports tensor_parallel_size 1" in r.getMessage()
               for r in caplog.records)
    step = sched.build_step()
    assert [s.request_id for s in step.frees] == ["p-r"] and not step.pulls  # the prefill may free at once
    # The declared size is right: the pull goes ahead.
    assert sched.get_num_new_matched_tokens(_decode_request(remote_tp_size=2), 0) == (40, True)
