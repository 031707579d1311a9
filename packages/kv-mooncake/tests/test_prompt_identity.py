"""The decode pulls a prefill's KV only for the very prompt the prefill computed (issue 12, item 4).

A proxy or chat-template difference can hand the decode ``kv_transfer_params`` of another prompt
with the same number of blocks; pulling them loads the wrong KV silently. The prefill puts a digest
of the prompt's token ids in ``kv_transfer_params``; the decode compares it before pulling.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kv_mooncake.config import MooncakeConfig
from kv_mooncake.scheduler import MooncakeScheduler
from kv_mooncake.step import MooncakeStep

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


# ---- issue 23 §7: the same tokens with another image, LoRA adapter or cache_salt -----------------
def _vllm_request(request_id: str, prompt: list[int], params: dict, **identity):
    """A real vLLM Request (as the scheduler sees it), with vLLM's own block hasher."""
    vllm_request = pytest.importorskip("vllm.v1.request")
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    request = vllm_request.Request(request_id, list(prompt), SamplingParams(max_tokens=1), None,
                                   block_hasher=get_request_block_hasher(BLOCK, sha256), **identity)
    request.kv_transfer_params = dict(params)
    request.status = vllm_request.RequestStatus.FINISHED_LENGTH_CAPPED
    return request


def _image(identifier: str, offset: int, length: int):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def _lora(name: str, path: str):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=1, lora_path=path)


PROMPT_C = list(range(300, 340))  # 40 tokens: two full blocks of 16 and a tail of 8
VARIANTS = {  # identity of the prefill's request -> of the decode's (same tokens)
    "salt": ({"cache_salt": "alice"}, {"cache_salt": "bob"}),
    "salt vs none": ({"cache_salt": "alice"}, {}),
    "lora": ("lora-a", "lora-b"),
    "image": ("img-a", "img-b"),
    "image in the tail": ("tail-a", "tail-b"),  # vLLM hashes full blocks only: no block hash covers it
}


def _identity(spec):
    if isinstance(spec, dict):
        return spec
    kind, name = spec.split("-")
    if kind == "lora":
        return {"lora_request": _lora(name, f"/adapters/{name}")}
    if kind == "img":
        return {"mm_features": [_image(f"image-{name}", 4, 8)]}
    return {"mm_features": [_image(f"image-{name}", 34, 4)]}


def _prefill_params_for(request) -> dict:
    delay, params = _scheduler(producer=True).request_finished(request, [[7, 8, 9]])
    assert delay and params is not None
    return params


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_same_tokens_with_another_image_lora_or_salt_pull_nothing(variant):
    """The prefill computed the prompt with one image / adapter / cache_salt, the decode's request
    has the same token ids with another: its KV is not this request's, nothing may be pulled."""
    prefill_side, decode_side = (_identity(spec) for spec in VARIANTS[variant])
    params = _prefill_params_for(_vllm_request("p-req", PROMPT_C, {"do_remote_decode": True}, **prefill_side))
    decode = _vllm_request("d-req", PROMPT_C, params, **decode_side)
    sched = _scheduler(producer=False)
    assert sched.get_num_new_matched_tokens(decode, 0) == (0, False), f"{variant}: pulled another prompt's KV"
    sched.update_state_after_alloc(decode, FakeBlocks([1, 2, 3]), 0)
    step = sched.build_step()
    assert not step.pulls and [s.request_id for s in step.frees] == ["p-req"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_same_tokens_and_same_identity_are_pulled(variant):
    identity = _identity(VARIANTS[variant][0])
    params = _prefill_params_for(_vllm_request("p-req", PROMPT_C, {"do_remote_decode": True}, **identity))
    decode = _vllm_request("d-req", PROMPT_C, params, **_identity(VARIANTS[variant][0]))
    sched = _scheduler(producer=False)
    assert sched.get_num_new_matched_tokens(decode, 0) == (len(PROMPT_C), True)
    sched.update_state_after_alloc(decode, FakeBlocks([1, 2, 3]), len(PROMPT_C))
    (pull,) = sched.build_step().pulls
    assert pull.prompt_digest == params["prompt_digest"]  # what the reader sends with PullStarted


def test_the_digest_covers_what_vllms_block_hashes_cover():
    """Wherever vLLM's own block hashes tell two requests apart, so does the digest (and it also
    covers the partial last block, which vLLM does not hash)."""
    from kv_mooncake.identity import request_digest

    base = _vllm_request("x", PROMPT_C, {})
    assert request_digest(_vllm_request("z", PROMPT_C, {})) == request_digest(base)
    for variant, (spec, _) in VARIANTS.items():
        other = _vllm_request("y", PROMPT_C, {}, **_identity(spec))
        if variant != "image in the tail":
            assert other.block_hashes != base.block_hashes, variant
        assert request_digest(other) != request_digest(base), variant


def test_the_prefill_refuses_a_reader_of_another_prompt():
    """kv_transfer_params are the client's to forge: one that names another user's held request with
    its own prompt's digest passes the decode's check. The prefill compares the reader's digest with
    the one it computed: the pull is refused (fails alone, the decode recomputes)."""
    from conftest import FakeTransferEngine
    from kv_common.kv_byte_settings import KVByteSettings
    from kv_mooncake.identity import prompt_digest
    from kv_mooncake.step import HoldRequest
    from kv_mooncake.wire import messages as P
    from kv_mooncake.worker import LocalCache, MooncakeWorker, RankContext

    w = MooncakeWorker(MooncakeConfig(), RankContext(engine_id="P", is_producer=True, is_consumer=False,
                                                     side_channel_port=1, total_kv_heads=4,
                                                     kv_byte_settings=KVByteSettings(model="m")),
                       engine_factory=FakeTransferEngine)
    w.register_cache(LocalCache(["l0"], [4096], [1024], 4, 4), {"block_size": 16, "head_size": 8, "num_layers": 1},
                     "float32")
    held, other = prompt_digest(PROMPT_A), prompt_digest(PROMPT_B)
    w.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=1, block_ids=[0], prompt_digest=held)]))
    for reader_digest in (other, ""):
        reply = w.handle(P.PullStarted(request_id="r", reader_id=f"x{reader_digest}", expected_readers=1,
                                       block_ids=[0], prompt_digest=reader_digest))
        assert isinstance(reply, P.Refused) and not reply.retry and "prompt" in reply.reason
        assert held not in reply.reason  # the held prompt's digest is not handed to a stranger
    assert w.leak_report()["active_reads"] == 0
    ok = w.handle(P.PullStarted(request_id="r", reader_id="d", expected_readers=1, block_ids=[0], prompt_digest=held))
    assert isinstance(ok, P.Ack)
    w.close()
