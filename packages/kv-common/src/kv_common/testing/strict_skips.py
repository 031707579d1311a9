"""pytest plugin: in CI a skipped test is a failure, unless its reason is one the session allows.

A skip hides a test that no longer runs: a connector test that skips because vLLM is missing from
the venv looks green and tests nothing. Loaded with ``-p kv_common.testing.strict_skips``; it acts
only when ``KV_STRICT_SKIPS=1``. ``KV_ALLOWED_SKIPS`` is a regular expression: a skip whose reason
matches it stays a skip (e.g. "Python 3.12 only" in a 3.11 session: UCM has no 3.11 wheels).
"""

from __future__ import annotations

import os
import re

import pytest

# Skips that are right on every CPU machine: they guard code for hardware that is absent here, or
# check the behaviour without an engine where the engine is present.
ALWAYS_ALLOWED = r"NPU is present|accelerator present|checks the error without UCM"


def _allowed_pattern() -> re.Pattern[str]:
    extra = os.environ.get("KV_ALLOWED_SKIPS", "").strip()
    return re.compile(f"{ALWAYS_ALLOWED}|{extra}" if extra else ALWAYS_ALLOWED)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def strict_enabled() -> bool:
    return os.environ.get("KV_STRICT_SKIPS", "") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.skipped or not strict_enabled() or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if _allowed_pattern().search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped in a strict run (KV_STRICT_SKIPS=1): {reason}\n"
        "Install what the test needs in this session, or add the reason to KV_ALLOWED_SKIPS if the "
        "skip is right for this Python / machine."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    # A module-level importorskip skips the whole file at collection time.
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if not report.skipped or not strict_enabled():
        return
    reason = _skip_reason(report)  # type: ignore[arg-type]
    if _allowed_pattern().search(reason):
        return
    report.outcome = "failed"
    report.longrepr = f"module skipped in a strict run (KV_STRICT_SKIPS=1): {reason}"
