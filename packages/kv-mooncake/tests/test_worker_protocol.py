"""Prefill-side protocol: DONE counting, FreeNow, expiry, handshake refusal over real ZMQ sockets."""

from __future__ import annotations

import time

import msgspec
import pytest
from conftest import FakeTransferEngine
from kv_common.kv_byte_settings import KVByteSettings
from kv_common.testing.ports import free_port
from kv_mooncake.config import MooncakeConfig
from kv_mooncake.errors import SideChannelTimeout
from kv_mooncake.pull import messenger as messenger_module
from kv_mooncake.step import HoldRequest, MooncakeStep
from kv_mooncake.wire import client as side_channel
from kv_mooncake.wire import messages as P
from kv_mooncake.worker import LocalCache, MooncakeWorker, RankContext, query_leaks
from raw_side_channel import RawConnection

SHAPE = {"block_size": 16, "head_size": 8, "num_layers": 2}


def _prefill_worker(cfg: MooncakeConfig) -> MooncakeWorker:
    """A prefill rank over raw regions (two layers, four blocks), its side channel on a free port."""
    w = MooncakeWorker(cfg, RankContext(engine_id="P", is_producer=True, is_consumer=False,
                                        side_channel_port=free_port(), total_kv_heads=4,
                                        kv_byte_settings=KVByteSettings(model="m")),
                       engine_factory=FakeTransferEngine)
    w.register_cache(LocalCache(["l0", "l1"], [4096, 8192], [1024, 1024], 4, 4), SHAPE, "float32")
    return w


@pytest.fixture
def prefill():
    w = _prefill_worker(MooncakeConfig(hold_timeout_s=0.5, lease_s=0.3))
    yield w
    w.close()


@pytest.fixture
def patient_prefill():
    """A prefill whose holds outlast any pause of a loaded machine, for tests not about expiry
    (with ``prefill``'s 0.5 s, CI once saw a hold expire between two messages)."""
    w = _prefill_worker(MooncakeConfig(hold_timeout_s=60.0, lease_s=30.0))
    yield w
    w.close()


def _finished(w: MooncakeWorker) -> set[str]:
    sending, _ = w.get_finished()
    return sending or set()


def test_freed_once_after_all_expected_dones(patient_prefill):
    prefill = patient_prefill
    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=3, block_ids=list(range(3)))]))
    assert prefill.leak_report()["held_blocks"] == 3
    assert isinstance(prefill.handle(P.PullStarted(request_id="r", reader_id="a", expected_readers=2, block_ids=[0])), P.Ack)
    assert isinstance(prefill.handle(P.PullDone(request_id="r", reader_id="a", ok=True, expected_readers=2)),
                      P.PullDoneReply)
    assert _finished(prefill) == set()  # one of two readers
    prefill.handle(P.PullDone(request_id="r", reader_id="a", ok=True, expected_readers=2))  # repeated: counts once
    assert _finished(prefill) == set()
    prefill.handle(P.PullDone(request_id="r", reader_id="b", ok=False, expected_readers=2))
    assert _finished(prefill) == {"r"}
    prefill.handle(P.PullDone(request_id="r", reader_id="c", ok=True, expected_readers=2))
    assert _finished(prefill) == set()  # never twice
    assert prefill.leak_report()["held_blocks"] == 0
    refused = prefill.handle(P.PullStarted(request_id="r", reader_id="d", expected_readers=1, block_ids=[0]))
    assert isinstance(refused, P.Refused) and not refused.retry and "already freed" in refused.reason


def test_unknown_request_is_retryable_and_early_done_applies(prefill):
    reply = prefill.handle(P.PullStarted(request_id="x", reader_id="a", expected_readers=1, block_ids=[0]))
    assert isinstance(reply, P.Refused) and reply.retry
    prefill.handle(P.PullDone(request_id="x", reader_id="a", ok=False, expected_readers=1))  # before the hold
    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="x", num_blocks=1, block_ids=list(range(1)))]))
    assert _finished(prefill) == {"x"}


def test_free_now_and_expiry(prefill):
    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="a", num_blocks=1, block_ids=list(range(1))),
                                           HoldRequest(request_id="b", num_blocks=1, block_ids=list(range(1)))]))
    prefill.handle(P.FreeNow(request_id="a"))
    assert _finished(prefill) == {"a"}
    time.sleep(0.6)
    assert _finished(prefill) == {"b"}  # hold_timeout_s passed, nobody pulled
    assert prefill.stats.to_dict()["counters"]["expired_holds"] == 1


