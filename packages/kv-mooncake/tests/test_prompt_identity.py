"""The decode pulls a prefill's KV only for the very prompt the prefill computed (issue 12, item 4).

A proxy or chat-template difference can hand the decode ``kv_transfer_params`` of another prompt
with the same number of blocks; pulling them loads the wrong KV silently. The prefill puts a digest
of the prompt's token ids in ``kv_transfer_params``; the decode compares it before pulling.
"""

from __future__ import annotations

from types import SimpleNamespace

from kv_mooncake.config import MooncakeConfig
from kv_mooncake.scheduler import MooncakeScheduler

BLOCK = 16


def _scheduler(producer: bool) -> MooncakeScheduler:
    return MooncakeScheduler(MooncakeConfig(), engine_id="P" if producer else "D", block_size=BLOCK,
                             is_producer=producer, is_consumer=not producer, side_channel_port=20000)


def _request(request_id: str, prompt: list[int], params: dict) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, prompt_token_ids=prompt, kv_transfer_params=params,
                           status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
                           num_computed_tokens=len(prompt))


class FakeBlocks:
    def __init__(self, ids: list[int]):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def _prefill_params(prompt: list[int]) -> dict:
    sched = _scheduler(producer=True)
    delay, params = sched.request_finished(_request("p-req", prompt, {"do_remote_decode": True}), [[7, 8, 9]])
    assert delay and params is not None
    return params


def _decode(prompt: list[int], params: dict) -> tuple[MooncakeScheduler, tuple[int, bool], object]:
    sched = _scheduler(producer=False)
    req = _request("d-req", prompt, dict(params))
    matched = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3]), matched[0])
    return sched, matched, sched.build_step()


PROMPT_A = list(range(100, 140))
PROMPT_B = list(range(200, 240))  # same length, same number of blocks, other tokens


def test_prefill_puts_a_prompt_digest_in_kv_transfer_params():
    params = _prefill_params(PROMPT_A)
    assert params.get("prompt_digest")
    assert params["prompt_digest"] != _prefill_params(PROMPT_B)["prompt_digest"]
    assert params["prompt_digest"] == _prefill_params(list(PROMPT_A))["prompt_digest"]


def test_same_prompt_is_pulled():
    sched, matched, step = _decode(PROMPT_A, _prefill_params(PROMPT_A))
    assert matched == (len(PROMPT_A), True)
    assert len(step.pulls) == 1 and not step.frees


def test_other_prompt_of_equal_length_pulls_nothing_and_frees_the_prefill():
    sched, matched, step = _decode(PROMPT_B, _prefill_params(PROMPT_A))
    assert matched == (0, False)  # a cache miss: vLLM computes the prompt itself
    assert not step.pulls
    assert [s.request_id for s in step.frees] == ["p-req"]  # the prefill need not hold it any longer
    stats = sched.stats.to_dict()
    assert stats["counters"].get("prompt_mismatches") == 1


def test_params_without_digest_are_not_trusted():
    params = _prefill_params(PROMPT_A)
    del params["prompt_digest"]
    _, matched, step = _decode(PROMPT_A, params)
    assert matched == (0, False) and not step.pulls and len(step.frees) == 1


def test_mismatch_is_decided_once_even_if_asked_again():
    sched = _scheduler(producer=False)
    req = _request("d-req", PROMPT_B, dict(_prefill_params(PROMPT_A)))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # vLLM may ask again next step
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3]), 0)
    step = sched.build_step()
    assert len(step.frees) == 1 and sched.stats.to_dict()["counters"]["prompt_mismatches"] == 1
