from __future__ import annotations

import functools
import threading

from hypothesis import given
from hypothesis import strategies as st
from kv_common.breaker import Breaker, KeyedBreaker
from kv_common.retry import Backoff


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_threshold_failures_in_a_row():
    clock = Clock()
    b = Breaker(threshold=3, cooldown=Backoff(10.0, factor=1.0), clock=clock)
    assert not b.failure() and not b.failure()
    assert b.allow() and b.state == "closed" and b.failures == 2
    assert not b.success()  # closed already
    assert b.failures == 0
    assert [b.failure() for _ in range(3)] == [False, False, True]
    assert b.state == "open" and b.cooling_down and not b.allow()
    assert not b.failure()  # a call started before it opened: counted, nothing else
    assert b.failures == 4
    clock.now = 9.99
    assert not b.allow()
    clock.now = 10.0  # the cool-down is measured from the opening, not from the late failure
    assert not b.cooling_down and b.state == "open"  # as last recorded, until someone asks
    assert b.allow() and b.state == "half_open"


def test_one_probe_at_a_time():
    clock = Clock()
    b = Breaker(cooldown=Backoff(1.0, factor=2.0, max_s=3.0), clock=clock)
    assert b.failure()
    clock.now = 1.0
    assert b.allow()  # the probe
    assert not b.allow() and not b.cooling_down  # the others wait for it, they do not give up
    assert b.failure()  # the probe failed: open again, for longer
    clock.now = 2.9
    assert not b.allow()
    clock.now = 3.0
    assert b.allow() and b.failure()
    clock.now = 5.9
    assert not b.allow()
    clock.now = 6.0  # capped at 3 s
    assert b.allow()
    assert b.success() and b.state == "closed"
    assert b.failure()  # the schedule starts over after a success
    clock.now = 7.0
    assert b.allow()


def test_half_open_lets_all_through_and_one_failure_reopens():
    clock = Clock()
    b = Breaker(threshold=3, cooldown=Backoff(5.0, factor=1.0), half_open="all", clock=clock)
    for _ in range(3):
        b.failure()
    clock.now = 5.0
    assert b.allow() and b.allow() and b.state == "half_open"
    assert b.failure()  # one more failure: open again (the count was kept)
    assert not b.allow()
    clock.now = 10.0
    assert b.failure()  # cool-down over, nobody asked yet: a failure opens it again at once
    assert b.cooling_down


def test_failure_while_open_reopens_for_the_next_cooldown():
    clock = Clock()
    b = Breaker(cooldown=Backoff(1.0, factor=2.0, max_s=3.0), failure_while_open="reopen", clock=clock)
    assert b.failure()
    clock.now = 0.5
    assert b.failure()  # still cooling down: open again, from now, for the next cool-down (2 s)
    assert b.failures == 2
    clock.now = 2.49
    assert not b.allow()
    clock.now = 2.5
    assert b.allow() and b.state == "half_open"
    assert b.failure()  # the probe failed: capped at 3 s
    clock.now = 3.0
    assert b.failure()  # and a late one restarts it, still capped
    clock.now = 5.99
    assert not b.allow()
    clock.now = 6.0
    assert b.allow() and b.success() and b.state == "closed"
    assert b.failure()  # the schedule starts over after a success
    clock.now = 7.0
    assert b.allow()


def test_without_cooldown_open_until_a_success():
    clock = Clock()
    b = Breaker(threshold=1, cooldown=None, clock=clock)
    assert b.failure() and not b.failure()
    clock.now = 1e9
    assert not b.allow() and b.cooling_down
    assert b.success() and not b.success()


def test_threshold_below_one_never_opens():
    b = Breaker(threshold=0, cooldown=Backoff(1.0))
    assert not any(b.failure() for _ in range(100))
    assert b.allow() and b.failures == 100


def test_keyed_breakers_are_independent_and_forgotten_on_success():
    clock = Clock()
    peers: KeyedBreaker[str] = KeyedBreaker(functools.partial(Breaker, cooldown=Backoff(1.0), clock=clock))
    assert peers.state("a") == "closed" and peers.allow("a") and len(peers) == 0
    assert peers.failure("a")
    assert peers.state("a") == "open" and peers.cooling_down("a") and not peers.allow("a")
    assert peers.allow("b") and peers.failures("b") == 0 and peers.failures("a") == 1
    clock.now = 1.0
    assert peers.allow("a") and peers.state("a") == "half_open" and not peers.allow("a")
    assert peers.success("a") and len(peers) == 0 and not peers.success("a")
    peers.failure("b")
    peers.forget("b")
    assert peers.state("b") == "closed" and len(peers) == 0


def test_keyed_breaker_one_probe_across_threads():
    clock = Clock()
    peers: KeyedBreaker[str] = KeyedBreaker(functools.partial(Breaker, clock=clock))
    peers.failure("p")
    clock.now = 10.0
    allowed: list[bool] = []
    threads = [threading.Thread(target=lambda: allowed.append(peers.allow("p"))) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert allowed.count(True) == 1


events = st.lists(st.sampled_from(["allow", "failure", "success", "tick"]), max_size=60)


@given(threshold=st.integers(min_value=1, max_value=4), half_open=st.sampled_from(["one", "all"]), events=events)
def test_state_machine_invariants(threshold, half_open, events):
    clock = Clock()
    b = Breaker(threshold, Backoff(1.0, 2.0, 4.0), half_open=half_open, clock=clock)
    for event in events:
        before, cooling = b.state, b.cooling_down
        if event == "tick":
            clock.now += 1.0
        elif event == "success":
            b.success()
            assert b.state == "closed" and b.failures == 0
        elif event == "failure":
            opened = b.failure()
            assert not opened or b.state == "open"
            if cooling:
                assert not opened  # late failures only count
            if before == "half_open":
                assert opened and b.state == "open"
            if before == "closed":
                assert opened == (b.failures >= threshold)
        else:
            allowed = b.allow()
            assert allowed == (before == "closed" or (before == "half_open" and half_open == "all")
                               or (before == "open" and b.state == "half_open"))
        assert b.state != "closed" or b.failures < threshold
        assert not b.cooling_down or not b.allow()
