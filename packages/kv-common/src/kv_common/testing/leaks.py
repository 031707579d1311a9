"""Leak checks for connector tests: threads, file descriptors, sockets, and connector-held state.

    baseline = LeakBaseline.capture()
    ... run the test ...
    baseline.assert_clean(connectors=[conn], allow_threads=["zmq-*"])

or, without a baseline, ``assert_no_leaks(connectors=[conn])``. Every check is polled until the
deadline, so background threads get time to wind down before the test fails.

A connector-like object takes part by implementing ``leak_report() -> dict[str, int]`` (e.g.
``{"held_blocks": 0, "pending_transfers": 0}``); every value must reach zero.
"""

from __future__ import annotations

import fnmatch
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LeakBaseline", "LeakError", "assert_no_leaks"]


class LeakError(AssertionError):
    pass


def _fd_table() -> dict[int, str]:
    """fd -> what it points to (Linux /proc; empty where unavailable)."""
    out: dict[int, str] = {}
    base = "/proc/self/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        try:
            out[int(name)] = os.readlink(os.path.join(base, name))
        except (OSError, ValueError):
            continue  # the fd used by listdir itself, or one closed meanwhile
    return out


def _inet_connections() -> set[tuple[Any, ...]]:
    try:
        import psutil
    except ImportError:
        return set()
    proc = psutil.Process()
    conns = (
        proc.net_connections(kind="inet")
        if hasattr(proc, "net_connections")
        else proc.connections(kind="inet")
    )
    return {(c.fd, c.type, tuple(c.laddr or ()), tuple(c.raddr or ()), c.status) for c in conns}


def _thread_desc(t: threading.Thread) -> str:
    return f"{t.name!r} (ident={t.ident}, daemon={t.daemon})"


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


@dataclass
class LeakBaseline:
    thread_idents: set[int]
    fds: dict[int, str]
    connections: set[tuple[Any, ...]]
    pid: int = field(default_factory=os.getpid)

    @classmethod
    def capture(cls) -> LeakBaseline:
        return cls(
            thread_idents={t.ident for t in threading.enumerate() if t.ident is not None},
            fds=_fd_table(),
            connections=_inet_connections(),
        )

    # ------------------------------------------------------------------ individual checks
    def new_threads(self, allow_threads: Iterable[str] = ()) -> list[threading.Thread]:
        allow = tuple(allow_threads)
        return [
            t
            for t in threading.enumerate()
            if t.ident not in self.thread_idents and t.is_alive() and not _matches(t.name, allow)
        ]

    def new_fds(self, allow_fds: Iterable[str] = ()) -> dict[int, str]:
        allow = tuple(allow_fds)
        now = _fd_table()
        return {
            fd: target
            for fd, target in now.items()
            if self.fds.get(fd) != target and not _matches(target, allow)
        }

    def new_connections(self) -> set[tuple[Any, ...]]:
        return _inet_connections() - self.connections

    def problems(
        self,
        *,
        connectors: Iterable[Any] = (),
        allow_threads: Iterable[str] = (),
        allow_fds: Iterable[str] = (),
    ) -> list[str]:
        out = []
        threads = self.new_threads(allow_threads)
        if threads:
            out.append(
                "threads started during the test are still alive: " + ", ".join(map(_thread_desc, threads))
            )
        conns = self.new_connections()
        if conns:
            out.append(f"inet sockets opened during the test are still open: {sorted(conns, key=repr)}")
        fds = self.new_fds(allow_fds)
        if fds:
            out.append(f"file descriptors opened during the test are still open: {fds}")
        out.extend(_connector_problems(connectors))
        return out

    def assert_clean(
        self,
        *,
        connectors: Iterable[Any] = (),
        allow_threads: Iterable[str] = (),
        allow_fds: Iterable[str] = (),
        timeout_s: float = 5.0,
    ) -> None:
        """Poll until nothing new is alive/open and every ``leak_report()`` is all zero, or fail."""
        if os.getpid() != self.pid:
            raise RuntimeError("LeakBaseline used in a different process than the one it was captured in")
        connectors = list(connectors)
        _poll(
            lambda: self.problems(connectors=connectors, allow_threads=allow_threads, allow_fds=allow_fds),
            timeout_s,
        )


def _connector_problems(connectors: Iterable[Any]) -> list[str]:
    out = []
    for conn in connectors:
        report_fn = getattr(conn, "leak_report", None)
        if report_fn is None:
            out.append(f"{type(conn).__name__} has no leak_report() method")
            continue
        try:
            report = dict(report_fn())
        except Exception as exc:  # noqa: BLE001 - report, don't crash the check
            out.append(f"{type(conn).__name__}.leak_report() raised {exc!r}")
            continue
        nonzero = {k: v for k, v in report.items() if v}
        if nonzero:
            out.append(f"{type(conn).__name__} still holds resources: {nonzero}")
    return out


def _poll(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        problems = check()
        if not problems:
            return
        if time.monotonic() >= deadline:
            raise LeakError(f"leak check failed after {timeout_s:.1f} s:\n  - " + "\n  - ".join(problems))
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def assert_no_leaks(
    *,
    connectors: Iterable[Any] = (),
    allow_threads: Iterable[str] = (),
    timeout_s: float = 5.0,
    baseline: LeakBaseline | None = None,
) -> None:
    """Fail if connectors still hold resources or threads outlive the test.

    With ``baseline`` this is ``baseline.assert_clean(...)`` (threads, fds, sockets, connectors).
    Without one, only connector ``leak_report()``s and non-daemon threads other than the main
    thread (and ``allow_threads`` name patterns) are checked: daemons cannot be told apart from
    the test framework's own without a baseline.
    """
    connectors = list(connectors)
    if baseline is not None:
        baseline.assert_clean(connectors=connectors, allow_threads=allow_threads, timeout_s=timeout_s)
        return
    allow = tuple(allow_threads)
    main = threading.main_thread()

    def check() -> list[str]:
        out = _connector_problems(connectors)
        stray = [
            t
            for t in threading.enumerate()
            if t is not main
            and t is not threading.current_thread()
            and not t.daemon
            and t.is_alive()
            and not _matches(t.name, allow)
        ]
        if stray:
            out.append("non-daemon threads are still alive: " + ", ".join(map(_thread_desc, stray)))
        return out

    _poll(check, timeout_s)
