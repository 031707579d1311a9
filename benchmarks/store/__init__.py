"""Store sections: put / get through the store worker against the raw backend (kv-store, kv-ucm),
the value check's cost, and store loads against the forward."""
