"""What kv-mooncake's tests share. Test modules import it (``from conftest import ...``): pytest
puts this folder on ``sys.path``, and each package's tests run in their own session."""

from __future__ import annotations

from kv_common.testing.ports import use_loopback_host

use_loopback_host()  # peers of these tests run in this process or beside it, reached at 127.0.0.1


class FakeTransferEngine:
    """Stands in for the TransferEngine where a test moves no byte through it (the TE has its own
    tests, and the layout tests copy the planned ranges themselves, in process)."""

    rpc_address = "127.0.0.1:1"

    def register(self, regions):
        self.regions = regions

    def close(self):
        pass
