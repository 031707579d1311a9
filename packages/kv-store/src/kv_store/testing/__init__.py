"""kv-store's test helpers for its own tests, the cross-package e2e tests and the benchmarks:
a ``mooncake_master`` and a standalone ``mooncake_client`` on loopback. Not imported by the
connector."""

from kv_store.testing.mooncake_processes import MooncakeClient, MooncakeMaster

__all__ = ["MooncakeClient", "MooncakeMaster"]
