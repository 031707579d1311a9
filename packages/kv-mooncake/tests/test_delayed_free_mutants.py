"""Every limit of the hold/free tracker at its boundary: when blocks go, and when they must stay
(a second hold, a renewed lease, a keep-alive up to its cap). Written against the survivors of the
mutation run (docs/mutation-report.md)."""

from __future__ import annotations

import dataclasses

import pytest
from kv_mooncake.hold.ledger import HeldBlocks, HoldLedger

T0 = 1000.0


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def freed():
    return []


@pytest.fixture
def tracker(clock, freed):
    return HoldLedger(lambda rid, reason: freed.append((rid, reason)), clock=clock)


@pytest.mark.parametrize("expected", [0, -1])
def test_a_hold_nobody_will_read_is_freed_at_once(tracker, freed, expected):
    tracker.hold("r", expected, ttl_s=10)
    assert freed == [("r", "done")] and "r" not in tracker


def test_one_reader_is_held_until_its_done(tracker, freed):
    tracker.hold("r", 1, ttl_s=10)
    assert "r" in tracker and len(tracker) == 1 and freed == []
    assert tracker.done("r", "a") is True
    assert freed == [("r", "done")] and len(tracker) == 0


def test_the_deadline_is_the_hold_time_plus_ttl(tracker, freed):
    tracker.hold("r", 1, ttl_s=10)
    assert tracker.expire(T0 + 9.999) == []
    assert tracker.expire(T0 + 10) == ["r"]
    assert freed == [("r", "expired")]


def test_expire_reads_the_clock_when_not_told_the_time(tracker, clock, freed):
    tracker.hold("r", 1, ttl_s=10)
    clock.now = T0 + 10
    assert tracker.expire() == ["r"]


def test_a_request_held_twice_keeps_the_larger_reader_count(tracker, freed):
    tracker.hold("r", 1, ttl_s=10)
    tracker.hold("r", 3, ttl_s=10)
    tracker.hold("r", 2, ttl_s=10)
    assert [tracker.done("r", reader) for reader in "abc"] == [False, False, True]
    assert freed == [("r", "done")]


def test_a_request_held_twice_keeps_the_later_deadline(tracker, clock, freed):
    tracker.hold("r", 1, ttl_s=10)
    clock.now = T0 + 5
    tracker.hold("r", 1, ttl_s=10)  # deadline T0 + 15
    tracker.hold("r", 1, ttl_s=1)  # a shorter hold does not shorten it
    assert tracker.expire(T0 + 14.9) == []
    assert tracker.expire(T0 + 15) == ["r"]


def test_a_second_hold_keeps_the_readers_already_done(tracker, freed):
    tracker.hold("r", 2, ttl_s=10)
    tracker.done("r", "a")
    tracker.hold("r", 2, ttl_s=10)
    assert tracker.done("r", "b") is True


def test_held_blocks_are_what_the_last_hold_gave(tracker):
    assert tracker.blocks("r") is None
    tracker.hold("r", 1, ttl_s=10)
    assert tracker.blocks("r").num_blocks == 0 and tracker.blocks("r").block_ids == frozenset()
    assert tracker.blocks("r").digests is None
    first = HeldBlocks(num_blocks=2, block_ids=frozenset({4, 5}))
    tracker.hold("r", 1, ttl_s=10, blocks=first)
    assert tracker.blocks("r") is first
    tracker.hold("r", 1, ttl_s=10)  # no blocks given: the held ones stay
    assert tracker.blocks("r") is first
    tracker.done("r", "a")
    assert tracker.blocks("r") is None


