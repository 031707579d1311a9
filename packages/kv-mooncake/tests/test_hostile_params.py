"""Hostile ``kv_transfer_params`` at the decode scheduler: whatever a client of the OpenAI API sends,
the engine's hooks never raise, do bounded work, and every request ends as a valid pull or as a local
computation (issue 23, part 1).

Driven through the scheduler's public hooks in vLLM's order: ``get_num_new_matched_tokens`` (asked
twice, as vLLM does while no blocks are free), ``update_state_after_alloc``, ``build_connector_meta``
(``build_step``), ``request_finished``.
"""

from __future__ import annotations

import logging
import math
import time
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_mooncake.config import MooncakeConfig
from kv_mooncake.identity import prompt_digest
from kv_mooncake.params import RemoteSource
from kv_mooncake.scheduler import MooncakeScheduler
from kv_mooncake.step import MooncakeStep

# What this test calls sane, independently of the module's constants (checked against them below).
MAX_RANKS = 256  # tp * pcp of one prefill instance: one FreeNow / keep-alive per rank
MAX_ID_CHARS = 4096
MAX_BLOCK_ID = 2**31 - 1

KNOWN = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids", "remote_request_id",
         "remote_tp_size", "remote_pcp_size", "remote_dcp_size", "prompt_digest", "hold_timeout_s")


def _blocks_needed(prompt_len: int, block_size: int) -> int:
    return -(-prompt_len // block_size)


def _scheduler(block_size: int = 16, *, producer: bool = False) -> MooncakeScheduler:
    return MooncakeScheduler(MooncakeConfig(side_channel_host="10.0.0.9"), engine_id="D", block_size=block_size,
                             is_producer=producer, is_consumer=True, side_channel_port=18000)


def _request(params, prompt, request_id="d-r"):
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, prompt_token_ids=list(prompt),
                           status=SimpleNamespace(name="FINISHED_STOPPED"), num_computed_tokens=0)


def _valid(prompt, **over):
    return {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 17000,
            "remote_block_ids": list(range(_blocks_needed(len(prompt), 16))), "remote_request_id": "p-r",
            "remote_tp_size": 1, "prompt_digest": prompt_digest(prompt), **over}


def assert_bounded(source: RemoteSource, prompt_len: int, block_size: int) -> None:
    """A prefill named to the workers is one they can talk to with bounded work."""
    ranks = source.tp_size * source.pcp_size
    assert min(source.tp_size, source.pcp_size, source.dcp_size) >= 1 and source.dcp_size <= source.tp_size
    assert ranks <= MAX_RANKS, f"{ranks} prefill ranks"
    assert source.port >= 1 and source.port + ranks - 1 <= 65535, (source.port, ranks)
    assert 0 < len(source.host) <= 255 and 0 < len(source.engine_id) <= MAX_ID_CHARS
    assert 0 < len(source.request_id) <= MAX_ID_CHARS
    for ids in source.block_ids_by_group:
        assert len(ids) <= _blocks_needed(prompt_len, block_size) + 1, (len(ids), prompt_len)
        assert all(isinstance(b, int) and 0 <= b <= MAX_BLOCK_ID for b in ids)


def assert_bounded_step(step: MooncakeStep, prompt_len: int, block_size: int) -> None:
    for source in [p.source for p in step.pulls] + step.frees + step.keepalives:
        assert_bounded(source, prompt_len, block_size)


def drive(sched: MooncakeScheduler, params, prompt, block_size: int):
    """vLLM's calls for one decode request; returns (matched, is_async, steps, finished)."""
    request = _request(params, prompt)
    matched, is_async = sched.get_num_new_matched_tokens(request, 0)
    assert sched.get_num_new_matched_tokens(request, 0) == (matched, is_async)  # asked again: same answer
    steps = [sched.build_step()]
    n_blocks = _blocks_needed(len(prompt), block_size) if is_async else 0
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(100, 100 + n_blocks)),))
    sched.update_state_after_alloc(request, blocks, matched if is_async else 0)
    steps.append(sched.build_step())
    finished = sched.request_finished(request, [list(range(100, 100 + n_blocks))])
    steps.append(sched.build_step())
    return request, matched, is_async, steps, finished


