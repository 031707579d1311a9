"""An idle engine step waits for the connector's news, at most its bound, and never misses news."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from kv_common.idle_step import IdleStepWait, idle_step


def test_only_a_step_without_tokens_is_idle():
    assert idle_step(SimpleNamespace(total_num_scheduled_tokens=0))
    assert not idle_step(SimpleNamespace(total_num_scheduled_tokens=3))
    assert not idle_step(object())  # an output we cannot read is never taken for idle


def _timed_report(wait: IdleStepWait, busy: bool = True) -> float:
    t0 = time.monotonic()
    wait.before_report(lambda: busy)
    return time.monotonic() - t0


def test_an_idle_step_waits_its_bound_and_a_busy_one_never_waits():
    wait = IdleStepWait(50.0)
    wait.begin_step(False)
    assert _timed_report(wait) < 0.02
    wait.begin_step(True)
    assert 0.045 <= _timed_report(wait) < 1.0
    off = IdleStepWait(0.0)  # 0: the wait is off
    off.begin_step(True)
    assert _timed_report(off) < 0.02


def test_an_idle_step_with_nothing_in_flight_or_no_metadata_never_waits():
    wait = IdleStepWait(50.0)
    wait.begin_step(True)
    assert _timed_report(wait, busy=False) < 0.02  # nothing to wait for
    wait.begin_step(True)
    wait.before_report()
    assert _timed_report(wait) < 0.02  # the next step's metadata never came: not known to be idle


def test_news_ends_the_wait_at_once_and_is_never_slept_through():
    wait = IdleStepWait(MAX := 100.0)
    threading.Timer(0.01, wait.notify).start()
    wait.begin_step(True)
    assert _timed_report(wait) < MAX / 1000 * 0.8
    wait.notify()  # news while the last report was being collected: the next step does not wait
    wait.begin_step(True)
    assert _timed_report(wait) < 0.02


@pytest.mark.parametrize("bad", [-1.0, 101.0])
def test_the_bound_is_checked(bad):
    with pytest.raises(ValueError, match="idle_step_wait_ms"):
        IdleStepWait(bad)


def test_the_busy_check_is_asked_only_in_idle_steps():
    """``before_report(busy)`` takes the check itself: the steps that run tokens (nearly all) never
    pay for it, and an idle step with nothing in flight does not wait."""
    asked = []

    def in_flight() -> bool:
        asked.append(1)
        return False

    wait = IdleStepWait(50.0)
    wait.begin_step(False)
    wait.before_report(in_flight)
    assert not asked
    wait.begin_step(True)
    t0 = time.monotonic()
    wait.before_report(in_flight)
    assert asked == [1] and time.monotonic() - t0 < 0.02
