"""Generic store-backed KV connector core: prefix blocks saved to and loaded from a ``Backend``.

Shared by kv-store (``AscendStoreConnector``) and kv-ucm. One module per concern:

- ``keys``       pure: block keys from vLLM's block-hash chain + model/layout/rank fingerprint
- ``lookup``     pure: how many tokens an external hit is worth
- ``codec``      value framing (payload + checksum trailer)
- ``config``     the generic ``kv_connector_extra_config`` keys
- ``metadata``   scheduler -> worker per-step plan, worker -> scheduler report (msgspec)
- ``scheduler``  scheduler-side state machine
- ``worker``     worker-side transfers (load sync or layer-wise, save in a background thread)
- ``connector``  ``StoreConnectorBase``: the vLLM class; subclasses supply ``make_backend``

Value layout (chosen and documented here): **one value per block, all layers concatenated**
(layer order = ``register_kv_caches`` order), followed by a 16-byte trailer (magic, crc32, length).
One key per block keeps the number of store round trips (master RPCs for Mooncake) at one per
block instead of one per block and layer; the cost is a gather/scatter through a staging buffer.
"""
