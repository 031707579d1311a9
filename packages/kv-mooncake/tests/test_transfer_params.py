"""``kv_transfer_params``: one typed model, built by the prefill, parsed once by the decode and the proxy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kv_mooncake.config import MooncakeConfig
from kv_mooncake.params import RemoteSource, TransferParams, parse_transfer_params, read_transfer_params
from kv_mooncake.proxy.release import side_channel_addresses
from kv_mooncake.scheduler import MooncakeScheduler

# What a prefill answers today, key by key (vllm-ascend's names: clients and proxies read them).
WIRE = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "P", "remote_host": "10.0.0.1",
        "remote_port": 17000, "remote_block_ids": [3, 4], "remote_request_id": "p-r", "remote_tp_size": 2,
        "prompt_digest": "t1:00"}


def test_round_trip_keeps_the_wire_keys():
    params = parse_transfer_params(WIRE)
    assert params == TransferParams(do_remote_prefill=True, engine_id="P", host="10.0.0.1", port=17000,
                                    block_ids=[3, 4], request_id="p-r", tp_size=2, prompt_digest="t1:00")
    assert params.to_dict() == WIRE
    assert parse_transfer_params(params.to_dict()) == params


def test_missing_keys_take_defaults():
    assert parse_transfer_params(None) is None
    assert parse_transfer_params({}) is None
    asked = parse_transfer_params({"do_remote_decode": True})
    assert asked == TransferParams(do_remote_decode=True)
    assert asked.source() is None and asked.prefill_addresses() is None
    assert asked.to_dict() == {"do_remote_decode": True}
    params = parse_transfer_params({k: v for k, v in WIRE.items() if k not in ("remote_tp_size", "prompt_digest")})
    assert (params.tp_size, params.pcp_size, params.dcp_size, params.prompt_digest) == (1, 1, 1, None)


def test_keys_of_vllm_and_of_other_connectors_are_ignored():
    params = parse_transfer_params({**WIRE, "remote_prefill_cached_tokens": 16, "remote_num_tokens": 40, "x": {}})
    assert params == parse_transfer_params(WIRE)
    assert "remote_num_tokens" not in params.to_dict()  # no reader: dropped


def test_values_convert_leniently():
    params = parse_transfer_params({**WIRE, "remote_port": "17000", "remote_tp_size": "2", "hold_timeout_s": "5"})
    assert (params.port, params.tp_size, params.hold_timeout_s) == (17000, 2, 5.0)


@pytest.mark.parametrize("bad", [{"remote_port": "not a port"}, {"remote_host": 5}, {"remote_tp_size": "x"},
                                 {"remote_pcp_size": 0}, {"remote_engine_id": ""}])
def test_a_wrong_address_or_size_keeps_no_address(bad):
    (key,) = bad
    read = read_transfer_params({**WIRE, **bad})
    assert read.problem.startswith(f"{key}=")
    assert read.params.source() is None and read.params.prefill_addresses() is None  # nobody to free
    assert read.params.do_remote_prefill and read.params.prompt_digest == WIRE["prompt_digest"]


@pytest.mark.parametrize("bad", [{"remote_block_ids": "x"}, {"hold_timeout_s": "x"}, {"prompt_digest": 5}])
def test_another_wrong_value_keeps_the_address(bad):
    """The decode pulls nothing but can still tell the prefill to free (it used to keep only the
    flags, and the prefill's hold waited for hold_timeout_s)."""
    (key,) = bad
    read = read_transfer_params({**WIRE, **bad})
    assert read.problem.startswith(f"{key}=") and f"`$.{key}`" in read.problem
    assert read.params == parse_transfer_params({k: v for k, v in WIRE.items() if k != key})
    assert read.params.prefill_addresses() == ["10.0.0.1:17000", "10.0.0.1:17001"]


def test_keys_valid_alone_but_not_together_keep_no_address():
    read = read_transfer_params({**WIRE, "remote_port": 65535})  # two TP ranks: 65535 and 65536
    assert "remote_port 65535 + 2 prefill ranks" in read.problem
    assert read.params.source() is None and read.params.tp_size == 2
    read = read_transfer_params({**WIRE, "remote_tp_size": 64, "remote_pcp_size": 8})
    assert read.problem == "remote_tp_size 64 x remote_pcp_size 8 x remote_pp_size 1 = 512 prefill ranks, at most 256"
    assert read.params == TransferParams(do_remote_prefill=True)  # then only the flags count


def test_valid_params_have_no_problem():
    assert read_transfer_params(WIRE) == (parse_transfer_params(WIRE), None)


def test_flags_count_by_truthiness():
    assert parse_transfer_params({"do_remote_prefill": 1}).do_remote_prefill is True
    assert parse_transfer_params({"do_remote_prefill": "yes", "remote_port": []}).do_remote_prefill is True
    assert parse_transfer_params({"do_remote_prefill": 0, "do_remote_decode": None, "remote_host": "h"}) == \
        TransferParams(host="h")


def test_not_a_mapping_is_no_params():
    assert parse_transfer_params(["do_remote_prefill"]) is None


def test_source_needs_the_whole_prefill():
    assert parse_transfer_params(WIRE).source() == RemoteSource(engine_id="P", host="10.0.0.1", port=17000,
                                                                request_id="p-r", block_ids_by_group=[[3, 4]],
                                                                tp_size=2)
    for key in ("remote_engine_id", "remote_host", "remote_port", "remote_request_id"):
        assert parse_transfer_params({k: v for k, v in WIRE.items() if k != key}).source() is None, key


def test_prefill_addresses_cover_every_tp_and_pcp_rank():
    params = parse_transfer_params({**WIRE, "remote_pcp_size": 2, "remote_dcp_size": 2})
    assert params.prefill_addresses() == [f"10.0.0.1:{17000 + i}" for i in range(4)]
    assert side_channel_addresses({**WIRE, "remote_port": 0}) is None
    assert side_channel_addresses({**WIRE, "remote_tp_size": "x"}) is None  # was a ValueError in the proxy


def _request(request_id, params, prompt=range(40), status="FINISHED_STOPPED"):
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, prompt_token_ids=list(prompt),
                           status=SimpleNamespace(name=status), num_computed_tokens=len(prompt))


