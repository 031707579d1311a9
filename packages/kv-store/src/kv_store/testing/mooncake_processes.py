"""A ``mooncake_master`` (and a standalone ``mooncake_client`` holding pool memory) on loopback
for tests and benchmarks (Mooncake Store rows).

Standard library only: the binary comes with the ``mooncake-transfer-engine`` wheel (on PATH or next
to the running interpreter). It runs in its own process group and is stopped by pid on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TypeVar

from kv_common.testing.ports import free_port

_P = TypeVar("_P", bound="_LoopbackProcess")


class _LoopbackProcess:
    """One Mooncake binary on 127.0.0.1 in its own process group: started, ready once ``port``
    listens (or failed with the tail of its log), stopped by pid, its log removed."""

    binary = ""
    port: int
    start_timeout_s: float
    stop_timeout_s = 5.0

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: tempfile._TemporaryFileWrapper | None = None  # type: ignore[type-arg]

    def command(self, exe: str) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        return None

    @classmethod
    def executable(cls) -> str | None:
        """The binary on PATH or next to the running interpreter; None where it is not installed."""
        found = shutil.which(cls.binary)
        if found:
            return found
        beside = Path(sys.executable).parent / cls.binary
        return str(beside) if beside.exists() else None

    def __enter__(self: _P) -> _P:
        exe = self.executable() or self.binary  # not installed: Popen says so
        self._log = tempfile.NamedTemporaryFile(prefix=f"{self.binary}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            self.command(exe), stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=self._env()
        )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                tail = self.log_tail()
                self.__exit__()
                raise RuntimeError(f"{self.binary} exited rc={rc}: {tail}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return self
            time.sleep(0.1)
        tail = self.log_tail()
        self.__exit__()
        raise RuntimeError(
            f"{self.binary} did not listen on 127.0.0.1:{self.port} within {self.start_timeout_s}s: {tail}"
        )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        if self._log is None:
            return ""
        try:
            return Path(self._log.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is unmounted or cleaned up by the process itself."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            with contextlib.suppress(OSError):
                os.unlink(self._log.name)
            self._log = None


class MooncakeMaster(_LoopbackProcess):
    """``mooncake_master`` on 127.0.0.1, as a context manager.

    >>> with MooncakeMaster() as master:   # doctest: +SKIP
    ...     cfg = {"master_server_address": master.address}
    """

    binary = "mooncake_master"

    def __init__(self, lease_ttl_ms: int = 500, start_timeout_s: float = 10.0) -> None:
        super().__init__()
        self.port = free_port()
        self.metrics_port = free_port()
        self.lease_ttl_ms = lease_ttl_ms
        self.start_timeout_s = start_timeout_s
        self.address = f"127.0.0.1:{self.port}"

    def command(self, exe: str = "mooncake_master") -> list[str]:
        return [
            exe,
            f"-rpc_port={self.port}",
            "-rpc_address=127.0.0.1",
            "-metrics_host=127.0.0.1",
            f"-metrics_port={self.metrics_port}",
            f"-default_kv_lease_ttl={self.lease_ttl_ms}",
        ]

    def config_file(
        self, directory: str | os.PathLike[str], segment: str = "512mb", buffer: str = "128mb"
    ) -> str:
        """Mooncake's JSON config file (vLLM's MooncakeStoreConnector reads MOONCAKE_CONFIG_PATH)."""
        path = Path(directory) / f"mooncake-{self.port}.json"
        path.write_text(
            json.dumps(
                {
                    "local_hostname": "127.0.0.1",
                    "metadata_server": "P2PHANDSHAKE",
                    "protocol": "tcp",
                    "device_name": "",
                    "master_server_address": self.address,
                    "global_segment_size": segment,
                    "local_buffer_size": buffer,
                }
            )
        )
        return str(path)


class MooncakeClient(_LoopbackProcess):
    """Mooncake's standalone ``mooncake_client`` on 127.0.0.1: it mounts ``segment`` bytes into the
    pool of ``master_address`` and holds them until stopped, so values stored there outlive the
    vLLM instances that wrote them (which then mount nothing: ``mooncake.mount_segment: false``).

    >>> with MooncakeMaster() as master, MooncakeClient(master.address) as holder:   # doctest: +SKIP
    ...     ...   # instances store and exit; a fresh one still finds the values

    Ready once its service port listens (it mounts its segment before that). ``kill()`` stops it
    at once (SIGKILL), as a crash would: the master lists its keys until ``-client_ttl`` (10 s)
    passes, and reads of them fail meanwhile.
    """

    binary = "mooncake_client"
    stop_timeout_s = 10.0

    def __init__(self, master_address: str, segment: str = "256MB", start_timeout_s: float = 30.0) -> None:
        super().__init__()
        self.master_address = master_address
        self.segment = segment
        self.start_timeout_s = start_timeout_s
        self.port = free_port()

    def command(self, exe: str = "mooncake_client") -> list[str]:
        """The command line (what a deployment runs, with its own host and sizes)."""
        return [
            exe,
            f"-master_server_address={self.master_address}",
            "-metadata_server=P2PHANDSHAKE",
            "-protocol=tcp",
            "-host=127.0.0.1",
            f"-port={self.port}",
            f"-global_segment_size={self.segment}",
        ]

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
        # The master listens already: a few retries, not Mooncake's default ~90 s of them.
        env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "3")
        return env
