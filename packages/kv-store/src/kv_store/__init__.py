"""kv-store: the KV-cache pool connector for vLLM (prefix reuse through pluggable backends).

``AscendStoreConnector`` (``connector``) is the store connector core (``connector_base``) over a
``kv_store.backends`` entry point: ``embedded`` (default), ``mooncake`` (Mooncake Store), or a
third party's (kv-ucm adds ``ucm``). One module per concern:

- ``keys``            pure: block keys from vLLM's block-hash chain + model/layout/rank fingerprint
- ``lookup``          pure: how many tokens an external hit is worth
- ``codec``           value framing (payload + checksum / MAC trailer bound to the layout)
- ``manifest``        the namespace manifest checked at start-up
- ``config``          ``kv_connector_extra_config`` (generic keys, then AscendStoreConnector's)
- ``metadata``        scheduler -> worker per-step plan, worker -> scheduler report (msgspec)
- ``vllm_metadata``   the same as vLLM's ``KVConnectorMetadata`` subclasses
- ``scheduler``       scheduler-side state machine
- ``worker``          worker-side transfers (loads sync or async, saves in a background thread)
- ``failure_policy``  load errors -> vLLM's recompute policy
- ``stats``           the connector's counters and Prometheus metrics
- ``connector_base``  ``StoreConnectorBase``: the vLLM class; subclasses supply ``make_backend``
- ``backends``        backend selection by entry point; ``embedded``, ``mooncake_backend``: two backends
- ``testing``         a ``mooncake_master`` / ``mooncake_client`` on loopback for tests and benchmarks

Value layout: **one value per block, all layers concatenated** (layer order =
``register_kv_caches`` order), followed by a trailer. One key per block keeps the store round trips
(master RPCs for Mooncake) at one per block instead of one per block and layer.
"""

from importlib import metadata as _metadata

try:  # the one version source is pyproject.toml, read from the installed distribution's metadata
    __version__ = _metadata.version("kv-store")
except _metadata.PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"
