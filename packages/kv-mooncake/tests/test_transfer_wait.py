"""Waits for the TransferEngine that sleep instead of spinning: the estimate they sleep by."""

from __future__ import annotations

import time

import pytest
from kv_mooncake.engine.pacing import (
    FIRST_GUESS_BYTES_PER_S,
    MAX_BYTES_PER_S,
    MIN_BYTES_PER_S,
    ThroughputEstimate,
    sleep_until_expected,
)

MIB = 1 << 20


def test_first_guess_then_learns_from_finished_reads():
    est = ThroughputEstimate()
    assert est.bytes_per_s == FIRST_GUESS_BYTES_PER_S
    for i in range(30):  # 64 MiB in 0.1 s, again and again: the estimate converges to 0.67 GB/s
        t = 10.0 * i
        est.begin(64 * MIB, t)
        est.end(64 * MIB, t + 0.1)
    assert est.bytes_per_s == pytest.approx(64 * MIB / 0.1, rel=0.01)
    assert est.begin(64 * MIB, 1000.0) == pytest.approx(1000.1, rel=1e-4)


def test_reads_in_flight_queue_behind_each_other_and_do_not_read_as_a_slow_link():
    est = ThroughputEstimate(1e9)
    first = est.begin(100_000_000, 0.0)
    second = est.begin(100_000_000, 0.0)  # submitted together: expected after the first
    assert first == pytest.approx(0.1) and second == pytest.approx(0.2)
    est.end(100_000_000, 0.1)
    est.end(100_000_000, 0.2)  # the link's busy period: 200 MB in 0.2 s, not 100 MB in 0.2 s
    assert est.bytes_per_s == pytest.approx(1e9)
    assert est.begin(100_000_000, 5.0) == pytest.approx(5.1)  # nothing in flight: no queue


def test_estimate_is_bounded_and_failures_or_tiny_reads_teach_nothing():
    est = ThroughputEstimate(1e9)
    est.begin(64 * MIB, 0.0)
    est.end(64 * MIB, 30.0, ok=False)  # a failed (stalled) read
    est.begin(4096, 40.0)
    est.end(4096, 40.5)  # all fixed cost
    assert est.bytes_per_s == 1e9
    for i in range(50):
        est.begin(64 * MIB, 100.0 * i)
        est.end(64 * MIB, 100.0 * i + 60.0)  # a frozen peer: 1 MB/s
    assert est.bytes_per_s == pytest.approx(MIN_BYTES_PER_S, rel=1e-3)
    for i in range(50):
        est.begin(64 * MIB, 10_000.0 + i)
        est.end(64 * MIB, 10_000.0 + i + 1e-9)
    assert est.bytes_per_s == pytest.approx(MAX_BYTES_PER_S, rel=1e-3)


def test_sleep_keeps_the_deadline():
    now = time.monotonic()
    t0 = time.monotonic()
    sleep_until_expected(now + 10.0, now, deadline=now + 0.05)
    assert time.monotonic() - t0 < 1.0
    assert sleep_until_expected(now - 1.0, now - 2.0, None) == 0.0  # already due: no sleep


def test_a_read_found_done_at_once_means_we_overslept():
    est = ThroughputEstimate(1e9)
    est.begin(100_000_000, 0.0)
    est.end(100_000_000, 0.1, overslept=True)  # its time is unknown, but shorter
    assert est.bytes_per_s == pytest.approx(2e9)


def test_reads_served_together_do_not_read_as_a_slow_link():
    """Four pulls' reads to one peer, submitted together and served interleaved (the engine shares
    the link between them): they all finish near the end, 0.4 s for 400 MB. The link moved 1 GB/s;
    the first to finish, alone, would read as 0.25 GB/s and the next ones as near infinite."""
    est = ThroughputEstimate(1e9)
    for rnd in range(5):
        t = 10.0 * rnd
        for _ in range(4):
            est.begin(100_000_000, t)
        for k in range(4):
            est.end(100_000_000, t + 0.397 + 0.001 * k)
        assert est.bytes_per_s == pytest.approx(1e9, rel=0.02), rnd


def test_a_peer_never_idle_is_still_learnt():
    """Reads back to back, one always in flight: the estimate follows the link (0.5 GB/s here)
    without waiting for the peer to go idle."""
    est = ThroughputEstimate(1e9)
    est.begin(50_000_000, 0.0)
    for i in range(1, 200):
        est.begin(50_000_000, 0.1 * i - 0.05)  # the next one goes before the last one is done
        est.end(50_000_000, 0.1 * i)
    assert est.bytes_per_s == pytest.approx(0.5e9, rel=0.05)


def test_many_small_reads_in_a_period_teach_nothing():
    """Reads under MIN_SAMPLE_BYTES are all fixed cost, alone or several in a busy period: eight
    reads of 16 KiB served together in 8 ms would read as a 16 MB/s link and make every later read
    sleep far too long."""
    est = ThroughputEstimate(1e9)
    for _ in range(8):
        est.begin(16 << 10, 0.0)
    for k in range(8):
        est.end(16 << 10, 0.001 * (k + 1))
    assert est.bytes_per_s == 1e9
