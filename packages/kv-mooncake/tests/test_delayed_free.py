from __future__ import annotations

import threading
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_mooncake.hold.ledger import HoldLedger


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(clock: FakeClock | None = None):
    freed: list[tuple[str, str]] = []
    lock = threading.Lock()

    def free_fn(request_id: str, reason: str) -> None:
        with lock:
            freed.append((request_id, reason))

    tracker = HoldLedger(free_fn, clock=clock or FakeClock())
    return tracker, freed


def test_frees_after_last_distinct_reader():
    tracker, freed = make()
    tracker.hold("r1", expected_done=2, ttl_s=10)
    assert tracker.held() == {"r1"}
    assert tracker.done("r1", "reader-a") is False
    assert tracker.done("r1", "reader-a") is False  # duplicate from the same reader ignored
    assert freed == []
    assert tracker.done("r1", "reader-b") is True
    assert freed == [("r1", "done")]
    assert len(tracker) == 0
    assert tracker.done("r1", "reader-c") is False  # already freed


def test_a_readers_done_does_not_free_under_another_readers_current_lease():
    """Issue 23 §4: a second reader (a proxy's decode retry, a re-sent request) reads the same hold.
    The first reader's DONE reaches the expected count of one; freeing then would hand the blocks to
    new requests while the second reader still reads them."""
    tracker, freed = make()
    tracker.hold("r", expected_done=1, ttl_s=10)
    assert tracker.begin_read("r", "first", lease_s=3)
    assert tracker.begin_read("r", "retry", lease_s=3)
    assert tracker.done("r", "first") is False
    assert freed == [], "freed under the second reader's current lease"
    assert tracker.done("r", "retry") is True
    assert freed == [("r", "done")]


def test_readers_all_done_free_once_the_other_lease_lapses():
    """The second reader never says DONE (it died): its lease lapsing frees the blocks, long before
    the hold's own deadline."""
    clock = FakeClock()
    tracker, freed = make(clock)
    tracker.hold("r", expected_done=1, ttl_s=100)
    assert tracker.begin_read("r", "first", lease_s=3)
    assert tracker.begin_read("r", "retry", lease_s=3)
    assert tracker.done("r", "first") is False
    assert tracker.expire() == []
    clock.now += 4
    assert tracker.expire() == ["r"]
    assert freed == [("r", "done")]


def test_unknown_done_is_ignored():
    tracker, freed = make()
    assert tracker.done("nope", "a") is False
    assert freed == []


def test_zero_expected_frees_at_once():
    tracker, freed = make()
    tracker.hold("r", expected_done=0, ttl_s=10)
    assert freed == [("r", "done")]
    assert len(tracker) == 0


def test_expiry_frees_unread_hold():
    clock = FakeClock()
    tracker, freed = make(clock)
    tracker.hold("r1", 1, ttl_s=5)
    tracker.hold("r2", 1, ttl_s=50)
    assert tracker.expire() == []
    clock.now += 6
    assert tracker.expire() == ["r1"]
    assert freed == [("r1", "expired")]
    assert tracker.held() == {"r2"}
    assert tracker.begin_read("r1", "late") is False


def test_lease_prevents_expiry_during_inflight_read():
    clock = FakeClock()
    tracker, freed = make(clock)
    tracker.hold("r", 1, ttl_s=5)
    assert tracker.begin_read("r", "reader", lease_s=3)
    for _ in range(5):  # the pull runs long past the hold's deadline, renewing its lease
        clock.now += 2
        assert tracker.renew("r", 3, reader_id="reader")
        assert tracker.expire() == []
    assert freed == []
    assert tracker.done("r", "reader") is True
    assert freed == [("r", "done")]


def test_stale_lease_lets_expiry_free():
    clock = FakeClock()
    tracker, freed = make(clock)
    tracker.hold("r", 1, ttl_s=5)
    assert tracker.begin_read("r", "reader", lease_s=3)
    clock.now += 4  # lease lapsed, hold deadline not yet
    assert tracker.expire() == []
    clock.now += 2  # both lapsed: the reader is presumed dead
    assert tracker.expire() == ["r"]
    assert tracker.renew("r", 10, reader_id="reader") is False
    assert tracker.done("r", "reader") is False
    assert freed == [("r", "expired")]


def test_begin_read_after_deadline_refused():
    clock = FakeClock()
    tracker, freed = make(clock)
    tracker.hold("r", 1, ttl_s=1)
    clock.now += 2
    assert tracker.begin_read("r", "x") is False  # never read blocks about to be freed
    assert tracker.begin_read("missing", "x") is False