def test_held_blocks_cannot_change_under_a_reader():
    blocks = HeldBlocks(num_blocks=1, block_ids=frozenset({1}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        blocks.num_blocks = 2  # type: ignore[misc]


def test_counts_report_blocks_requests_and_reads_in_flight(tracker):
    assert tracker.counts() == {"held_blocks": 0, "held_requests": 0, "active_reads": 0}
    tracker.hold("r", 2, ttl_s=10, blocks=HeldBlocks(num_blocks=3))
    tracker.hold("s", 2, ttl_s=10, blocks=HeldBlocks(num_blocks=4))
    tracker.begin_read("r", "a")
    tracker.begin_read("r", "b")
    tracker.begin_read("s", "a")
    assert tracker.counts() == {"held_blocks": 7, "held_requests": 2, "active_reads": 3}
    tracker.done("r", "a")
    assert tracker.counts() == {"held_blocks": 7, "held_requests": 2, "active_reads": 2}
    assert tracker.held() == {"r", "s"}


def test_the_first_announced_reader_count_counts_and_only_raises(tracker, freed):
    tracker.expect_readers("unknown", 3)  # nothing held: nothing happens
    tracker.hold("r", 1, ttl_s=10)
    tracker.expect_readers("r", 3)
    tracker.expect_readers("r", 5)  # later announcements change nothing
    assert [tracker.done("r", reader) for reader in "abc"] == [False, False, True]
    tracker.hold("s", 2, ttl_s=10)
    tracker.expect_readers("s", 1)  # never lowers what the producer expects
    assert tracker.done("s", "a") is False


def test_begin_read_lease_defaults_to_the_hold_ttl(tracker, clock, freed):
    tracker.hold("r", 1, ttl_s=10)
    clock.now = T0 + 5
    assert tracker.begin_read("r", "a") is True  # lease until T0 + 15
    assert tracker.expire(T0 + 14.9) == []
    assert tracker.expire(T0 + 15) == ["r"]


def test_a_short_lease_does_not_hold_past_the_deadline(tracker, clock):
    tracker.hold("r", 1, ttl_s=10)
    clock.now = T0 + 5
    assert tracker.begin_read("r", "a", lease_s=2) is True  # lease until T0 + 7
    assert tracker.expire(T0 + 10) == ["r"]


def test_begin_read_is_refused_when_the_blocks_are_gone_or_going(tracker, clock):
    assert tracker.begin_read("unknown", "a") is False
    tracker.hold("r", 2, ttl_s=10)
    tracker.done("r", "a")
    assert tracker.begin_read("r", "a") is False  # this reader is done already
    assert tracker.begin_read("r", "b") is True
    tracker.hold("s", 1, ttl_s=10)
    clock.now = T0 + 10  # at the deadline, no lease: expired
    assert tracker.begin_read("s", "a") is False


def test_begin_read_past_the_deadline_is_allowed_while_another_lease_is_current(tracker, clock):
    tracker.hold("r", 2, ttl_s=10)
    assert tracker.begin_read("r", "a", lease_s=20)
    clock.now = T0 + 15
    assert tracker.begin_read("r", "b") is True


def test_begin_read_is_refused_after_an_abort_that_waits_for_a_reader(tracker):
    tracker.hold("r", 2, ttl_s=10)
    tracker.begin_read("r", "a")
    assert tracker.abort("r") is False
    assert tracker.begin_read("r", "b") is False
    assert tracker.keep_alive("r", 5, 60) is False


def test_a_reader_renewing_its_lease_keeps_the_blocks_past_the_old_deadline(tracker, clock, freed):
    tracker.hold("r", 1, ttl_s=10)
    assert tracker.begin_read("r", "a", lease_s=5)  # lease until T0 + 5
    clock.now = T0 + 4
    assert tracker.renew("r", 20, reader_id="a") is True  # lease until T0 + 24
    assert tracker.renew("r", 1, reader_id="a") is True  # a shorter renewal does not shorten it
    assert tracker.expire(T0 + 23.9) == []
    assert freed == []
    assert tracker.expire(T0 + 24) == ["r"]


def test_renew_is_refused_for_a_reader_without_a_lease_or_a_request_not_held(tracker):
    assert tracker.renew("unknown", 10) is False
    assert tracker.renew("unknown", 10, reader_id="a") is False
    tracker.hold("r", 1, ttl_s=10)
    assert tracker.renew("r", 10, reader_id="a") is False


def test_renewing_the_hold_moves_its_deadline_and_every_lease(tracker, clock):
    tracker.hold("r", 2, ttl_s=10)
    tracker.begin_read("r", "a", lease_s=1)
    clock.now = T0 + 5
    assert tracker.renew("r", 30) is True  # deadline and lease: T0 + 35
    assert tracker.renew("r", 1) is True  # never shortens
    assert tracker.expire(T0 + 34.9) == []
    assert tracker.expire(T0 + 35) == ["r"]


def test_renewing_the_hold_keeps_a_longer_lease(tracker, clock):
    tracker.hold("r", 2, ttl_s=10)
    tracker.begin_read("r", "a", lease_s=100)
    tracker.renew("r", 1)
    assert tracker.expire(T0 + 50) == []


def test_keep_alive_moves_the_deadline_up_to_its_cap(tracker, clock):
    tracker.hold("r", 1, ttl_s=10)
    clock.now = T0 + 8
    assert tracker.keep_alive("r", extend_s=4, limit_s=3) is True  # T0 + 12, under the cap T0 + 13
    assert tracker.expire(T0 + 11.9) == []
    assert tracker.keep_alive("r", extend_s=100, limit_s=3) is True  # capped: T0 + 10 + 3
    assert tracker.expire(T0 + 12.9) == []
    assert tracker.expire(T0 + 13) == ["r"]


def test_keep_alive_never_shortens_a_hold(tracker):
    tracker.hold("r", 1, ttl_s=100)
    assert tracker.keep_alive("r", extend_s=1, limit_s=0) is True
    assert tracker.expire(T0 + 99) == []


def test_keep_alive_does_not_revive_an_expired_or_unknown_hold(tracker, clock):
    assert tracker.keep_alive("unknown", 5, 60) is False
    tracker.hold("r", 1, ttl_s=10)
    clock.now = T0 + 10
    assert tracker.keep_alive("r", 5, 60) is False
    assert tracker.expire() == ["r"]


def test_keep_alive_past_the_deadline_while_a_lease_is_current(tracker, clock):
    tracker.hold("r", 1, ttl_s=10)
    tracker.begin_read("r", "a", lease_s=20)
    clock.now = T0 + 15
    assert tracker.keep_alive("r", 5, 60) is True


def test_done_with_readers_missing_keeps_the_blocks(tracker, freed):
    tracker.hold("r", 3, ttl_s=10)
    assert tracker.done("r", "a") is False
    assert tracker.done("r", "b") is False
    assert freed == [] and "r" in tracker


def test_abort_without_reads_frees_at_once(tracker, freed):
    assert tracker.abort("unknown") is False
    tracker.hold("r", 1, ttl_s=10)
    assert tracker.abort("r") is True
    assert freed == [("r", "aborted")] and "r" not in tracker


def test_an_aborted_hold_is_freed_by_its_last_reader(tracker, freed):
    tracker.hold("r", 3, ttl_s=10)
    tracker.begin_read("r", "a")
    tracker.begin_read("r", "b")
    assert tracker.abort("r") is False
    assert tracker.done("r", "a") is False  # b still reads
    assert freed == []
    assert tracker.done("r", "b") is True
    assert freed == [("r", "aborted")]


def test_an_aborted_hold_waits_for_a_current_lease_only(tracker, clock, freed):
    tracker.hold("r", 1, ttl_s=10)
    tracker.begin_read("r", "a", lease_s=5)
    assert tracker.abort("r") is False
    assert tracker.expire(T0 + 4) == []
    assert tracker.expire(T0 + 5) == ["r"]  # the lease ran out: freed as aborted
    assert freed == [("r", "aborted")]


def test_abort_after_the_lease_ran_out_frees(tracker, clock, freed):
    tracker.hold("r", 1, ttl_s=10)
    tracker.begin_read("r", "a", lease_s=5)
    clock.now = T0 + 5
    assert tracker.abort("r") is True
    assert freed == [("r", "aborted")]


def test_force_abort_frees_under_a_current_lease(tracker, freed):
    tracker.hold("r", 1, ttl_s=10)
    tracker.begin_read("r", "a")
    assert tracker.abort("r", force=True) is True
    assert freed == [("r", "aborted")]


def test_expire_frees_only_what_is_due(tracker, clock, freed):
    tracker.hold("a", 1, ttl_s=5)
    tracker.hold("b", 1, ttl_s=50)
    tracker.hold("c", 1, ttl_s=5)
    tracker.begin_read("c", "x", lease_s=30)
    assert tracker.expire(T0 + 10) == ["a"]
    assert tracker.held() == {"b", "c"}
    assert freed == [("a", "expired")]



def test_only_an_expiry_is_logged_as_a_warning(tracker, caplog):
    tracker.hold("gone", 1, ttl_s=1)
    tracker.hold("read", 1, ttl_s=10)
    tracker.hold("stopped", 1, ttl_s=10)
    with caplog.at_level("WARNING", logger="kv_mooncake.hold.ledger"):
        tracker.expire(T0 + 1)
        tracker.done("read", "a")
        tracker.abort("stopped")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "gone" in warnings[0] and "expired" in warnings[0]


def test_renewing_the_hold_renews_the_leases_an_abort_waits_for(tracker, clock, freed):
    tracker.hold("r", 2, ttl_s=10)
    tracker.begin_read("r", "a", lease_s=1)
    clock.now = T0 + 5
    tracker.renew("r", 30)  # the reader's lease too: until T0 + 35
    clock.now = T0 + 34
    assert tracker.abort("r") is False  # the reader is still in flight
    assert freed == []
    clock.now = T0 + 35
    assert tracker.abort("r") is True


def test_renewing_a_hold_without_readers_moves_its_deadline(tracker, clock):
    tracker.hold("r", 1, ttl_s=10)
    clock.now = T0 + 5
    assert tracker.renew("r", 30) is True  # until T0 + 35
    assert tracker.renew("r", 1) is True  # never shortens
    assert tracker.expire(T0 + 34.9) == []
    assert tracker.expire(T0 + 35) == ["r"]


def test_a_read_of_a_request_not_held_did_not_hold_throughout(tracker):
    assert tracker.end_read("never-held", "a") == (False, False)


def test_end_read_says_whether_the_readers_lease_held(tracker, freed):
    tracker.hold("r", 2, ttl_s=10)
    assert tracker.begin_read("r", "a", lease_s=5)
    assert tracker.end_read("r", "a") == (True, False)  # began under a lease: read throughout
    assert tracker.end_read("r", "b") == (False, True)  # never began: nothing vouches for its read
    assert freed == [("r", "done")]


def test_held_again_with_other_blocks_voids_the_reads_in_flight(tracker):
    tracker.hold("r", 2, ttl_s=10, blocks=HeldBlocks(2, frozenset({1, 2})))
    assert tracker.begin_read("r", "a", lease_s=5) and tracker.begin_read("r", "b", lease_s=5)
    tracker.hold("r", 2, ttl_s=10, blocks=HeldBlocks(2, frozenset({1, 2})))  # the same blocks
    assert tracker.end_read("r", "a").held_throughout is True
    tracker.hold("r", 2, ttl_s=10, blocks=HeldBlocks(2, frozenset({3, 4})))  # other blocks now
    assert tracker.end_read("r", "b").held_throughout is False