# ---------------------------------------------------------------------------------------- Hypothesis
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
HOSTILE = JSON | st.sampled_from(["abc", "", "1e9", "-1", "4000000", "65536", "nan", "inf", "0x10"]) \
    | st.sampled_from([0, -1, 4_000_000, 2**31, 2**63, 65536, 1e300, float("nan")]) \
    | st.lists(st.integers(-5, 2**40), max_size=60) | st.text(min_size=300, max_size=5000)


def _plausible(prompt):
    return {
        "remote_engine_id": st.text(min_size=1, max_size=8),
        "remote_host": st.sampled_from(["127.0.0.1", "10.0.0.1", "prefill-0", "::1"]),
        "remote_port": st.integers(1, 65535),
        "remote_block_ids": st.lists(st.integers(0, 5000), min_size=0, max_size=40),
        "remote_request_id": st.text(min_size=1, max_size=8),
        "remote_tp_size": st.integers(1, 8),
        "remote_pcp_size": st.integers(1, 4),
        "remote_dcp_size": st.integers(1, 4),
        "prompt_digest": st.just(prompt_digest(prompt)) | st.text(max_size=40),
        "hold_timeout_s": st.floats(),
    }


@st.composite
def hostile_params(draw):
    prompt = draw(st.lists(st.integers(0, 50_000), min_size=0, max_size=300))
    plausible = _plausible(prompt)
    base = draw(st.fixed_dictionaries({}, optional={k: plausible[k] | HOSTILE for k in KNOWN}))
    unknown = draw(st.dictionaries(st.text(max_size=10).filter(lambda k: k not in KNOWN), JSON, max_size=3))
    flag = draw(st.just(True) | HOSTILE)
    decode_flag = draw(st.just(False) | HOSTILE)
    return prompt, {**unknown, **base, "do_remote_prefill": flag, "do_remote_decode": decode_flag}


@settings(max_examples=250, deadline=None)
@given(case=hostile_params(), block_size=st.sampled_from([16, 128]), producer=st.booleans())
def test_any_params_end_as_a_bounded_pull_or_a_local_computation(case, block_size, producer):
    prompt, params = case
    sched = _scheduler(block_size, producer=producer)
    request, matched, is_async, steps, finished = drive(sched, params, prompt, block_size)
    for step in steps:
        assert_bounded_step(step, len(prompt), block_size)
    pulls = [p for step in steps for p in step.pulls]
    if is_async:  # accepted for a remote load: exactly one pull of the whole prompt follows
        assert matched == len(prompt) > 0
        assert [p.request_id for p in pulls] == ["d-r"]
        assert [blocks.end for blocks in pulls[0].blocks_by_group] == [_blocks_needed(len(prompt), block_size)]
    else:  # computed locally: nothing pulled, never asked about again
        assert matched == 0 and pulls == []
        assert not request.kv_transfer_params.get("do_remote_prefill")
    for step in steps:
        for hold in step.holds:  # kv_both: a client may shorten the hold, never extend it
            assert hold.ttl_s is None or 0 < hold.ttl_s <= sched.config.hold_timeout_s
    if not producer:  # nothing left behind (a kv_both instance may hold the request for a decode)
        assert finished == (False, None)
        assert sched.build_step().is_empty() and not sched.has_pending_block_frees()


def test_the_test_bounds_are_the_modules():
    from kv_mooncake import params as tp

    assert (tp.MAX_PREFILL_RANKS, tp.MAX_ID_CHARS, tp.MAX_BLOCK_ID) == (MAX_RANKS, MAX_ID_CHARS, MAX_BLOCK_ID)


# ---------------------------------------------------------------------------------------- shapes, one by one
PROMPT = list(range(1000, 1040))  # 40 tokens: 3 blocks of 16


def _decide(params, prompt=PROMPT, block_size=16):
    sched = _scheduler(block_size)
    request, matched, is_async, steps, _ = drive(sched, params, prompt, block_size)
    return (matched, is_async), [p for s in steps for p in s.pulls], [f for s in steps for f in s.frees]


def test_a_valid_pull_is_still_pulled():
    decision, pulls, frees = _decide(_valid(PROMPT))
    assert decision == (40, True) and len(pulls) == 1 and frees == []
    assert pulls[0].source.block_ids_by_group == [[0, 1, 2]]


def test_one_bad_value_still_lets_the_prefill_free():
    """A non-string digest used to leave only the flags: nothing pulled, and the prefill never told
    to free (its blocks stayed held until hold_timeout_s). The valid address is kept for FreeNow."""
    decision, pulls, frees = _decide(_valid(PROMPT, prompt_digest=5))
    assert decision == (0, False) and pulls == []
    assert [(f.host, f.port, f.request_id) for f in frees] == [("127.0.0.1", 17000, "p-r")]


