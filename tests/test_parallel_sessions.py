"""scripts/parallel_sessions.py against a stand-in nox: every session runs, at most --jobs at a
time, longest first; each whole log is printed; one failed or overrunning session fails the run,
and an overrunning one is killed with everything it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "parallel_sessions.py"

SESSIONS = [
    {"session": "tests-3.11(package='kv-common')", "python": "3.11", "call_spec": {"package": "kv-common"}},
    {"session": "tests-3.11(package='kv-mooncake')", "python": "3.11", "call_spec": {"package": "kv-mooncake"}},
    {"session": "tests-3.11(package='kv-ucm')", "python": "3.11", "call_spec": {"package": "kv-ucm"}},
    {"session": "tests-3.12(package='kv-ucm')", "python": "3.12", "call_spec": {"package": "kv-ucm"}},
]

# A stand-in for nox: `-l -t TAG --json` lists SESSIONS; `--no-color -s NAME` records when it ran
# in $RUNS and behaves as $BEHAVIOUR says for that name (sleep seconds, exit code, hang).
FAKE_NOX = f'''#!{sys.executable}
import json, os, sys, time
args = sys.argv[1:]
if "-l" in args:
    print(json.dumps({json.dumps(SESSIONS)}))
    sys.exit(0)
name = args[args.index("-s") + 1]
sleep_s, rc, child = json.loads(os.environ["BEHAVIOUR"]).get(name, [0.3, 0, False])
start = time.time()
if child:  # a process of its own, as a test's engine would be: it must die with the session
    import subprocess
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.environ["CHILD"], "w").write(str(p.pid))
print(f"log of {{name}}")
sys.stdout.flush()
time.sleep(sleep_s)
with open(os.environ["RUNS"], "a") as f:
    f.write(json.dumps([name, start, time.time()]) + "\\n")
sys.exit(rc)
'''


def _run(tmp_path: Path, behaviour: dict, *extra: str) -> tuple[subprocess.CompletedProcess, list]:
    nox = tmp_path / "nox"
    nox.write_text(FAKE_NOX)
    nox.chmod(0o755)
    runs = tmp_path / "runs.jsonl"
    env = {**os.environ, "BEHAVIOUR": json.dumps(behaviour), "RUNS": str(runs), "CHILD": str(tmp_path / "child")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--nox", str(nox), "--tag", "tests", *extra],
                          capture_output=True, text=True, env=env, timeout=120)
    records = [json.loads(line) for line in runs.read_text().splitlines()] if runs.exists() else []
    return done, records


def _most_at_once(records: list) -> int:
    events = sorted([(start, 1) for _, start, _ in records] + [(end, -1) for _, _, end in records])
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_every_session_runs_at_most_jobs_at_a_time_longest_first(tmp_path):
    done, records = _run(tmp_path, {}, "--jobs", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(r[0] for r in records) == sorted(s["session"] for s in SESSIONS)
    assert _most_at_once(records) <= 2
    first_two = {r[0] for r in sorted(records, key=lambda r: r[1])[:2]}
    assert first_two == {"tests-3.11(package='kv-mooncake')", "tests-3.12(package='kv-ucm')"}
    for s in SESSIONS:  # each whole log, under a header naming the session
        assert f"===== {s['session']}: passed" in done.stdout and f"log of {s['session']}" in done.stdout
    assert "4 sessions tagged 'tests', 2 at a time" in done.stdout


def test_one_failed_session_fails_the_run_and_the_others_still_run(tmp_path):
    failing = "tests-3.11(package='kv-common')"
    done, records = _run(tmp_path, {failing: [0.1, 3, False]}, "--jobs", "3")
    assert done.returncode == 1
    assert len(records) == len(SESSIONS)
    assert f"* {failing}: failed (rc 3)" in done.stdout
    assert done.stdout.count(": success,") == len(SESSIONS) - 1


def test_a_session_past_its_limit_is_killed_with_what_it_started(tmp_path):
    hung = "tests-3.11(package='kv-ucm')"
    start = time.monotonic()
    done, records = _run(tmp_path, {hung: [60, 0, True]}, "--jobs", "4", "--session-limit-s", "2")
    assert time.monotonic() - start < 30
    assert done.returncode == 1
    assert f"===== {hung}: FAILED" in done.stdout and f"log of {hung}" in done.stdout
    assert hung not in [r[0] for r in records]  # it never got to finish
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 5
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child), "a process the killed session started outlived it"


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"
