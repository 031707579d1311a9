#!/usr/bin/env bash
# The test command: every default nox session (lint, unit tests per package x Python, e2e).
# Extra arguments go to nox alone, e.g. `bash scripts/test.sh -s lint`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap-system.sh
# nox finds Python 3.11 and 3.12 through pyenv shims only when pyenv exposes both.
export PYENV_VERSION="${PYENV_VERSION:-3.11.7:3.12.1}"
python3.11 -m venv .nox-runner
.nox-runner/bin/python -m pip install -q --upgrade pip nox uv
nox=(.nox-runner/bin/nox --no-color)
if [ "$#" -gt 0 ]; then
    exec "${nox[@]}" "$@"
fi
# The default set (noxfile's nox.options.sessions), in three steps. The unit sessions mostly wait,
# so they run three at a time (scripts/parallel_sessions.py says why); the end-to-end sessions
# start real engines that take both cores, so they run one after the other.
failed=0
"${nox[@]}" -s lint || failed=1
.nox-runner/bin/python scripts/parallel_sessions.py --nox .nox-runner/bin/nox --tag tests --jobs 3 || failed=1
"${nox[@]}" -t e2e || failed=1
exit "$failed"
