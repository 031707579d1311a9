"""Disaggregated prefill with MooncakeConnectorV1, in one command.

    python examples/offline_disaggregated_prefill.py

Starts a prefill engine and a decode engine (separate processes), sends prompts through the prefill
(max_tokens=1, ``kv_transfer_params={"do_remote_decode": True}``), passes the returned
``kv_transfer_params`` to the decode, which pulls the KV blocks over the Mooncake TransferEngine,
and prints each output with the bytes moved and the time. It exits non-zero when the decode tokens
differ from a run without any connector, so it is a real check.

CPU: each engine is pinned to its own cores (``VLLM_CPU_OMP_THREADS_BIND``; override with
PROMPT_CPU_BIND / DECODE_CPU_BIND). Devices: PROMPT_DEVICE_ID / DECODE_DEVICE_ID list the devices of
each engine, one per rank, as vllm-ascend's example does (``PROMPT_DEVICE_ID=0,1
DECODE_DEVICE_ID=2,3``): the list's length is that engine's tensor-parallel size, and the list is
exported as CUDA_VISIBLE_DEVICES and ASCEND_RT_VISIBLE_DEVICES. On CPU the entries are the cores of
the ranks (rank i runs on core i of the list). MOONCAKE_PROTOCOL picks the transport (rdma, ascend,
nvlink). MODEL=<path> uses your model instead of the tiny random one.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from kv_common.testing import EngineProcess, assert_same_tokens  # noqa: E402
from kv_common.testing.tiny_model import cached_tiny_model  # noqa: E402


def _cpu_binds() -> tuple[str, str]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < 2:
        return "nobind", "nobind"
    half = len(cores) // 2
    span = lambda cs: f"{cs[0]}-{cs[-1]}" if len(cs) > 1 else str(cs[0])  # noqa: E731
    return span(cores[:half]), span(cores[half:])


def engine_devices(value: str | None) -> list[str]:
    """``"0,1"`` -> ``["0", "1"]``: the devices of one engine, one per TP rank (empty: unset)."""
    devices = [d.strip() for d in (value or "").split(",") if d.strip()]
    if len(set(devices)) != len(devices):
        raise ValueError(f"device list {value!r} names a device twice (one device per rank)")
    return devices


def engine_layout(var: str, default_bind: str, on_cpu: bool) -> tuple[int, dict[str, str], str]:
    """(TP size, device environment, CPU binding) of the engine whose devices ``var`` lists."""
    devices = engine_devices(os.environ.get(var))
    if not devices:
        return 1, {}, default_bind
    listed = ",".join(devices)
    env = {"CUDA_VISIBLE_DEVICES": listed, "ASCEND_RT_VISIBLE_DEVICES": listed}
    # vLLM's CPU worker binds rank i to the i-th '|'-separated core list.
    return len(devices), env, ("|".join(devices) if on_cpu else default_bind)


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return True
    return bool(current_platform.is_cpu())


def make_prompts(n: int, block_size: int = 128, seed: int = 0) -> list[list[int]]:
    """Prompts several blocks long; every other one shares a two-block prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 1000) for _ in range(2 * block_size)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(10, 1000) for _ in range(block_size + 37 * (i + 1))]
        prompts.append((shared + tail) if i % 2 == 0 else tail + shared[:50])
    return prompts


def kv_bytes_per_token(model_dir: str) -> int:
    """K and V of every layer for one token (float32), from the model's config.json."""
    import json

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * 4


