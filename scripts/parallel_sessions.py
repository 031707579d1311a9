"""Run nox sessions side by side, a few at a time, and print each one's whole log when it ends.

    python scripts/parallel_sessions.py --nox .nox-runner/bin/nox --tag tests --jobs 3

Why: the unit sessions mostly wait (deadlines, peers' threads, UCM's own 2-3 s store open and
close): kv-mooncake's unit tests use about a third of one core over their four minutes. Run one
after another they were 17 of CI's 60 minutes on two cores; side by side they share the cores they
were leaving idle. Each session still runs alone in its own venv, exactly as `nox -s NAME` would.

Stdlib only: it runs on the interpreter that runs nox.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Seconds each package's unit session took in the last CI on two cores: the longest start first, so
# no long session is left to run alone at the end. A package not listed counts as short.
EXPECTED_S = {"kv-mooncake": 270, "kv-ucm": 155, "kv-store": 120, "kv-common": 75}
SESSION_LIMIT_S = 1800  # one session past this is killed and reported failed, never waited on forever


@dataclass
class Running:
    name: str
    process: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)


def list_sessions(nox: str, tag: str) -> list[dict]:
    out = subprocess.run([nox, "-l", "-t", tag, "--json"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def expected_seconds(session: dict) -> int:
    package = session.get("call_spec", {}).get("package", "")
    # UCM's store code (the slow part of kv-ucm's tests) runs only where its wheels exist: 3.12.
    if package == "kv-ucm" and session.get("python") != "3.12":
        return 25
    return EXPECTED_S.get(package, 30)


def longest_first(sessions: list[dict]) -> list[str]:
    return [s["session"] for s in sorted(sessions, key=expected_seconds, reverse=True)]


def start(nox: str, name: str, logs: Path) -> Running:
    log = logs / f"{len(list(logs.iterdir())):02d}.log"
    with log.open("wb") as sink:
        # Own process group: a session overrunning its limit is killed with everything it started.
        process = subprocess.Popen([nox, "--no-color", "-s", name], stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    return Running(name, process, log)


def kill(run: Running) -> None:
    try:
        os.killpg(run.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if run.process.poll() is None:  # never wait on a session that escaped its group
        run.process.kill()
    run.process.wait()


def report(run: Running, rc: int, seconds: float) -> None:
    print(f"\n===== {run.name}: {'passed' if rc == 0 else f'FAILED (rc {rc})'} in {seconds:.0f} s =====", flush=True)
    sys.stdout.write(run.log.read_text(errors="replace"))
    sys.stdout.flush()


def run_all(nox: str, names: list[str], jobs: int, limit_s: float) -> dict[str, tuple[int, float]]:
    results: dict[str, tuple[int, float]] = {}
    waiting = list(names)
    running: list[Running] = []
    with tempfile.TemporaryDirectory(prefix="nox-parallel-") as tmp:
        logs = Path(tmp)
        try:
            while waiting or running:
                while waiting and len(running) < jobs:
                    running.append(start(nox, waiting.pop(0), logs))
                time.sleep(1.0)
                for run in list(running):
                    seconds = time.monotonic() - run.started
                    rc = run.process.poll()
                    if rc is None and seconds > limit_s:
                        kill(run)
                        rc = -signal.SIGKILL
                    if rc is not None:
                        running.remove(run)
                        results[run.name] = (rc, seconds)
                        report(run, rc, seconds)
        finally:
            for run in running:  # interrupted: nothing left behind
                kill(run)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nox", default="nox", help="the nox executable")
    parser.add_argument("--tag", required=True, help="run every session with this nox tag")
    parser.add_argument("--jobs", type=int, default=3, help="sessions at a time")
    parser.add_argument("--session-limit-s", type=float, default=SESSION_LIMIT_S)
    args = parser.parse_args(argv)
    names = longest_first(list_sessions(args.nox, args.tag))
    if not names:
        print(f"no nox session has the tag {args.tag!r}", file=sys.stderr)
        return 1
    began = time.monotonic()
    results = run_all(args.nox, names, max(1, args.jobs), args.session_limit_s)
    print(f"\n===== {len(names)} sessions tagged {args.tag!r}, {args.jobs} at a time, "
          f"in {time.monotonic() - began:.0f} s =====")
    for name in names:
        rc, seconds = results[name]
        print(f"* {name}: {'success' if rc == 0 else f'failed (rc {rc})'}, took {seconds:.0f} s")
    return 0 if all(rc == 0 for rc, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