def test_the_prefill_answer_is_what_the_decode_parses():
    prefill = MooncakeScheduler(MooncakeConfig(side_channel_host="10.0.0.1"), engine_id="P", block_size=16,
                                is_producer=True, is_consumer=False, side_channel_port=17000, tp_size=2)
    held, out = prefill.request_finished(_request("p-r", {"do_remote_decode": True, "hold_timeout_s": 5}), [[3, 4, 5]])
    assert held
    assert set(out) == {"do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_host", "remote_port",
                        "remote_block_ids", "remote_request_id", "remote_tp_size", "prompt_digest"}
    assert prefill.build_step().holds[0].ttl_s == 5.0
    decode = MooncakeScheduler(MooncakeConfig(), engine_id="D", block_size=16, is_producer=False, is_consumer=True,
                               side_channel_port=1)
    request = _request("d-r", dict(out))
    assert decode.get_num_new_matched_tokens(request, 0) == (40, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],))
    decode.update_state_after_alloc(request, blocks, 40)
    pull = decode.build_step().pulls[0]
    assert pull.source == parse_transfer_params(out).source() and pull.blocks_by_group == [(0, 3)]
    assert not pull.check_null_blocks  # one full-attention group: vLLM's null block is never in its list
    assert request.kv_transfer_params["do_remote_prefill"] is False  # decided: never pulled twice
    assert decode.request_finished(request, [[7, 8, 9]]) == (False, None)
    assert decode._incoming == {} and decode._waiting == {}


def test_a_local_prefix_hit_is_not_pulled():
    """One KV-cache group: the pull's one range starts after the blocks computed locally."""
    decode = MooncakeScheduler(MooncakeConfig(), engine_id="D", block_size=16, is_producer=False, is_consumer=True,
                               side_channel_port=1)
    prefill = MooncakeScheduler(MooncakeConfig(side_channel_host="10.0.0.1"), engine_id="P", block_size=16,
                                is_producer=True, is_consumer=False, side_channel_port=17000)
    _, out = prefill.request_finished(_request("p-r", {"do_remote_decode": True}), [[3, 4, 5]])
    request = _request("d-r", dict(out))
    assert decode.get_num_new_matched_tokens(request, 16) == (24, True)
    decode.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],)), 24)
    pull = decode.build_step().pulls[0]
    assert pull.blocks_by_group == [(1, 3)] and pull.source.block_ids_by_group == [[3, 4, 5]]


def test_the_decode_parses_once_per_request(monkeypatch):
    import kv_mooncake.scheduler as scheduler_module

    calls = []
    monkeypatch.setattr(scheduler_module, "read_transfer_params",
                        lambda raw: calls.append(raw) or read_transfer_params(raw))
    decode = MooncakeScheduler(MooncakeConfig(), engine_id="D", block_size=16, is_producer=False, is_consumer=True,
                               side_channel_port=1)
    from kv_mooncake.identity import prompt_digest

    request = _request("d-r", {**WIRE, "prompt_digest": prompt_digest(range(40))})
    for _ in range(3):  # vLLM asks again while no blocks are free
        assert decode.get_num_new_matched_tokens(request, 0) == (40, True)
    decode.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],)), 40)
    decode.request_finished(request, [[7, 8, 9]])
    assert len(calls) == 1