def connector_config(role: str, port: int, **extra: object) -> dict:
    return {
        "kv_connector": "MooncakeConnectorV1",
        "kv_role": role,
        "kv_port": port,
        "kv_connector_extra_config": {"protocol": os.environ.get("MOONCAKE_PROTOCOL", "tcp"), **extra},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--port", type=int, default=int(os.environ.get("PREFILL_SIDE_CHANNEL_PORT", 17100)))
    ap.add_argument("--no-baseline", action="store_true", help="skip the no-connector comparison")
    args = ap.parse_args(argv)

    model = os.environ.get("MODEL") or str(cached_tiny_model())
    prompts = make_prompts(args.num_prompts)
    p_bind, d_bind = _cpu_binds()
    common = dict(max_tokens=args.max_tokens, max_model_len=2048, kv_cache_bytes=256 << 20)

    on_cpu = _on_cpu()
    p_tp, p_env, p_bind = engine_layout("PROMPT_DEVICE_ID", p_bind, on_cpu)
    d_tp, d_env, d_bind = engine_layout("DECODE_DEVICE_ID", d_bind, on_cpu)
    p_bind = os.environ.get("PROMPT_CPU_BIND", p_bind)
    d_bind = os.environ.get("DECODE_CPU_BIND", d_bind)

    def tp_kwargs(tp: int) -> dict:
        if tp == 1:
            return {}
        return {"extra_llm_kwargs": {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"},
                "start_timeout_s": 600}

    print(f"prefill: TP {p_tp} (devices {p_env.get('CUDA_VISIBLE_DEVICES', 'default')}, cores {p_bind}); "
          f"decode: TP {d_tp} (devices {d_env.get('CUDA_VISIBLE_DEVICES', 'default')}, cores {d_bind})")
    prefill = EngineProcess(model, kv_transfer_config=connector_config("kv_producer", args.port),
                            cpu_bind=p_bind, env=p_env, name="prefill", **tp_kwargs(p_tp), **common)
    decode = EngineProcess(model, kv_transfer_config=connector_config("kv_consumer", args.port + 100),
                           cpu_bind=d_bind, env=d_env, name="decode", **tp_kwargs(d_tp), **common)
    t0 = time.perf_counter()
    prefill.start(wait=False)
    decode.start(wait=False)  # both engines start in parallel
    with prefill, decode:
        print(f"engines ready in {time.perf_counter() - t0:.1f}s (prefill TP {p_tp}, cores {p_bind}; "
              f"decode TP {d_tp}, cores {d_bind})")
        pre = prefill.generate(prompts, [{"kv_transfer_params": {"do_remote_decode": True}}] * len(prompts),
                               max_tokens=1)
        params = pre.kv_transfer_params
        if not all(params):
            print("prefill returned no kv_transfer_params: is MooncakeConnectorV1 installed?", file=sys.stderr)
            return 2
        print(f"kv_transfer_params: prefill TP {params[0].get('remote_tp_size')} -> decode TP {d_tp}")
        # vLLM copies the prefill's own cache hits ("remote_prefill_cached_tokens") into the decode's
        # num_cached_tokens; drop it so the decode reports what it really loaded.
        forward = [{k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"} for p in params]
        t1 = time.perf_counter()
        dec = decode.generate(prompts, [{"kv_transfer_params": p} for p in forward])
        t_dec = time.perf_counter() - t1
        for i, (p, toks, cached) in enumerate(zip(prompts, dec.token_ids, dec.num_cached_tokens)):
            print(f"prompt {i}: {len(p)} tokens, {cached} loaded from the prefill, output {toks}")
        pulled_tokens = sum(dec.num_cached_tokens)
        nbytes = pulled_tokens * kv_bytes_per_token(model)
        print(f"prefill {pre.wall_s:.2f}s; decode (pull + {args.max_tokens} tokens) {dec.wall_s:.2f}s "
              f"({t_dec:.2f}s seen by the client); pulled {pulled_tokens} tokens' KV = {nbytes / 1e6:.1f} MB")
    print(f"decode log: {decode.log_path}")
    if args.no_baseline:
        return 0
    with EngineProcess(model, cpu_bind=p_bind, name="baseline", **common) as ref_engine:
        ref = ref_engine.generate(prompts)
    try:
        assert_same_tokens(dec, ref)
    except AssertionError as exc:
        print(f"MISMATCH against the no-connector run:\n{exc}", file=sys.stderr)
        return 1
    if any(c == 0 for c in dec.num_cached_tokens):
        print("the decode loaded nothing for some prompts", file=sys.stderr)
        return 1
    print(f"OK: {len(prompts)} prompts, decode tokens identical to the no-connector run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