def test_lease_keeps_blocks_past_the_hold():
    # A lease 1.5 s long renewed every 0.3 s: a loaded machine may pause the test 1.2 s between two
    # renewals (0.1 s of slack, as this test had with a 0.3 s lease, is one scheduler hiccup).
    prefill = _prefill_worker(MooncakeConfig(hold_timeout_s=0.5, lease_s=1.5))
    try:
        prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=1, block_ids=list(range(1)))]))
        started = prefill.handle(P.PullStarted(request_id="r", reader_id="a", expected_readers=1, block_ids=[0]))
        assert isinstance(started, P.Ack)
        for _ in range(3):  # 0.9 s > hold_timeout_s, renewed every 0.3 s
            time.sleep(0.3)
            assert isinstance(prefill.handle(P.LeaseRenew(request_id="r", reader_id="a")), P.Ack)
            assert _finished(prefill) == set()
        prefill.handle(P.PullDone(request_id="r", reader_id="a", ok=True))
        assert _finished(prefill) == {"r"}
    finally:
        prefill.close()  # its side channel, also when an assertion fails


def _compat(**changes) -> P.Compatibility:
    base = dict(model="m", dtype="float32", block_size=16, head_size=8, num_layers=2, total_kv_heads=4, use_mla=False,
                layout="raw:[blocks,heads,bytes]", kernel_block_size=16, protocol_version=P.PROTOCOL_VERSION)
    base.update(changes)
    return P.Compatibility(**base)


def test_handshake_over_the_side_channel_and_compatibility_refusal(prefill):
    addr = prefill.server.address
    ok = side_channel.request(addr, P.Handshake(engine_id="P", compatibility=_compat(), reader_id="d"),
                              P.REPLY_TYPES, 2.0)
    assert isinstance(ok, P.HandshakeReply) and ok.layer_names == ["l0", "l1"] and ok.base_addresses == [4096, 8192]
    bad = side_channel.request(addr, P.Handshake(engine_id="P", compatibility=_compat(block_size=128), reader_id="d"),
                               P.REPLY_TYPES, 2.0)
    assert isinstance(bad, P.Refused) and "block_size: decode 128, prefill 16" in bad.reason
    other = side_channel.request(addr, P.Handshake(engine_id="Q", compatibility=_compat(), reader_id="d"),
                                 P.REPLY_TYPES, 2.0)
    assert isinstance(other, P.Refused) and "engine id" in other.reason
    assert query_leaks(addr) == {"held_blocks": 0, "held_requests": 0, "pending_pulls": 0, "active_reads": 0}


def test_malformed_and_oversized_messages_are_refused(prefill):
    with RawConnection.to(prefill.server.address) as conn:
        conn.send(b"\xc1not msgpack")
        assert b"undecodable" in (conn.read() or b"")
        conn.send(msgspec.msgpack.encode({"type": "Evil", "cmd": "rm -rf"}))
        assert b"undecodable" in (conn.read() or b"")
    with RawConnection.to(prefill.server.address) as big:
        # Over max_message_bytes: refused by name from its length alone, then the connection closed.
        big.sock.sendall(b"\x00\x20\x00\x00")  # 2 MiB announced
        assert b"message too large" in (big.read() or b"")
        assert big.closed_by_peer()
    # The server still answers well-formed requests.
    assert query_leaks(prefill.server.address)["held_blocks"] == 0


def test_reader_may_only_read_the_requests_own_blocks(patient_prefill):
    prefill = patient_prefill
    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=2, block_ids=[2, 3]),
                                           HoldRequest(request_id="s", num_blocks=1, block_ids=[1])]))
    for bad_ids in ([1], [2, 3, 0], []):  # another request's block, one too many, undeclared
        reply = prefill.handle(P.PullStarted(request_id="r", reader_id="a", expected_readers=1, block_ids=bad_ids))
        assert isinstance(reply, P.Refused) and not reply.retry and "not held for this request" in reply.reason
    assert prefill.leak_report()["active_reads"] == 0
    assert prefill.stats.to_dict()["counters"]["rejected_reads"] == 3
    ok = prefill.handle(P.PullStarted(request_id="r", reader_id="a", expected_readers=1, block_ids=[3]))
    assert isinstance(ok, P.Ack)
    assert prefill.leak_report()["active_reads"] == 1
    prefill.handle(P.PullDone(request_id="r", reader_id="a", ok=True))
    assert _finished(prefill) == {"r"}
    assert prefill.leak_report() == {"held_blocks": 1, "held_requests": 1, "pending_pulls": 0, "active_reads": 0}


