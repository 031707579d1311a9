"""Local helpers for the engine benchmarks (not a bench module: no ``run``).

* :class:`BenchEngine`: the harness's :class:`EngineProcess` with the benchmark defaults: in-process
  vLLM and step / lookup timers (``instrument=True``); ``timings()``, ``reset_prefix_cache()`` and
  ``rss_bytes()`` come from the harness.
* :class:`MooncakeMaster`, :func:`free_port`: re-exported from :mod:`kv_common.testing`.
* :func:`connector_configs`: the ``kv_transfer_config`` of every connector the benchmarks compare.
* :func:`importable`: whether a connector's module imports here (others are still writing them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kv_common.testing.engine import EngineProcess
from kv_common.testing.ports import free_port
from kv_store.testing import MooncakeMaster

from benchmarks._lib.report import ROOT, progress

__all__ = [
    "OUR_CONNECTORS",
    "ROW_CONNECTOR",
    "VLLM_PEER",
    "BenchEngine",
    "MooncakeMaster",
    "connector_configs",
    "connector_report",
    "core_env",
    "first_error_line",
    "free_port",
    "importable",
    "kv_bytes_per_token",
    "pin",
    "random_llama",
    "runnable_rows",
    "scratch_dir",
    "settle_report",
]


class BenchEngine(EngineProcess):
    """EngineProcess with in-process vLLM and step / lookup timers by default."""

    def __init__(self, model_dir: Any, **kwargs: Any) -> None:
        kwargs.setdefault("multiprocess", False)
        kwargs.setdefault("instrument", True)
        super().__init__(model_dir, **kwargs)


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
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)},
    )
    if proc.returncode == 0:
        return None
    if proc.returncode == 3:
        return f"{module} has no class {connector}"
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"import {module} failed (rc={proc.returncode})"


def first_error_line(exc: BaseException, limit: int = 300) -> str:
    """The most telling line of an (engine) error: the last exception line of the child traceback;
    when that only points elsewhere ("see root cause above"), the last one of the engine's stderr."""

    def last_error(text: str) -> str | None:
        candidates = [
            ln.strip()
            for ln in text.splitlines()
            if ("Error" in ln or "Exception" in ln or "error" in ln) and not ln.strip().startswith("File ")
        ]
        return candidates[-1] if candidates else None

    # Errors Python reports while tearing objects down ("Exception ignored in: <... __del__>", e.g. a
    # connector's destructor failing on an attribute its failed __init__ never set) are secondary:
    # drop them, so the line shown is the root cause, not its aftermath.
    text = re.sub(r"Exception ignored in:.*?(?:\n\s*\n|\Z)", "\n", str(exc), flags=re.S)
    # The engine's own traceback comes before its stderr tail (whose warnings also say "Error").
    line = last_error(text.split("--- engine stderr (tail) ---")[0])
    if line is None or "root cause" in line:
        line = last_error(text) or line
    if line is None:
        line = (text.strip().splitlines() or [type(exc).__name__])[0]
    return line[:limit]


def connector_report(eng: EngineProcess) -> list[dict | None] | None:
    """Each in-process connector side's own ``leak_report()`` (scheduler, worker) now; None when the
    harness or the connector has none (needs ``instrument=True``)."""
    try:
        return eng._request({"op": "leak_report"}, 60.0, "leak_report")["connectors"]
    except Exception:  # noqa: BLE001 - an older harness, or a connector without one
        return None


def settle_report(eng: EngineProcess, settle_tries: int = 5) -> list[dict | None] | None:
    """:func:`connector_report` once the engine is idle. A scheduler learns that saves finished (or
    holds expired) only in a later step: up to ``settle_tries`` times, one request shorter than a
    block (nothing to save) steps the engine and the report is taken again, so what remains is held
    with nothing left in flight."""
    report = None
    for attempt in range(settle_tries + 1):
        report = connector_report(eng)
        if report is None or attempt == settle_tries or not any(v for side in report for v in (side or {}).values()):
            break
        time.sleep(0.5)
        eng.generate([[5 + attempt, 6, 7, 8]], max_tokens=1, timeout_s=120)
    eng.timings()  # the settle requests are not part of any measurement
    return report


def random_llama(num_layers: int, max_position_embeddings: int, seed: int) -> dict[str, Any]:
    """``cached_tiny_model`` arguments of the engine benchmarks' random float32 Llama: hidden 512,
    GQA 8/4 heads of 64; only its depth (how long a step or a prefill takes), its context and its
    weights' seed differ between benchmarks."""
    return dict(
        num_layers=num_layers,
        hidden_size=512,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=2048,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
    )


def kv_bytes_per_token(model: dict[str, Any], dtype_bytes: int = 4) -> int:
    """KV cache bytes one token takes in every layer (K and V; float32 unless told)."""
    return int(model["num_layers"]) * 2 * int(model["num_kv_heads"]) * int(model["head_dim"]) * dtype_bytes


def core_env(core: int | None) -> dict[str, str]:
    """Engine env for one OpenMP thread, bound to ``core`` when this machine has it (spinning OpenMP
    threads make step times swing by several x when other processes share the cores)."""
    if core is None or core >= (os.cpu_count() or 1):
        return {"OMP_NUM_THREADS": "1"}
    return {"VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1"}


