"""Hold-protocol edge cases (issue 13 §1): each of these stranded or freed prefill memory wrongly.

The prefill side runs its real handler (and, where the test is about delivery, its real ZMQ side
channel); the TransferEngine is a fake only where no byte moves.
"""

from __future__ import annotations

import socket
import time

import pytest
from conftest import FakeTransferEngine
from kv_common.kv_byte_settings import KVByteSettings
from kv_common.testing.ports import free_port
from kv_mooncake.config import MooncakeConfig
from kv_mooncake.group_blocks import GroupBlocks
from kv_mooncake.params import RemoteSource
from kv_mooncake.rank_layout import DecodeLayout, PrefillLayout, PrefillRank
from kv_mooncake.step import HoldRequest, MooncakeStep, PullRequest
from kv_mooncake.wire import messages as P
from kv_mooncake.worker import LocalCache, MooncakeWorker, RankContext

SHAPE = {"block_size": 16, "head_size": 8, "num_layers": 2}


def _free_port_range(n: int) -> int:
    """A base port with ``n`` free ports from it on (best effort: each is free when tried)."""
    for _ in range(50):
        base = free_port()
        if base + n >= 65535:
            continue
        try:
            for i in range(1, n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def _cache() -> LocalCache:
    return LocalCache(["l0", "l1"], [4096, 8192], [1024, 1024], 4, 4)


def _prefill(cfg: MooncakeConfig, port: int, rank: PrefillRank = PrefillRank(0, 0), tp: int = 1) -> MooncakeWorker:
    w = MooncakeWorker(cfg, RankContext(engine_id="P", is_producer=True, is_consumer=False, side_channel_port=port,
                                        prefill_rank=rank, prefill_layout=PrefillLayout(tp_size=tp, total_kv_heads=4),
                                        total_kv_heads=4, kv_byte_settings=KVByteSettings(model="m")),
                       engine_factory=FakeTransferEngine)
    w.register_cache(_cache(), SHAPE, "float32")
    return w


def _finished(w: MooncakeWorker) -> set[str]:
    sending, _ = w.get_finished()
    return sending or set()


def _wait_freed(w: MooncakeWorker, request_id: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if request_id in _finished(w):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def prefill():
    w = _prefill(MooncakeConfig(hold_timeout_s=30.0, lease_s=0.3), free_port())
    yield w
    w.close()


def test_done_before_the_hold_keeps_the_expected_reader_count(prefill):
    """Two decode ranks read one prefill rank; the first DONE overtakes the hold (the prefill's
    worker applies holds one engine step after the request finished). The blocks must wait for the
    second reader: freed after the first, the second reads freed (reused) blocks."""
    prefill.handle(P.PullDone(request_id="r", reader_id="a", ok=True, expected_readers=2))
    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=2, block_ids=[0, 1])]))
    assert _finished(prefill) == set(), "freed after one of two readers"
    started = prefill.handle(P.PullStarted(request_id="r", reader_id="b", expected_readers=2, block_ids=[0, 1]))
    assert isinstance(started, P.Ack)
    prefill.handle(P.PullDone(request_id="r", reader_id="b", ok=True, expected_readers=2))
    assert _finished(prefill) == {"r"}


def test_learning_the_reader_count_keeps_a_shortened_hold_short(prefill):
    """A client shortened this request's hold to 0.3 s; the first of two readers then reads and
    leaves. The second never comes: the hold must expire at 0.3 s, not at the configured 30 s."""
    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=1, block_ids=[0], ttl_s=0.3)]))
    assert isinstance(prefill.handle(P.PullStarted(request_id="r", reader_id="a", expected_readers=2,
                                                   block_ids=[0])), P.Ack)
    prefill.handle(P.PullDone(request_id="r", reader_id="a", ok=True, expected_readers=2))
    time.sleep(0.5)
    assert _finished(prefill) == {"r"}, "the per-request hold was extended to hold_timeout_s"