def test_client_may_shorten_but_not_extend_the_hold():
    from kv_mooncake.params import parse_transfer_params
    from kv_mooncake.scheduler import MooncakeScheduler

    sched = MooncakeScheduler(MooncakeConfig(hold_timeout_s=30.0), engine_id="P", block_size=16,
                              is_producer=True, is_consumer=False, side_channel_port=1)
    def ttl(params):
        return sched._hold_ttl(parse_transfer_params({"do_remote_decode": True, **params}).hold_timeout_s)

    assert ttl({"hold_timeout_s": 2}) == 2.0
    assert ttl({"hold_timeout_s": 3600}) == 30.0
    assert ttl({"hold_timeout_s": "x"}) is None
    assert ttl({"hold_timeout_s": float("nan")}) is None
    assert ttl({}) is None


def test_done_is_retried_until_a_slow_prefill_answers(prefill, monkeypatch):
    """A DONE whose first answer comes late is sent again, not dropped (the blocks would stay held)."""
    decode = MooncakeWorker(MooncakeConfig(lease_s=3.0), RankContext(engine_id="D", is_producer=False,
                                                                     is_consumer=True, side_channel_port=free_port()),
                            engine_factory=FakeTransferEngine)
    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=1, block_ids=[0])]))
    real = decode.puller.messenger._client.request
    calls = []

    def flaky(address, message, *args, **kwargs):
        calls.append(type(message).__name__)
        if len(calls) <= 2:
            raise SideChannelTimeout("starved")
        return real(address, message, *args, **kwargs)

    monkeypatch.setattr(decode.puller.messenger._client, "request", flaky)
    decode.puller.messenger._notify(prefill.server.address, P.PullDone(request_id="r", reader_id="d", ok=True))
    assert calls == ["PullDone"] * 3
    assert _finished(prefill) == {"r"}
    decode.close()


def test_decode_request_aborted_before_scheduling_still_frees_the_prefill(prefill):
    """The decode scheduler saw the request (async lookup) but it finished before its blocks were
    allocated: the prefill must be told to free now, not after its hold expires."""
    from types import SimpleNamespace

    from kv_mooncake.identity import prompt_digest
    from kv_mooncake.scheduler import MooncakeScheduler

    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=1, block_ids=[0], ttl_s=60)]))
    cfg = MooncakeConfig()
    sched = MooncakeScheduler(cfg, engine_id="D", block_size=16, is_producer=False, is_consumer=True,
                              side_channel_port=free_port())
    decode = MooncakeWorker(cfg, RankContext(engine_id="D", is_producer=False, is_consumer=True,
                                             side_channel_port=free_port()), engine_factory=FakeTransferEngine)
    decode.register_cache(LocalCache(["l0", "l1"], [4096, 8192], [1024, 1024], 4, 4), SHAPE, "float32")
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1",
              "remote_port": prefill.context.side_channel_port, "remote_block_ids": [0], "remote_request_id": "r",
              "prompt_digest": prompt_digest(range(20))}
    req = SimpleNamespace(request_id="d-r", kv_transfer_params=params, prompt_token_ids=list(range(20)),
                          status=SimpleNamespace(name="FINISHED_ABORTED"))
    try:
        assert sched.get_num_new_matched_tokens(req, 0) == (20, True)
        assert sched.request_finished(req, []) == (False, None)  # aborted: nothing allocated
        step = sched.build_step()
        assert [s.request_id for s in step.frees] == ["r"] and not step.pulls
        decode.start_step(step)
        deadline = time.monotonic() + 5
        freed: set[str] = set()
        while "r" not in freed and time.monotonic() < deadline:
            freed |= _finished(prefill)
            time.sleep(0.02)
        assert freed == {"r"}
        assert prefill.leak_report()["held_requests"] == 0
        assert sched.build_step().frees == []  # told once
    finally:
        decode.close()


def test_first_readers_done_does_not_free_under_a_second_readers_lease(patient_prefill):
    """Issue 23 §4: a proxy retried the decode (or the client re-sent the request): two decodes read
    one hold that expects one reader. The first DONE must not free the blocks the second still reads."""
    prefill = patient_prefill
    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=2, block_ids=[0, 1])]))
    for reader in ("first", "retry"):
        started = prefill.handle(P.PullStarted(request_id="r", reader_id=reader, expected_readers=1, block_ids=[0, 1]))
        assert isinstance(started, P.Ack)
    first = prefill.handle(P.PullDone(request_id="r", reader_id="first", ok=True))
    assert _finished(prefill) == set(), "freed under the second reader's current lease"
    retry = prefill.handle(P.PullDone(request_id="r", reader_id="retry", ok=True))
    assert _finished(prefill) == {"r"}
    assert isinstance(first, P.PullDoneReply) and first.held_throughout
    assert isinstance(retry, P.PullDoneReply) and retry.held_throughout


