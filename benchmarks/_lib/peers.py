"""Peers of the transfer benchmarks, each in its own process.

* :class:`PeerProcess`: the parent's handle on any such peer (``python -m MODULE ARGS``) speaking
  JSON lines: the raw TransferEngine target below, the echo peers of :mod:`.round_trip`, and the
  prefill workers of :mod:`.p2p_pull` and ``p2p/pull_concurrency``.
* ``python -m benchmarks._lib.peers BYTES``: the raw TransferEngine target. Registers one buffer of
  BYTES (each 4 KiB page starts with its index) with a Mooncake TransferEngine over loopback TCP,
  prints ``{"peer": "127.0.0.1:PORT", "addr": INT, "bytes": N}`` on stdout and serves reads until
  stdin closes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from benchmarks._lib.report import ROOT


class PeerProcess:
    """A peer in its own process: ``python -m MODULE ARGS`` with one OpenMP thread and Mooncake's
    logging quiet. Protocol (JSON lines): its first stdout line says it is ready (a line holding
    ``"error"`` or ``"ready": false`` says why not), every :meth:`request` line gets one reply line,
    and when its stdin closes it may print one last line (e.g. its leak report) before exiting."""

    def __init__(self, module: str, *args: str, what: str = "peer") -> None:
        env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True)
        self.ready: dict[str, Any] = self._read() or {"error": "exited before it was ready"}
        if "error" in self.ready or self.ready.get("ready") is False:
            self.close()
            raise RuntimeError(f"{what} did not start: {self.ready.get('error', self.ready)}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        return json.loads(line) if line.strip() else {}

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send one line, return the peer's reply line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self, timeout_s: float = 20.0) -> dict[str, Any]:
        """Close its stdin and let it exit (killed after ``timeout_s``); returns its last line."""
        last: dict[str, Any] = {}
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                last = self._read()
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait(5)
        return last


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
