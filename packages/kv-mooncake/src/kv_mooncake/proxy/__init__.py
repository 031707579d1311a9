"""``kv-mooncake-proxy``: OpenAI-compatible front for disaggregated prefill (``pip install kv-mooncake[proxy]``).

Modules: :mod:`.config` (settings, command line), :mod:`.balancer` (instance choice),
:mod:`.upstreams` (instances' health and load), :mod:`.relay` (one request's legs, retries,
deadlines), :mod:`.exchange` (a request's state, a leg's outcomes), :mod:`.bodies` (legs' bodies,
OpenAI errors), :mod:`.app` (the FastAPI app), :mod:`.release` (freeing a prefill's blocks nobody
will pull), :mod:`.metrics` (Prometheus), :mod:`.cli` (entry point).
"""
