"""Target side of the raw TransferEngine benchmark: ``python -m benchmarks._te_peer BYTES``.

Registers one buffer of BYTES (filled with a byte pattern) with a Mooncake TransferEngine over
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
    buf[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8) if nbytes <= (64 << 20) else 0x5A
    buf[::4096] = 7  # touch every page
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
