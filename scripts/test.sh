#!/usr/bin/env bash
# The test command: every default nox session (lint, unit tests per package x Python, e2e).
# Extra arguments go to nox, e.g. `bash scripts/test.sh -s lint`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap-system.sh
# nox finds Python 3.11 and 3.12 through pyenv shims only when pyenv exposes both.
export PYENV_VERSION="${PYENV_VERSION:-3.11.7:3.12.1}"
python3.11 -m venv .nox-runner
.nox-runner/bin/python -m pip install -q --upgrade pip nox uv
exec .nox-runner/bin/nox --no-color "$@"