def test_plan_error_on_the_decode_frees_every_prefill_rank_at_once():
    """The decode cannot plan the pull (here: a decode DCP layout the plan refuses). Nothing will
    ever be read, so every prefill rank of the request must free now, not after its 60 s hold."""
    base = _free_port_range(2)
    cfg = MooncakeConfig(hold_timeout_s=60.0, lease_s=2.0)
    ranks = [_prefill(cfg, base, PrefillRank(t, 0), tp=2) for t in range(2)]
    decode = MooncakeWorker(cfg, RankContext(engine_id="D", is_producer=False, is_consumer=True,
                                             side_channel_port=free_port(),
                                             decode_layout=DecodeLayout(tp_size=1, dcp_size=2), total_kv_heads=4,
                                             kv_byte_settings=KVByteSettings(model="m")),
                            engine_factory=FakeTransferEngine)
    decode.register_cache(_cache(), SHAPE, "float32")
    try:
        for w in ranks:
            w.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=2, block_ids=[0, 1])]))
        source = RemoteSource(engine_id="P", host="127.0.0.1", port=base, request_id="r", block_ids_by_group=[[0, 1]],
                              tp_size=2)
        decode.start_step(MooncakeStep(pulls=[PullRequest(request_id="d-r", source=source,
                                                          local_block_ids=[[2, 3]],
                                                          blocks_by_group=[GroupBlocks(0, 2)])]))
        deadline = time.monotonic() + 10
        recving: set[str] = set()
        while "d-r" not in recving and time.monotonic() < deadline:
            recving |= decode.get_finished()[1] or set()
            time.sleep(0.02)
        assert recving == {"d-r"}
        assert decode.ledger.take_block_ids_with_load_errors() == {2, 3}
        for w in ranks:
            assert _wait_freed(w, "r", 5.0), f"prefill rank {w.context.prefill_rank} still holds after a plan error"
    finally:
        decode.close()
        for w in ranks:
            w.close()


def _prefill_params(request_id: str, port: int, prompt: list[int], ttl_s: float | None = None) -> dict:
    """kv_transfer_params as the prefill's own scheduler hands them to the proxy."""
    from types import SimpleNamespace

    from kv_mooncake.scheduler import MooncakeScheduler

    sched = MooncakeScheduler(MooncakeConfig(), engine_id="P", block_size=16, is_producer=True, is_consumer=False,
                              side_channel_port=port)
    params = {"do_remote_decode": True, **({"hold_timeout_s": ttl_s} if ttl_s else {})}
    req = SimpleNamespace(request_id=request_id, kv_transfer_params=params, prompt_token_ids=prompt,
                          status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"), num_computed_tokens=len(prompt))
    held, out = sched.request_finished(req, ([0, 1],))
    assert held and out is not None
    return out


def test_a_request_waiting_on_the_decode_keeps_its_hold_alive():
    """The decode accepted the request (async load) but has no blocks for it yet: no pull, no
    lease. The prefill must not free under it: its hold (2 s here) is kept alive by the decode
    until the pull, and freed by the DONE, not by expiry."""
    from types import SimpleNamespace

    from kv_mooncake.scheduler import MooncakeScheduler

    cfg = MooncakeConfig(hold_timeout_s=2.0, lease_s=1.5)  # a heartbeat every 0.5 s extends by 1.5 s
    prefill = _prefill(cfg, free_port())
    sched = MooncakeScheduler(cfg, engine_id="D", block_size=16, is_producer=False, is_consumer=True,
                              side_channel_port=free_port())
    decode = MooncakeWorker(cfg, RankContext(engine_id="D", is_producer=False, is_consumer=True,
                                             side_channel_port=free_port(), total_kv_heads=4),
                            engine_factory=FakeTransferEngine)
    decode.register_cache(_cache(), SHAPE, "float32")
    prompt = list(range(20))
    params = _prefill_params("r", prefill.context.side_channel_port, prompt)
    req = SimpleNamespace(request_id="d-r", kv_transfer_params=params, prompt_token_ids=prompt,
                          status=SimpleNamespace(name="FINISHED_ABORTED"))
    try:
        prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=2, block_ids=[0, 1])]))
        assert sched.get_num_new_matched_tokens(req, 0) == (20, True)
        end = time.monotonic() + 5.0  # 2.5 hold times, no blocks for the request on the decode
        freed: set[str] = set()
        while time.monotonic() < end:
            decode.start_step(sched.build_step())  # engine steps go on (other requests)
            freed |= _finished(prefill)
            time.sleep(0.05)
        assert freed == set(), "the prefill freed a request the decode had accepted and will pull"
        assert sched.request_finished(req, []) == (False, None)  # then aborted: frees at once
        decode.start_step(sched.build_step())
        assert _wait_freed(prefill, "r", 5.0)
    finally:
        decode.close()
        prefill.close()


def test_keep_alive_is_capped():
    """A decode that keeps accepting but never pulls cannot hold prefill memory forever."""
    clock = [0.0]
    from kv_mooncake.hold.ledger import HoldLedger

    freed: list[tuple[str, str]] = []
    tracker = HoldLedger(lambda r, why: freed.append((r, why)), clock=lambda: clock[0])
    tracker.hold("r", 1, 2.0)
    for t in range(1, 20):
        clock[0] = float(t)
        tracker.keep_alive("r", extend_s=1.5, limit_s=5.0)
        tracker.expire()
    assert freed == [("r", "expired")]
    clock[0] = 0.0
    tracker.hold("s", 1, 2.0)
    clock[0] = 3.0  # expired before the first heartbeat: not revived
    assert not tracker.keep_alive("s", extend_s=1.5, limit_s=5.0)


