"""``kv-mooncake-proxy``: OpenAI-compatible front for disaggregated prefill (``pip install kv-mooncake[proxy]``).

Modules: :mod:`.config` (settings, command line), :mod:`.balancer` (instance choice),
:mod:`.app` (legs, retries, deadlines, the FastAPI app), :mod:`.release` (freeing a prefill's
blocks nobody will pull), :mod:`.metrics` (Prometheus), :mod:`.cli` (entry point).
"""