def test_renew_whole_hold_extends_deadline():
    clock = FakeClock()
    tracker, freed = make(clock)
    tracker.hold("r", 1, ttl_s=2)
    clock.now += 1
    assert tracker.renew("r", 10)
    clock.now += 5
    assert tracker.expire() == []
    clock.now += 6
    assert tracker.expire() == ["r"]
    assert tracker.renew("gone", 1) is False


def test_abort_frees_immediately_without_reads():
    tracker, freed = make()
    tracker.hold("r", 2, ttl_s=10)
    assert tracker.abort("r") is True
    assert freed == [("r", "aborted")]
    assert tracker.abort("r") is False
    assert tracker.done("r", "a") is False
    assert freed == [("r", "aborted")]


def test_abort_waits_for_inflight_read_then_frees():
    clock = FakeClock()
    tracker, freed = make(clock)
    tracker.hold("r", 2, ttl_s=10)
    assert tracker.begin_read("r", "a")
    assert tracker.abort("r") is False  # a read is in flight under a current lease
    assert tracker.begin_read("r", "b") is False  # but no new reader may start
    assert freed == []
    assert tracker.done("r", "a") is True
    assert freed == [("r", "aborted")]


def test_abort_with_inflight_read_freed_by_expiry_when_reader_dies():
    clock = FakeClock()
    tracker, freed = make(clock)
    tracker.hold("r", 1, ttl_s=10)
    tracker.begin_read("r", "a", lease_s=1)
    tracker.abort("r")
    clock.now += 2
    assert tracker.expire() == ["r"]
    assert freed == [("r", "aborted")]


def test_force_abort():
    tracker, freed = make()
    tracker.hold("r", 1, ttl_s=10)
    tracker.begin_read("r", "a")
    assert tracker.abort("r", force=True) is True
    assert freed == [("r", "aborted")]


def test_free_fn_failure_does_not_block_others(caplog):
    clock = FakeClock()
    calls = []

    def free_fn(request_id, reason):
        calls.append(request_id)
        if request_id == "bad":
            raise RuntimeError("boom")

    tracker = HoldLedger(free_fn, clock=clock)
    tracker.hold("bad", 1, 1)
    tracker.hold("good", 1, 1)
    clock.now += 2
    assert sorted(tracker.expire()) == ["bad", "good"]
    assert sorted(calls) == ["bad", "good"]


def test_free_fn_may_reenter_tracker():
    tracker = None
    seen = []

    def free_fn(request_id, reason):
        seen.append((request_id, len(tracker)))  # would deadlock if called under the lock

    tracker = HoldLedger(free_fn)
    tracker.hold("r", 1, 10)
    tracker.done("r", "a")
    assert seen == [("r", 0)]