def test_only_young_holds_count_as_pending_frees():
    """vLLM does not preempt while ``has_pending_block_frees()``; a hold nobody pulls (dead decode)
    must stop counting after a short window, not keep the prefill's scheduling stalled for its
    whole hold time."""
    from types import SimpleNamespace

    from kv_mooncake.scheduler import MooncakeScheduler

    now = [100.0]
    sched = MooncakeScheduler(MooncakeConfig(hold_timeout_s=120.0), engine_id="P", block_size=16, is_producer=True,
                              is_consumer=False, side_channel_port=1)
    sched._clock = lambda: now[0]
    req = SimpleNamespace(request_id="r", kv_transfer_params={"do_remote_decode": True}, prompt_token_ids=[1] * 20,
                          status=SimpleNamespace(name="FINISHED_STOPPED"), num_computed_tokens=20)
    assert sched.request_finished(req, ([0, 1],))[0]
    assert sched.has_pending_block_frees()  # just handed over: a healthy decode pulls it soon
    now[0] += 30.0  # nobody pulled in 30 s: the hold may last 90 s more, preempting must go on
    assert not sched.has_pending_block_frees(), "an old hold stalls the prefill's scheduling"
    sched.update_connector_output({"r"})
    assert not sched.has_pending_block_frees()


def test_heartbeats_to_a_frozen_prefill_do_not_delay_dones_to_a_healthy_one():
    """Accepted requests of a frozen prefill get a heartbeat every step (the decode keeps stepping):
    they must neither pile up nor hold back the DONE that frees a healthy prefill's blocks."""
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(16)
    cfg = MooncakeConfig(hold_timeout_s=30.0, lease_s=3.0)
    prefill = _prefill(cfg, free_port())
    decode = MooncakeWorker(cfg, RankContext(engine_id="D", is_producer=False, is_consumer=True,
                                             side_channel_port=free_port(), total_kv_heads=4),
                            engine_factory=FakeTransferEngine)
    decode.register_cache(_cache(), SHAPE, "float32")
    try:
        prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=1, block_ids=[0])]))
        waiting = [RemoteSource(engine_id="P", host="127.0.0.1", port=frozen.getsockname()[1], request_id=f"f{i}",
                                block_ids_by_group=[[0]]) for i in range(4)]
        for _ in range(5):  # five engine steps, each with heartbeats for the four waiting requests
            decode.start_step(MooncakeStep(keepalives=waiting))
        source = RemoteSource(engine_id="P", host="127.0.0.1", port=prefill.context.side_channel_port, request_id="r",
                              block_ids_by_group=[[0]])
        decode.start_step(MooncakeStep(frees=[source]))  # the decode aborted "r": FreeNow, on the same path as DONE
        assert _wait_freed(prefill, "r", 5.0), "the FreeNow waited behind heartbeats to a frozen prefill"
    finally:
        decode.close()
        prefill.close()
        frozen.close()


def test_a_message_that_comes_while_the_blocks_are_freed_is_told_they_were_freed():
    """A reader's message that comes while the prefill frees a request's blocks (its free callback
    running) is told the request was freed: "not held (yet)" would have it retry until its deadline,
    and a DONE kept for a hold that never comes would linger. The hold's end and its reason are one
    step of the ledger (issue 43: one record, one lock)."""
    from kv_common.stats import TransferStatsBase
    from kv_mooncake.hold.responder import PrefillHolder

    holder = PrefillHolder(MooncakeConfig(), engine_id="P", prefill_layout=PrefillLayout(tp_size=1, total_kv_heads=4),
                           stats=TransferStatsBase())
    ledger = holder.ledger
    replies: list[object] = []
    free = ledger._free_fn

    def freeing(request_id: str, reason: str) -> None:  # a reader's messages, in that instant
        replies.append(holder.handle(P.PullStarted(request_id=request_id, reader_id="late", expected_readers=1,
                                                   block_ids=[0])))
        replies.append(holder.handle(P.PullDone(request_id=request_id, reader_id="late", ok=False)))
        free(request_id, reason)

    ledger._free_fn = freeing
    holder.hold("r", 1, [0])
    holder.handle(P.FreeNow(request_id="r"))
    started, done = replies
    assert isinstance(started, P.Refused) and "already freed (aborted)" in started.reason and not started.retry
    assert isinstance(done, P.PullDoneReply) and not done.held_throughout
    assert not ledger._overtaken  # nothing kept for a hold that will not come
    assert holder.take_freed() == {"r"} and holder.counts()["held_requests"] == 0
