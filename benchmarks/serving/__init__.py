"""Online serving through kv-mooncake-proxy: the proxy's cost, P/D goodput under vLLM's serving
benchmark, and routing (conditional disaggregation, KV events)."""