def test_threads_race_done_expiry_abort_free_exactly_once():
    clock = FakeClock()
    tracker, freed = make(clock)
    n = 300
    for i in range(n):
        tracker.hold(f"r{i}", expected_done=2, ttl_s=1)
    barrier = threading.Barrier(5)

    def readers(name: str):
        barrier.wait()
        for i in range(n):
            if tracker.begin_read(f"r{i}", name):
                tracker.done(f"r{i}", name)
            else:
                tracker.done(f"r{i}", name)  # harmless on a freed request

    def expirer():
        barrier.wait()
        for _ in range(n):
            tracker.expire(now=clock.now + 2)

    def aborter():
        barrier.wait()
        for i in range(0, n, 3):
            tracker.abort(f"r{i}", force=True)

    threads = [threading.Thread(target=readers, args=(f"reader{k}",)) for k in range(2)]
    threads += [
        threading.Thread(target=expirer),
        threading.Thread(target=aborter),
        threading.Thread(target=expirer),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tracker.expire(now=clock.now + 2)
    counts = Counter(request_id for request_id, _ in freed)
    assert len(counts) == n
    assert set(counts.values()) == {1}
    assert len(tracker) == 0


ops = st.lists(
    st.tuples(
        st.sampled_from(["begin", "done", "renew", "abort", "expire", "tick"]),
        st.integers(min_value=0, max_value=2),  # reader
        st.integers(min_value=0, max_value=2),  # request
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, expected=st.integers(min_value=1, max_value=3))
def test_random_interleavings(ops, expected):
    """Invariants: freed at most once; never freed while a reader holds a current lease (not even
    by the DONE of the expected count: another reader may still read, issue 23 §4)."""
    clock = FakeClock()
    tracker, freed = make(clock)
    requests = [f"r{i}" for i in range(3)]
    for r in requests:
        tracker.hold(r, expected, ttl_s=5)
    active: dict[tuple[str, str], float] = {}  # (request, reader) -> lease deadline
    for op, reader_index, request_index in ops:
        r, reader = requests[request_index], f"reader{reader_index}"
        before = len(freed)
        if op == "begin":
            ok = tracker.begin_read(r, reader, lease_s=3)
            if ok:
                assert r not in {f for f, _ in freed}
                active[(r, reader)] = clock.now + 3
        elif op == "done":
            tracker.done(r, reader)
            active.pop((r, reader), None)
        elif op == "renew":
            if tracker.renew(r, 3, reader_id=reader):
                active[(r, reader)] = clock.now + 3
        elif op == "abort":
            tracker.abort(r)
        elif op == "expire":
            for freed_id in tracker.expire():
                current = [k for k, deadline in active.items() if k[0] == freed_id and deadline > clock.now]
                assert not current, f"{freed_id} expired under a current lease"
        else:
            clock.now += 2
        for freed_id, reason in freed[before:]:
            current = [k for k, deadline in active.items() if k[0] == freed_id and deadline > clock.now]
            assert not current, f"{freed_id} freed ({reason}) under a current lease"
    clock.now += 100
    tracker.expire()
    counts = Counter(f for f, _ in freed)
    assert sorted(counts) == requests
    assert set(counts.values()) == {1}


# ---- the readers' messages, one ledger call each (issue 43) -----------------------------------------

def _held(clock: FakeClock | None = None, digest: str | None = "pd"):
    from kv_mooncake.hold.ledger import HeldBlocks

    ledger, freed = make(clock)
    ledger.hold("r", 1, 10.0, HeldBlocks(2, frozenset({4, 5}), None, digest))
    return ledger, freed


def _start(ledger, reader="a", blocks=(4, 5), digest="pd", expected=1):
    return ledger.start_read("r", reader, expected_readers=expected, block_ids=blocks, prompt_digest=digest,
                             lease_s=3.0)


def test_start_read_grants_held_blocks_for_the_held_prompt_only():
    from kv_mooncake.hold.ledger import NotHeld, ReadGranted, ReadRefused

    clock = FakeClock()
    ledger, _ = _held(clock)
    clock.now += 2.0
    granted = _start(ledger)
    assert isinstance(granted, ReadGranted) and granted.held_for_s == 2.0 and granted.blocks.block_ids == {4, 5}
    other = _start(ledger, reader="b", blocks=(4, 6))
    assert isinstance(other, ReadRefused) and "block ids [6] not held for this request" in other.reason
    none = _start(ledger, reader="b", blocks=())
    assert isinstance(none, ReadRefused) and "no block ids" in none.reason
    forged = _start(ledger, reader="b", digest="other")
    assert isinstance(forged, ReadRefused) and "'other'" in forged.reason and "'pd'" not in forged.reason
    missing = _start(ledger, reader="b", digest="")
    assert isinstance(missing, ReadRefused) and "'missing'" in missing.reason
    assert ledger.counts()["active_reads"] == 1  # refused readers took no lease
    unchecked, _ = _held(digest=None)
    assert isinstance(_start(unchecked, digest="any"), ReadGranted)  # a hold without a digest checks none
    assert _start(make()[0]) == NotHeld(None)  # not held yet: the reader may retry


def test_messages_about_a_freed_request_are_told_why():
    from kv_mooncake.hold.ledger import NotHeld

    ledger, freed = _held()
    ledger.free_now("r")
    assert freed == [("r", "aborted")]
    assert _start(ledger) == NotHeld("aborted")
    assert ledger.renew_read("r", "a", 3.0) == NotHeld("aborted")
    assert ledger.keep_hold("r", 3.0, 10.0) == NotHeld("aborted")
    assert ledger.finish_read("r", "a", 1) is False
    assert ledger.freed_reason("r") == "aborted" and not ledger._overtaken


def test_renew_and_keep_alive_answer_none_while_held():
    from kv_mooncake.hold.ledger import NotHeld

    ledger, _ = _held()
    assert ledger.renew_read("r", "a", 3.0) == NotHeld(None)  # no lease to renew yet
    _start(ledger)
    assert ledger.renew_read("r", "a", 3.0) is None
    assert ledger.keep_hold("r", 3.0, 10.0) is None


def test_finish_read_confirms_a_lease_that_held_and_repeats_the_answer():
    ledger, freed = _held()
    _start(ledger, expected=2)
    _start(ledger, reader="b", expected=2)
    assert ledger.finish_read("r", "a", 2) is True
    assert freed == []  # b still reads
    assert ledger.finish_read("r", "a", 2) is True  # a repeated DONE: the same answer
    assert ledger.finish_read("r", "b", 2) is True and freed == [("r", "done")]
    assert ledger.finish_read("r", "b", 2) is True  # after the free too
    assert ledger.finish_read("r", "c", 2) is False  # never took a lease


def test_a_done_and_a_free_now_before_the_hold_apply_when_it_comes():
    from kv_mooncake.hold.ledger import HeldBlocks

    ledger, freed = make()
    assert ledger.finish_read("r", "a", 2) is False  # before its hold: kept for it
    ledger.hold("r", 1, 10.0, HeldBlocks(1, frozenset({1})))
    assert freed == [] and ledger.held() == {"r"}  # one of the two announced readers is done
    assert ledger.finish_read("r", "a", 2) is False  # its lease was never in this hold
    ledger.free_now("s")
    ledger.hold("s", 1, 10.0)
    assert freed == [("s", "aborted")]
    ledger.finish_read("t", "a", 1)
    ledger.hold("t", 1, 10.0)
    assert freed[-1] == ("t", "done") and ledger.take_freed() == {"s", "t"}
    ledger.finish_read("t", "late", 1)
    assert not ledger._overtaken  # a DONE after the free is not kept for another hold


def test_free_now_waits_for_a_reader_under_a_current_lease():
    clock = FakeClock()
    ledger, freed = _held(clock)
    _start(ledger)
    ledger.free_now("r")
    assert freed == [] and ledger.keep_hold("r", 3.0, 10.0) is not None  # aborted: not kept alive
    assert ledger.finish_read("r", "a", 1) is True and freed == [("r", "aborted")]


def test_a_new_hold_forgets_the_confirmations_of_the_last():
    from kv_mooncake.hold.ledger import HeldBlocks

    ledger, _ = _held()
    _start(ledger, expected=2)
    assert ledger.finish_read("r", "a", 2) is True
    ledger.hold("r", 1, 10.0, HeldBlocks(1, frozenset({9})))  # held again, other blocks
    assert ledger.finish_read("r", "a", 2) is False


def test_the_first_announcement_of_readers_counts_whichever_message_brings_it():
    ledger, freed = _held()
    _start(ledger, expected=2)  # PullStarted announces two readers ...
    assert ledger.finish_read("r", "a", 1) is True and freed == []  # ... a later DONE changes nothing
    other, freed = _held()
    assert other.finish_read("r", "a", 2) is False and freed == []  # a DONE's announcement counts too
    ledger, freed = make()
    ledger.finish_read("r", "a", 2)  # before the hold: its announcement is the one that counts
    ledger.hold("r", 1, 10.0)
    _start(ledger, reader="b", expected=3, blocks=(), digest="")
    assert ledger.finish_read("r", "b", 3) is False and freed == [("r", "done")]


def test_a_hold_nobody_reads_that_the_decode_freed_first_is_aborted():
    ledger, freed = make()
    ledger.free_now("x")
    ledger.hold("x", 0, 10.0)
    assert freed == [("x", "aborted")]
    ledger.hold("y", 0, 10.0)
    assert freed[-1] == ("y", "done")


def test_what_outlives_a_hold_is_bounded_oldest_first():
    from kv_mooncake.hold.ledger import RECENT

    ledger, _ = make()
    for i in range(RECENT + 1):
        ledger.free_now(f"o{i}")
        ledger.hold(f"f{i}", 0, 10.0)
    assert len(ledger._overtaken) == RECENT == 4096 and "o0" not in ledger._overtaken and f"o{RECENT}" in ledger._overtaken
    assert len(ledger._recently_freed) == RECENT and ledger.freed_reason("f0") is None
    assert ledger.freed_reason(f"f{RECENT}") == "done"
    ledger, _ = make()
    for i in range(RECENT + 1):
        ledger.hold(f"c{i}", 2, 10.0)
        ledger.begin_read(f"c{i}", "a", 3.0)
        assert ledger.finish_read(f"c{i}", "a", 2) is True
    assert len(ledger._confirmed) == RECENT and "c0" not in ledger._confirmed and f"c{RECENT}" in ledger._confirmed


def test_a_refusal_names_at_most_eight_block_ids():
    ledger, _ = _held()
    nine = _start(ledger, blocks=range(100, 109))
    assert "block ids [100, 101, 102, 103, 104, 105, 106, 107]... not held" in nine.reason
    eight = _start(ledger, blocks=range(100, 108))
    assert "block ids [100, 101, 102, 103, 104, 105, 106, 107] not held" in eight.reason
