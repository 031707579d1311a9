"""The CI rule: a skipped test fails a strict run unless the session allows its reason."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import pytest

def test_runs():
    assert True

def test_needs_engine():
    pytest.importorskip("no_such_engine_module_xyz")

@pytest.mark.skip(reason="UCM is Python 3.12 only")
def test_platform_skip():
    pass

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False
"""


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, **env: str) -> pytest.RunResult:
    for key in ("KV_STRICT_SKIPS", "KV_ALLOWED_SKIPS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    pytester.makepyfile(test_sample=TESTS)
    return pytester.runpytest_subprocess("-p", "kv_common.testing.strict_skips")


def test_off_by_default_skips_stay_skips(pytester, monkeypatch):
    result = _run(pytester, monkeypatch)
    result.assert_outcomes(passed=1, skipped=2, xfailed=1)


def test_strict_run_fails_a_skip(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, KV_STRICT_SKIPS="1")
    # A skip marker acts at set-up, so that one counts as an error: either way the run fails.
    result.assert_outcomes(passed=1, failed=1, errors=1, xfailed=1)
    result.stdout.fnmatch_lines(["*skipped in a strict run*no_such_engine_module_xyz*"])


def test_allowed_reason_stays_a_skip(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, KV_STRICT_SKIPS="1", KV_ALLOWED_SKIPS="Python 3.12 only")
    result.assert_outcomes(passed=1, failed=1, skipped=1, xfailed=1)


def test_module_level_skip_fails_a_strict_run(pytester, monkeypatch):
    monkeypatch.setenv("KV_STRICT_SKIPS", "1")
    pytester.makepyfile(test_mod='import pytest\npytest.importorskip("no_such_engine_module_xyz")\n')
    result = pytester.runpytest_subprocess("-p", "kv_common.testing.strict_skips")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*module skipped in a strict run*"])