def test_missing_fields_with_the_right_digest_are_computed_locally():
    """A request accepted for a remote load with no prefill to pull from waited forever."""
    for key in ("remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_block_ids"):
        params = {k: v for k, v in _valid(PROMPT).items() if k != key}
        decision, pulls, _ = _decide(params)
        assert decision == (0, False) and pulls == [], key


def test_absurd_sizes_are_refused_without_naming_millions_of_ranks():
    for over in ({"remote_tp_size": 4_000_000}, {"remote_pcp_size": 100_000}, {"remote_dcp_size": 9},
                 {"remote_tp_size": 0}, {"remote_tp_size": 64, "remote_pcp_size": 64},
                 {"remote_port": 65535, "remote_tp_size": 2}, {"remote_port": 0}, {"remote_port": 70000}):
        for digest in (prompt_digest(PROMPT), "t1:wrong"):
            t0 = time.perf_counter()
            decision, pulls, frees = _decide(_valid(PROMPT, prompt_digest=digest, **over))
            assert time.perf_counter() - t0 < 1.0, over
            assert decision == (0, False) and pulls == [], over
            for free in frees:
                assert_bounded(free, len(PROMPT), 16)


def test_a_block_list_longer_than_the_prompt_needs_is_refused():
    decision, pulls, frees = _decide(_valid(PROMPT, remote_block_ids=list(range(1000))))
    assert decision == (0, False) and pulls == []
    assert len(frees) == 1 and frees[0].request_id == "p-r"  # the address is fine: the prefill frees
    assert _decide(_valid(PROMPT, remote_block_ids=[0, 1, 2, 3]))[0] == (40, True)  # one spare block is fine


def test_bad_block_ids_are_refused():
    for ids in ([0, -1, 2], [0, 2**31, 2], [0, 1.5, 2], ["a", 1, 2], [[0], 1, 2], [], [None, 1, 2]):
        decision, pulls, _ = _decide(_valid(PROMPT, remote_block_ids=ids))
        assert decision == (0, False) and pulls == [], ids


def test_huge_strings_are_refused_fast_and_not_logged(caplog):
    huge = "x" * 10_000_000
    for key in ("remote_engine_id", "remote_host", "remote_request_id", "prompt_digest"):
        caplog.clear()
        t0 = time.perf_counter()
        with caplog.at_level(logging.DEBUG, logger="vllm.kv_connectors"):
            decision, pulls, _ = _decide(_valid(PROMPT, **{key: huge}))
        assert time.perf_counter() - t0 < 1.0, key
        assert decision == (0, False) and pulls == [], key
        assert all(len(r.getMessage()) < 2000 for r in caplog.records), key  # no 10 MB log lines
        assert any(key in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING), key


def test_a_refusal_names_the_key_and_the_value(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kv_connectors"):
        _decide(_valid(PROMPT, remote_tp_size="abc"))
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "remote_tp_size" in text and "'abc'" in text


def test_unknown_keys_are_ignored():
    params = _valid(PROMPT, remote_prefill_cached_tokens=16, x={"deep": [1, 2, {"deeper": None}]}, y="z" * 100_000)
    assert _decide(params)[0] == (40, True)


def test_nulls_count_as_absent():
    """vLLM's own connectors and kv-mooncake-proxy send null for the keys they do not set."""
    prefill = _scheduler(16, producer=True)
    asked = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
             "remote_block_ids": None, "remote_host": None, "remote_port": None, "hold_timeout_s": 5}
    held, _ = prefill.request_finished(_request(asked, PROMPT, "p-r"), [[3, 4, 5]])
    assert held and prefill.build_step().holds[0].ttl_s == 5.0
    assert _decide(_valid(PROMPT, remote_pcp_size=None, remote_dcp_size=None))[0] == (40, True)


def test_non_mapping_and_empty_params_are_no_params():
    for params in ({}, None):
        assert _decide(params)[0] == (0, False)


def test_a_long_prompt_takes_a_long_block_list():
    """The bound on remote_block_ids is the prompt's, not a fixed small one."""
    prompt = list(range(5000))
    params = _valid(prompt, remote_block_ids=list(range(math.ceil(5000 / 16))))
    assert _decide(params, prompt)[0] == (5000, True)
