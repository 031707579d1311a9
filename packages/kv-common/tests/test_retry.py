from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kv_common.retry import Backoff, Retry

seconds = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
factors = st.floats(min_value=1.0, max_value=10.0, allow_nan=False)


def test_backoff_doubles_up_to_its_cap():
    b = Backoff(0.05, factor=2.0, max_s=1.0)
    assert [b.nth(n) for n in range(0, 8)] == [0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_backoff_constant_and_huge_n():
    assert Backoff(3.0, factor=1.0).nth(10_000) == 3.0
    assert Backoff(1.0, factor=2.0, max_s=30.0).nth(10_000) == 30.0  # no OverflowError
    assert Backoff(1.0).nth(10_000) == math.inf
    assert Backoff(0.0).nth(10_000) == 0.0


@pytest.mark.parametrize("bad", [dict(first_s=-1.0), dict(first_s=1.0, factor=0.5), dict(first_s=1.0, max_s=-1.0),
                                 dict(first_s=math.nan)])
def test_backoff_refuses_nonsense(bad):
    with pytest.raises(ValueError):
        Backoff(**bad)


@given(first=seconds, factor=factors, cap=seconds, n=st.integers(min_value=1, max_value=5000))
def test_backoff_grows_and_stays_under_its_cap(first, factor, cap, n):
    b = Backoff(first, factor, cap)
    assert 0.0 <= b.nth(n) <= b.nth(n + 1) <= cap
    assert b.nth(1) == min(first, cap)


def test_retry_is_an_immutable_value():
    policy = Retry(total=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.total = 3  # type: ignore[misc]
    assert dataclasses.replace(policy, total=3) == Retry(total=3)
    assert hash(Retry(total=2)) == hash(policy)
    with pytest.raises(ValueError):
        Retry(total=0)
    with pytest.raises(ValueError):
        Retry(deadline_s=-1.0)


def test_attempt_limit():
    policy = Retry(total=2)
    assert policy.allows(0) and policy.allows(1) and not policy.allows(2)
    assert policy.pause(1) == 0.0  # no back-off by default
    assert Retry().allows(10**9)  # neither limit: forever


def test_deadline_counts_the_pause():
    policy = Retry(backoff=Backoff(0.5))
    assert policy.allows(5, deadline=10.0, now=9.0, pause=policy.pause(1))
    assert not policy.allows(5, deadline=10.0, now=9.5, pause=policy.pause(1))  # would wake at the deadline
    assert not policy.allows(5, deadline=10.0, now=10.0)
    assert policy.allows(5, deadline=10.0, now=9.999)


def test_both_limits_apply():
    policy = Retry(total=3)
    assert not policy.allows(3, deadline=100.0, now=0.0)
    assert not policy.allows(1, deadline=100.0, now=100.0)


def test_own_deadline():
    assert Retry(deadline_s=30.0).deadline(100.0) == 130.0
    assert Retry(deadline_s=0.0).deadline(100.0) == 100.0  # one try, never a second
    assert not Retry(deadline_s=0.0).allows(1, Retry(deadline_s=0.0).deadline(100.0), now=100.0)
    assert Retry().deadline(100.0) is None


def test_try_timeout_grows_and_is_clipped_to_the_time_left():
    policy = Retry(try_timeout=Backoff(1.0, factor=2.0))
    assert [policy.timeout(n) for n in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert policy.timeout(3, left=5.0) == 5.0
    assert policy.timeout(0, left=0.25) == 0.25
    assert Retry().timeout(3) is None
    assert Retry().timeout(3, left=2.0) == 2.0


@given(total=st.integers(min_value=1, max_value=50), tries=st.integers(min_value=0, max_value=100),
       now=seconds, deadline=st.none() | seconds, pause=seconds)
def test_allows_is_both_limits(total, tries, now, deadline, pause):
    policy = Retry(total=total)
    expected = tries < total and (deadline is None or now + pause < deadline)
    assert policy.allows(tries, deadline, now=now, pause=pause) is expected


@given(first=seconds, factor=factors, failures=st.integers(min_value=0, max_value=200), left=st.none() | seconds)
def test_timeout_never_exceeds_the_time_left(first, factor, failures, left):
    t = Retry(try_timeout=Backoff(first, factor)).timeout(failures, left)
    assert t is not None and t >= 0.0
    if left is not None:
        assert t <= left


def test_allows_reads_the_monotonic_clock_by_default(monkeypatch):
    import kv_common.retry as retry

    monkeypatch.setattr(retry.time, "monotonic", lambda: 50.0)
    assert Retry().allows(1, deadline=50.5)
    assert not Retry().allows(1, deadline=50.5, pause=1.0)
