"""Target side of the raw TransferEngine benchmark: ``python -m benchmarks._te_peer BYTES``.

Registers one buffer of BYTES (each 4 KiB page starts with its index) with a Mooncake TransferEngine over
loopback TCP, prints ``{"peer": "127.0.0.1:PORT", "addr": INT, "bytes": N}`` on stdout and serves
reads until stdin closes.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    import numpy as np
    from mooncake.engine import TransferEngine

    nbytes = int(sys.argv[1])
    buf = np.empty(nbytes, dtype=np.uint8)
    buf[:] = 0x5A  # touches every page
    # Each 4 KiB page starts with its own index (uint64): a reader checks it read the right pages.
    buf[: nbytes - nbytes % 8].view(np.uint64)[::512] = np.arange((nbytes + 4095) // 4096, dtype=np.uint64)
    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        print(json.dumps({"error": f"initialize rc={rc}"}), flush=True)
        return 1
    rc = te.register_memory(buf.ctypes.data, nbytes)
    if rc != 0:
        print(json.dumps({"error": f"register_memory rc={rc}"}), flush=True)
        return 1
    print(
        json.dumps({"peer": f"127.0.0.1:{te.get_rpc_port()}", "addr": int(buf.ctypes.data), "bytes": nbytes}),
        flush=True,
    )
    sys.stdin.read()  # until the parent closes our stdin
    te.unregister_memory(buf.ctypes.data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