def test_pull_done_reply_says_whether_the_hold_survived_the_read(prefill):
    """The reader's lease lapsed and the hold expired under the read (a starved decode, or one whose
    lease_s is longer than this prefill's): the DONE's reply must say so, the decode then reports the
    blocks it read as load errors. A read under a lease that held says so too."""
    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="lapsed", num_blocks=1, block_ids=[0])]))
    assert isinstance(prefill.handle(P.PullStarted(request_id="lapsed", reader_id="a", expected_readers=1,
                                                   block_ids=[0])), P.Ack)
    time.sleep(0.7)  # past the lease (0.3 s) and the hold (0.5 s)
    assert _finished(prefill) == {"lapsed"}
    reply = prefill.handle(P.PullDone(request_id="lapsed", reader_id="a", ok=True))
    assert isinstance(reply, P.PullDoneReply) and not reply.held_throughout

    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="kept", num_blocks=1, block_ids=[0])]))
    assert isinstance(prefill.handle(P.PullStarted(request_id="kept", reader_id="a", expected_readers=1,
                                                   block_ids=[0])), P.Ack)
    reply = prefill.handle(P.PullDone(request_id="kept", reader_id="a", ok=True))
    assert isinstance(reply, P.PullDoneReply) and reply.held_throughout
    assert _finished(prefill) == {"kept"}
    # The same DONE again (its first answer came too late for the decode): the same answer.
    assert prefill.handle(P.PullDone(request_id="kept", reader_id="a", ok=True)).held_throughout
    # A DONE from a reader that never took a lease vouches for nothing.
    prefill.start_step(MooncakeStep(holds=[HoldRequest(request_id="never", num_blocks=1, block_ids=[0])]))
    reply = prefill.handle(P.PullDone(request_id="never", reader_id="b", ok=False))
    assert isinstance(reply, P.PullDoneReply) and not reply.held_throughout


def test_the_decodes_handshake_cache_is_bounded(monkeypatch):
    """Issue 23 §8: one cached handshake per (prefill rank, engine id) ever seen, never dropped, is
    state that only grows. The cache keeps the most recently used ones."""

    monkeypatch.setattr(messenger_module, "HANDSHAKE_CACHE_SIZE", 2)
    cfg = MooncakeConfig()
    prefills = []
    for _ in range(3):
        prefills.append(_prefill_worker(cfg))
    decode = MooncakeWorker(cfg, RankContext(engine_id="D", is_producer=False, is_consumer=False, side_channel_port=1,
                                             total_kv_heads=4, kv_byte_settings=KVByteSettings(model="m")),
                            engine_factory=FakeTransferEngine)
    decode.register_cache(LocalCache(["l0", "l1"], [4096, 8192], [1024, 1024], 4, 4), SHAPE, "float32")
    messenger = decode.puller.messenger
    try:
        deadline = time.monotonic() + 10
        first = messenger.handshake(prefills[0].server.address, "P", deadline)
        messenger.handshake(prefills[1].server.address, "P", deadline)
        assert messenger.handshake(prefills[0].server.address, "P", deadline) is first  # cached, now most recent
        messenger.handshake(prefills[2].server.address, "P", deadline)  # drops prefill 1's, the least recent
        assert messenger.cached_handshakes() == 2
        assert messenger.handshake(prefills[0].server.address, "P", deadline) is first
    finally:
        decode.close()
        for w in prefills:
            w.close()


def test_an_idle_step_of_a_holding_prefill_waits_for_the_done_not_spins():
    """vLLM steps the engine while blocks are held: a step that scheduled nothing waits (up to
    idle_step_wait_ms) in get_finished, and the reader's DONE ends the wait at once."""
    import threading

    w = _prefill_worker(MooncakeConfig(hold_timeout_s=30.0, idle_step_wait_ms=100.0))
    try:
        w.start_step(MooncakeStep(holds=[HoldRequest(request_id="r", num_blocks=1, block_ids=[0])], idle=True))
        t0 = time.monotonic()
        assert w.get_finished() == (None, None)  # nothing freed: the whole bound, not a spin
        assert time.monotonic() - t0 >= 0.09
        w.start_step(MooncakeStep(idle=False))
        t0 = time.monotonic()
        w.get_finished()  # a step with tokens never waits
        assert time.monotonic() - t0 < 0.05
        w.start_step(MooncakeStep(idle=True))
        threading.Timer(0.01, lambda: w.handle(P.FreeNow(request_id="r", reader_id="d"))).start()
        t0 = time.monotonic()
        assert w.get_finished()[0] == {"r"}  # freed during the wait: reported in this very step
        assert time.monotonic() - t0 < 0.09
    finally:
        w.close()
