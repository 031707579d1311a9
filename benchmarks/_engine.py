"""Local helpers for the engine benchmarks (not a bench module: no ``run``).

* :class:`BenchEngine`: the harness's :class:`EngineProcess`, but running ``benchmarks._engine_child``
  (step and lookup timers, ``reset_prefix_cache``) and measuring the RSS of its process tree.
* :class:`MooncakeMaster`: a ``mooncake_master`` on loopback for the store rows.
* :func:`connector_configs`: the ``kv_transfer_config`` of every connector the benchmarks compare.
* :func:`importable`: whether a connector's module imports here (others are still writing them).
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kv_common.testing.engine import EngineProcess

from benchmarks.report import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BenchEngine(EngineProcess):
    """EngineProcess whose child is ``benchmarks._engine_child`` (in-process vLLM by default)."""

    def __init__(self, model_dir: Any, **kwargs: Any) -> None:
        kwargs.setdefault("multiprocess", False)
        super().__init__(model_dir, **kwargs)
        self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), self.env.get("PYTHONPATH", "")])

    def start(self, wait: bool = True) -> BenchEngine:  # same as EngineProcess.start, other module
        import selectors

        if self._proc is not None:
            raise RuntimeError("engine already started")
        self._workdir = Path(tempfile.mkdtemp(prefix=f"kv-bench-{self.name}-"))
        spec_path = self._workdir / "spec.json"
        spec_path.write_text(json.dumps(self.spec))
        self._stderr_fh = open(self._workdir / "stderr.log", "wb")  # noqa: SIM115 - closed in close()
        self._t_spawn = time.perf_counter()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._engine_child", str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr_fh,
            env=self.env,
            cwd=str(self._workdir),
            start_new_session=True,
        )
        self._sel = selectors.DefaultSelector()
        assert self._proc.stdout is not None
        self._sel.register(self._proc.stdout, selectors.EVENT_READ)
        if wait:
            self.wait_ready()
        return self

    def timings(self) -> dict[str, list[float]]:
        return self._request({"op": "timings"}, 60, "timings")

    def reset_prefix_cache(self) -> bool:
        return bool(self._request({"op": "reset_prefix_cache"}, 60, "reset_prefix_cache")["reset"])

    def rss_bytes(self) -> int:
        import psutil

        total = 0
        for pid in self.pids():
            with contextlib.suppress(psutil.Error):
                total += psutil.Process(pid).memory_info().rss
        return total


class MooncakeMaster:
    """``mooncake_master`` on 127.0.0.1 (own process group; stopped by pid on exit)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = f"127.0.0.1:{self.port}"

    def __enter__(self) -> MooncakeMaster:
        exe = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
        self._log = tempfile.NamedTemporaryFile(prefix="mooncake-master-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [
                exe,
                f"-rpc_port={self.port}",
                "-rpc_address=127.0.0.1",
                "-metrics_host=127.0.0.1",
                f"-metrics_port={self.metrics_port}",
                "-default_kv_lease_ttl=500",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited rc={self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return self
            time.sleep(0.1)
        raise RuntimeError(f"mooncake_master did not listen on {self.address}: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    def config_file(self, directory: str | Path, segment: str = "512mb", buffer: str = "128mb") -> str:
        """Mooncake's JSON config (vLLM's MooncakeStoreConnector reads MOONCAKE_CONFIG_PATH)."""
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


# Module each connector lives in: imported here first, so a connector others are still writing is
# reported in the notes instead of a 5-minute engine start failure.
CONNECTOR_MODULES = {
    "AscendStoreConnector": "kv_store.connector",
    "UCMConnector": "kv_ucm.connector",
    "MooncakeConnectorV1": "kv_mooncake.connector",
    "OffloadingConnector": "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "MooncakeStoreConnector": "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector",
    "MooncakeConnector": "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector",
    "ExampleConnector": "vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
}


def importable(connector: str) -> str | None:
    """None when the connector's module imports in a fresh interpreter, else the error's last line."""
    module = CONNECTOR_MODULES.get(connector)
    if module is None:
        return None
    code = f"import {module}, sys; cls = getattr({module}, {connector!r}, None); sys.exit(0 if cls else 3)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if proc.returncode == 0:
        return None
    if proc.returncode == 3:
        return f"{module} has no class {connector}"
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"import {module} failed (rc={proc.returncode})"


def first_error_line(exc: BaseException, limit: int = 300) -> str:
    """The most telling line of an (engine) error: the last exception line of the child traceback."""
    text = str(exc)
    candidates = [
        ln.strip()
        for ln in text.splitlines()
        if ("Error" in ln or "Exception" in ln or "error" in ln) and not ln.strip().startswith("File ")
    ]
    line = candidates[-1] if candidates else (text.strip().splitlines() or [type(exc).__name__])[0]
    return line[:limit]


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def connector_configs(
    name: str,
    *,
    workdir: Path,
    master: MooncakeMaster | None = None,
    role: str = "kv_both",
    embedded_capacity: int = 1 << 30,
    offload_bytes: int = 1 << 30,
    port_base: int | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """(kv_transfer_config, extra env) for a row name of the benchmarks.

    Every config asks vLLM to recompute on a failed load (``kv_load_failure_policy``), so a failing
    connector shows up as 0 tokens hit instead of failed requests.
    """
    env: dict[str, str] = {"MC_LOG_LEVEL": "ERROR", "MC_STORE_CLIENT_SETUP_RETRIES": "1"}
    cfg, env = _connector_config(
        name,
        workdir=workdir,
        master=master,
        role=role,
        embedded_capacity=embedded_capacity,
        offload_bytes=offload_bytes,
        port_base=port_base,
        env=env,
    )
    cfg.setdefault("kv_load_failure_policy", "recompute")
    return cfg, env


def _connector_config(
    name: str,
    *,
    workdir: Path,
    master: MooncakeMaster | None,
    role: str,
    embedded_capacity: int,
    offload_bytes: int,
    port_base: int | None,
    env: dict[str, str],
) -> tuple[dict[str, Any], dict[str, str]]:
    if name == "kv-store embedded":
        return {
            "kv_connector": "AscendStoreConnector",
            "kv_role": role,
            "kv_connector_extra_config": {
                "backend": "embedded",
                "embedded": {"capacity_bytes": embedded_capacity, "spill_dir": str(workdir / "spill")},
            },
        }, env
    if name == "kv-store mooncake":
        assert master is not None
        return {
            "kv_connector": "AscendStoreConnector",
            "kv_role": role,
            "kv_connector_extra_config": {
                "backend": "mooncake",
                "mooncake": {
                    "master_server_address": master.address,
                    "global_segment_size": "512mb",
                    "local_buffer_size": "128mb",
                    "setup_retries": 1,
                },
            },
        }, env
    if name == "kv-ucm":
        return {
            "kv_connector": "UCMConnector",
            "kv_role": role,
            "kv_connector_extra_config": {},
        }, env
    if name == "kv-mooncake P2P":
        port = port_base or free_port()
        return {
            "kv_connector": "MooncakeConnectorV1",
            "kv_role": role,
            "kv_port": port,
            "kv_connector_extra_config": {"side_channel_port": port, "pull_timeout_s": 10.0},
        }, env
    if name == "vLLM OffloadingConnector":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": offload_bytes},
        }, env
    if name == "vLLM MooncakeStoreConnector":
        assert master is not None
        env["MOONCAKE_CONFIG_PATH"] = master.config_file(workdir)
        return {"kv_connector": "MooncakeStoreConnector", "kv_role": role}, env
    if name == "vLLM MooncakeConnector":
        port = port_base or free_port()
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(port)
        return {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "kv_port": port,
            "kv_connector_extra_config": {},
        }, env
    if name == "vLLM ExampleConnector":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(workdir / "example")},
        }, env
    raise KeyError(name)


ROW_CONNECTOR = {
    "kv-store embedded": "AscendStoreConnector",
    "kv-store mooncake": "AscendStoreConnector",
    "kv-ucm": "UCMConnector",
    "kv-mooncake P2P": "MooncakeConnectorV1",
    "vLLM OffloadingConnector": "OffloadingConnector",
    "vLLM MooncakeStoreConnector": "MooncakeStoreConnector",
    "vLLM MooncakeConnector": "MooncakeConnector",
    "vLLM ExampleConnector": "ExampleConnector",
}