def pin(eng: EngineProcess, core: int) -> None:
    """Every thread of the engine's processes on one core (OpenMP threads are bound by vLLM through
    VLLM_CPU_OMP_THREADS_BIND, see :func:`core_env`; this catches the rest: connector threads, the
    front-end)."""
    if core >= (os.cpu_count() or 1):
        return
    for pid in eng.pids():
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), {core})


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
    segment_bytes: int = 512 << 20,
) -> tuple[dict[str, Any], dict[str, str]]:
    """(kv_transfer_config, extra env) for a row name of the benchmarks.

    Every config asks vLLM to recompute on a failed load (``kv_load_failure_policy``), so a failing
    connector shows up as 0 tokens hit instead of failed requests. ``segment_bytes``: what each
    engine of a Mooncake store row mounts into the pool (a run that saves more than the pool holds
    measures Mooncake's eviction, not a hit).
    """
    segment = f"{max(1, segment_bytes >> 20)}mb"
    env: dict[str, str] = {"MC_LOG_LEVEL": "ERROR", "MC_STORE_CLIENT_SETUP_RETRIES": "1"}
    if name == "kv-store embedded":
        cfg: dict[str, Any] = {
            "kv_connector": "AscendStoreConnector",
            "kv_role": role,
            "kv_connector_extra_config": {
                "backend": "embedded",
                "embedded": {"capacity_bytes": embedded_capacity, "spill_dir": str(workdir / "spill")},
            },
        }
    elif name == "kv-store mooncake":
        assert master is not None
        cfg = {
            "kv_connector": "AscendStoreConnector",
            "kv_role": role,
            "kv_connector_extra_config": {
                "backend": "mooncake",
                "mooncake": {
                    "master_server_address": master.address,
                    "global_segment_size": segment,
                    "local_buffer_size": "128mb",
                    "setup_retries": 1,
                },
            },
        }
    elif name == "kv-ucm":
        ucm_root = workdir / "ucm"
        ucm_root.mkdir(parents=True, exist_ok=True)
        cfg = {
            "kv_connector": "UCMConnector",
            "kv_role": role,
            "kv_connector_extra_config": {
                "ucm_connector_config": {"store_pipeline": "Posix", "storage_backends": str(ucm_root)}
            },
        }
    elif name == "kv-mooncake P2P":
        # The side channel listens on kv_port (+ rank). A P2P prefill must keep stepping after its
        # request finished (see connectors/ttft.py, _p2p_session): run P and D with multiprocess=True.
        cfg = {
            "kv_connector": "MooncakeConnectorV1",
            "kv_role": role,
            "kv_port": port_base or free_port(),
            "kv_connector_extra_config": {"pull_timeout_s": 10.0},
        }
    elif name == "vLLM OffloadingConnector":
        cfg = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": offload_bytes},
        }
    elif name == "vLLM MooncakeStoreConnector":
        assert master is not None
        env["MOONCAKE_CONFIG_PATH"] = master.config_file(workdir, segment=segment)
        cfg = {"kv_connector": "MooncakeStoreConnector", "kv_role": role}
    elif name == "vLLM MooncakeConnector":
        port = port_base or free_port()
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(port)
        cfg = {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "kv_port": port,
            # Its default transport is RDMA; this machine has loopback TCP only.
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }
    elif name == "vLLM ExampleConnector":
        cfg = {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(workdir / "example")},
        }
    else:
        raise KeyError(name)
    cfg.setdefault("kv_load_failure_policy", "recompute")
    return cfg, env


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

# Our rows and vLLM's own connector doing the same job over the same engine (Mooncake store, Mooncake
# P2P): the pairs the sections compare side by side.
VLLM_PEER = {
    "kv-store mooncake": "vLLM MooncakeStoreConnector",
    "kv-mooncake P2P": "vLLM MooncakeConnector",
}

# Our three packages' connectors (the rows first checked with :func:`importable`).
OUR_CONNECTORS = {"AscendStoreConnector", "UCMConnector", "MooncakeConnectorV1"}


# Rows whose store only exists on another Python: measured by their own nox session instead.
ELSEWHERE = {
    "kv-ucm": (
        "ucm",
        "not run in this session: UCM's wheels are Python 3.12 only; kv-ucm is measured by "
        "`nox -s bench-ucm-3.12` (section 'UCM: TTFT with and without a UCM hit')",
    ),
}


def runnable_rows(rows: list[str], env_var: str, desc: str, notes: list[str]) -> Iterator[str]:
    """The rows to run, with a progress bar. ``env_var`` (comma-separated row names) restricts them;
    a row whose connector is one of ours and does not import here is skipped with a note, and so is
    a row whose store is only installed on another Python (:data:`ELSEWHERE`)."""
    only = [r.strip() for r in os.environ.get(env_var, "").split(",") if r.strip()]
    import_errors: dict[str, str | None] = {}
    for row in progress([r for r in rows if not only or r in only], desc=desc):
        connector = ROW_CONNECTOR.get(row)
        if row in ELSEWHERE and importlib.util.find_spec(ELSEWHERE[row][0]) is None:
            notes.append(f"{row}: {ELSEWHERE[row][1]}")
            continue
        if connector in OUR_CONNECTORS:
            if connector not in import_errors:
                import_errors[connector] = importable(connector)
            if import_errors[connector]:
                notes.append(f"{row}: not run, {connector} does not import here: {import_errors[connector]}")
                continue
        yield row
