"""Read first, confirm after: when a read made alongside its PullStarted counts (pure), and how long
the prefill says it has held a request's blocks."""

from __future__ import annotations

from kv_mooncake.hold.ledger import HeldBlocks, HoldLedger
from kv_mooncake.pull.lease import lease_covers_read


def test_a_read_counts_only_if_the_blocks_were_held_before_it_began():
    # The Ack arrived at t=10.0 saying the blocks had been held 0.5 s: held since 9.5 at the latest.
    assert lease_covers_read(read_started=9.6, answered_at=10.0, held_for_s=0.5)
    assert lease_covers_read(read_started=9.5, answered_at=10.0, held_for_s=0.5)
    assert not lease_covers_read(read_started=9.4, answered_at=10.0, held_for_s=0.5)
    assert not lease_covers_read(read_started=9.9, answered_at=10.0, held_for_s=-1.0)  # unknown: an older peer


def test_a_read_begun_after_the_ack_is_under_the_lease():
    assert lease_covers_read(read_started=10.0, answered_at=10.0, held_for_s=-1.0)
    assert lease_covers_read(read_started=11.0, answered_at=10.0, held_for_s=0.0)


def test_held_for_restarts_when_a_re_hold_changes_the_blocks():
    now = [100.0]
    tracker = HoldLedger(lambda *_: None, clock=lambda: now[0])
    assert tracker.held_for("r") is None
    tracker.hold("r", 1, 60.0, HeldBlocks(1, frozenset({5})))
    now[0] = 102.0
    assert tracker.held_for("r") == 2.0
    tracker.hold("r", 1, 60.0, HeldBlocks(1, frozenset({5})))  # held again, same blocks
    now[0] = 103.0
    assert tracker.held_for("r") == 3.0
    tracker.hold("r", 1, 60.0, HeldBlocks(1, frozenset({6})))  # other blocks now
    now[0] = 104.0
    assert tracker.held_for("r") == 1.0
    tracker.abort("r", force=True)
    assert tracker.held_for("r") is None
